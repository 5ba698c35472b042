"""The context of one diffusion-model call, shared by every feature on the model (caches, offload, sequence parallel).

The host creates one ``CallContext`` per call of the diffusion model and hands the same object to each feature in
turn; features read what the host and earlier features wrote and write their own verdicts into typed fields. There is
no untyped scratch space: a new fact that features share gets a field here.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankView:
    """This process's place in a sequence-parallel group (world size 1 = no parallelism)."""

    rank: int = 0
    world_size: int = 1


@dataclass
class CallContext:
    """One call of the diffusion model.

    * ``branches`` / ``labels``: one key (stable within a run) and one display label ("cond", "uncond", "cond.1")
      per batch chunk, in batch order;
    * ``step`` / ``total_steps``: the sampler step this call belongs to (None when the host cannot tell);
    * ``blocks_run``: the block stack's verdict for this call, written by a cache at its head block: None until
      decided (and for a model without a cache), True when the blocks compute, False when they are passed through;
    * ``rank``: the sequence-parallel view of this process for this call.
    """

    branches: list[str]
    labels: list[str]
    step: int | None = None
    total_steps: int | None = None
    blocks_run: bool | None = None
    rank: RankView = RankView()
