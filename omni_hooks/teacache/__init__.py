"""TeaCache: skip the block stack while the modulated input has changed little since the last computed step."""
from ..context import CallContext
from .config import RECOMMENDED, TeaCacheConfig
from .hook import (
    TeaCacheRun,
    apply_teacache_hook,
    fit_coefficients,
    recommended_threshold,
    relative_l1,
)
from .state import TeaCacheState

__all__ = [
    "RECOMMENDED",
    "CallContext",
    "TeaCacheConfig",
    "TeaCacheRun",
    "TeaCacheState",
    "apply_teacache_hook",
    "fit_coefficients",
    "recommended_threshold",
    "relative_l1",
]
