"""TeaCache: skip the block stack while the modulated input has changed little since the last computed step."""
from .config import TeaCacheConfig
from .hook import (
    CallInfo,
    ModulatedInput,
    TeaCacheBlockHook,
    TeaCacheHook,
    TeaCacheRun,
    TeaCacheTailHook,
    apply_teacache_hook,
    fit_coefficients,
    relative_l1,
)
from .state import TeaCacheState

__all__ = [
    "CallInfo",
    "ModulatedInput",
    "TeaCacheBlockHook",
    "TeaCacheConfig",
    "TeaCacheHook",
    "TeaCacheRun",
    "TeaCacheState",
    "TeaCacheTailHook",
    "apply_teacache_hook",
    "fit_coefficients",
    "relative_l1",
]
