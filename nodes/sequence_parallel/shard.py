"""The Sequence Parallel feature's session on one rank, the same on rank 0 and on every worker: the family's plan on
the diffusion model, the attention exchange in each call's options, the call's batch split (CFG parallel) and its
output gathered, and this rank's ``RankView`` for the caches. Rank 0's session (``node``) adds the group and sends
each call; a worker's (``rank``) takes the degrees and mesh of the call rank 0 sent.
"""
from __future__ import annotations

from typing import Any

import torch

from ...omni_hooks.context import CallContext
from ...omni_hooks.sequence_parallel import (SequenceParallelConfig, SequenceParallelMesh, apply_sequence_parallel,
                                            remove_sequence_parallel)
from ..families import ModelFamily
from ..features import FeatureSession

KIND = "sequence_parallel"
ATTENTION_OVERRIDE = "optimized_attention_override"
OPTIONS_NAME = "transformer_options"
# the modules of other nodes known to set ATTENTION_OVERRIDE, by the name a user knows them by
ATTENTION_OVERRIDERS = {"comfy_extras.nodes_sparse_attention": "ComfyUI's Model Sparse Attention node "
                                                               "(BlockSparseAttention, ComfyUI 0.35 and later)",
                        "comfy.model_patcher": "a node that sets the model's attention function (e.g. ComfyUI's "
                                               "ModelAttentionBackend)"}


def attention_taken_error(node: str, override: Any) -> ValueError:
    """The error for a MODEL whose ATTENTION_OVERRIDE another node already set: Sequence Parallel needs the seam to
    split attention over the ranks, and the other ranks would not run the other node's attention (they build the model
    from its config and weights). Names the other node (known ones by name, others by their function)."""
    module = getattr(override, "__module__", None) or type(override).__module__
    other = ATTENTION_OVERRIDERS.get(module) or (
        f"{module}.{getattr(override, '__qualname__', type(override).__qualname__)}")
    return ValueError(f"{node}: {other} already overrides ComfyUI's attention on this model; Sequence Parallel needs "
                      "that override to split attention across the ranks, and the other ranks would not run the other "
                      f"node's attention. Fix: use one of them on this model (remove {other}, or Sequence Parallel)")


class ShardSession(FeatureSession):
    """The Sequence Parallel feature's part of one sampling run on one rank. A subclass's ``install`` calls
    ``install_shard`` with the call's degrees and mesh."""

    def __init__(self, patcher, feature, detected):
        super().__init__(patcher, feature, detected)
        self.run = None
        self.plan = None
        self.installed_on: torch.nn.Module | None = None

    def install_shard(self, diffusion_model: torch.nn.Module, family: ModelFamily, config: SequenceParallelConfig,
                      mesh: SequenceParallelMesh) -> None:
        plan = family.sequence_plan(diffusion_model)
        self.run = apply_sequence_parallel(diffusion_model, config, plan, mesh=mesh, batch_hook=False)
        self.plan, self.installed_on = plan, diffusion_model

    def remove(self) -> None:
        if self.installed_on is not None:
            remove_sequence_parallel(self.installed_on, self.plan)
        self.installed_on, self.plan = None, None

    def before_call(self, args: tuple, kwargs: dict, transformer_options: dict) -> None:
        transformer_options[ATTENTION_OVERRIDE] = self.run.attention
        self.run.reset()

    def call_arguments(self, args: tuple, kwargs: dict, options: dict) -> tuple[tuple, dict]:
        """CFG parallel: this rank's part of a model call's batch (``transformer_options`` stays whole). Done here,
        inside the DIFFUSION_MODEL wrapper, not by a hook on the diffusion model: ComfyUI runs that wrapper inside the
        model's forward, so a hook there would run before a run's first call installed anything."""
        names = [OPTIONS_NAME if a is options else "" for a in args]
        return self.run.split_batch(args, kwargs, names)

    def call_output(self, output: Any) -> Any:
        return self.run.gather_batch(output)

    def begin_call(self, context: CallContext) -> None:
        context.rank = self.run.rank_view()
