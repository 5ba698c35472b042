"""Sequence parallelism: a model's token sequence split across ranks, attention exchanged exactly.

Usage (every rank, after ``torch.distributed.init_process_group``)::

    config = SequenceParallelConfig(ulysses_degree=2)
    plan = {
        "": {"img": SequenceParallelInput(split_dim=1, expected_dims=3, auto_pad=True)},
        "blocks.*.self_attn": SequenceParallelSelfAttention(),
        "final": SequenceParallelOutput(gather_dim=1, expected_dims=3),
    }
    sp = apply_sequence_parallel(model, config, plan)
    # the host routes attention through sp.attention (ComfyUI: transformer_options["optimized_attention_override"])
    # and gives caches sp.rank_view() in each CallContext
    ...
    remove_sequence_parallel(model, plan)
"""
from .attention import (
    SequenceParallelAttention,
    additive_key_bias,
    attention_math_with_lse,
    attention_with_lse,
    check_key_mask,
    heads_to_sequence,
    merge_attention,
    ring_attention,
    sdpa_attention,
    sequence_to_heads,
    split_keys_attention,
)
from .cache_sync import GroupAgreement
from .comm import CommRecord, CommStats, Communicator
from .config import SequenceParallelConfig
from .hooks import (
    SequenceParallelBatchHook,
    SequenceParallelGatherHook,
    SequenceParallelGatherOutsideCachesHook,
    SequenceParallelSelfAttentionHook,
    SequenceParallelSplitHook,
    SequenceParallelSplitOutsideCachesHook,
    apply_sequence_parallel,
    remove_sequence_parallel,
)
from .mesh import RankGroup, SequenceParallelMesh, group_layout
from .plan import (
    ModuleForwardMetadata,
    ReplicatedTokens,
    SequenceParallelCrossAttention,
    SequenceParallelInput,
    SequenceParallelModelPlan,
    SequenceParallelObjectInput,
    SequenceParallelOutput,
    SequenceParallelPartialInput,
    SequenceParallelRefusedInput,
    SequenceParallelSelfAttention,
    get_sp_plan_from_model,
    resolve_submodules,
    unwrap_module,
    validate_sp_plan,
)
from .run import ActiveSite, SequenceParallelRun
from .sharding import PaddingRecord

__all__ = [
    "ActiveSite",
    "CommRecord",
    "CommStats",
    "Communicator",
    "GroupAgreement",
    "ModuleForwardMetadata",
    "PaddingRecord",
    "RankGroup",
    "ReplicatedTokens",
    "SequenceParallelAttention",
    "SequenceParallelBatchHook",
    "SequenceParallelConfig",
    "SequenceParallelCrossAttention",
    "SequenceParallelGatherHook",
    "SequenceParallelGatherOutsideCachesHook",
    "SequenceParallelInput",
    "SequenceParallelMesh",
    "SequenceParallelModelPlan",
    "SequenceParallelObjectInput",
    "SequenceParallelOutput",
    "SequenceParallelPartialInput",
    "SequenceParallelRefusedInput",
    "SequenceParallelRun",
    "SequenceParallelSelfAttention",
    "SequenceParallelSelfAttentionHook",
    "SequenceParallelSplitHook",
    "SequenceParallelSplitOutsideCachesHook",
    "additive_key_bias",
    "apply_sequence_parallel",
    "attention_math_with_lse",
    "attention_with_lse",
    "check_key_mask",
    "get_sp_plan_from_model",
    "group_layout",
    "heads_to_sequence",
    "merge_attention",
    "remove_sequence_parallel",
    "resolve_submodules",
    "ring_attention",
    "sdpa_attention",
    "sequence_to_heads",
    "split_keys_attention",
    "unwrap_module",
    "validate_sp_plan",
]
