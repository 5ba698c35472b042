"""MagCache: skip the block stack while the modelled error of reusing the last residual stays small.

The error model is the product of calibrated per-step magnitude ratios ``||r_t|| / ||r_{t-1}||`` ("mag_ratios"),
stable across prompts for a given model and schedule (Ma et al., MagCache, arXiv 2506.09045).
"""
from ..context import CallContext
from .config import MagCacheConfig
from .hook import (
    HOOK_NAMES,
    MagCacheBlockHook,
    MagCacheHeadHook,
    MagCacheRun,
    MagCacheTailHook,
    apply_mag_cache_hook,
    residual_change,
)
from .interp import MagRatioTable, interleave, nearest_interp, split_interleaved
from .state import MagCacheState
from .strategy import (
    MagCacheStrategy,
    get_strategy,
    register_strategy,
    registered_strategies,
    unregister_strategy,
)

__all__ = [
    "CallContext",
    "HOOK_NAMES",
    "MagCacheBlockHook",
    "MagCacheConfig",
    "MagCacheHeadHook",
    "MagCacheRun",
    "MagCacheState",
    "MagCacheStrategy",
    "MagCacheTailHook",
    "MagRatioTable",
    "apply_mag_cache_hook",
    "get_strategy",
    "interleave",
    "nearest_interp",
    "register_strategy",
    "registered_strategies",
    "residual_change",
    "split_interleaved",
    "unregister_strategy",
]
