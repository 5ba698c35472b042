"""omni_hooks: a host-agnostic hook library for diffusion transformers (torch, numpy and the standard library only).

Every torch module gets at most one ``HookRegistry``; hooks run ``pre_forward`` in declared phase order, at most one
hook per module overrides ``forward``, ``post_forward`` runs in reverse. That rule is what lets caches, offload and
sequence parallel compose on one model.
"""
from .base import (
    BaseState,
    HookPhase,
    HookRegistry,
    ModelHook,
    StateManager,
    module_has_active_hooks,
    overrides_forward,
    remove_hook_and_restore,
    sort_hooks_after_call,
)

__all__ = [
    "BaseState",
    "HookPhase",
    "HookRegistry",
    "ModelHook",
    "StateManager",
    "module_has_active_hooks",
    "overrides_forward",
    "remove_hook_and_restore",
    "sort_hooks_after_call",
]
