"""MagCache: skip the block stack while the modelled error of reusing the last residual stays small.

The error model is the product of calibrated per-step magnitude ratios ``||r_t|| / ||r_{t-1}||`` ("mag_ratios"),
stable across prompts for a given model and schedule (Ma et al., MagCache, arXiv 2506.09045).
"""
from ..context import CallContext
from .config import MagCacheConfig
from .hook import HOOK_NAMES, MagCacheRun, apply_mag_cache_hook, residual_change
from .interp import MagRatioTable, interleave, nearest_interp, split_interleaved
from .state import MagCacheState

__all__ = [
    "CallContext",
    "HOOK_NAMES",
    "MagCacheConfig",
    "MagCacheRun",
    "MagCacheState",
    "MagRatioTable",
    "apply_mag_cache_hook",
    "interleave",
    "nearest_interp",
    "residual_change",
    "split_interleaved",
]
