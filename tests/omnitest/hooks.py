"""Hooks the tests put on modules to see what dispatch does."""
from __future__ import annotations

from typing import Iterable

import torch

from omni_hooks import HookPhase, HookRegistry, ModelHook


class CountingHook(ModelHook):
    """A pre_forward-only hook of a chosen phase that counts the calls it sees (block offload has this shape)."""

    def __init__(self, phase: HookPhase):
        self.phase = phase
        self.calls = 0

    def pre_forward(self, module, *args, **kwargs):
        self.calls += 1
        return args, kwargs


def count_calls_on(modules: Iterable[torch.nn.Module], phase: HookPhase, name: str) -> list[CountingHook]:
    """Register one ``CountingHook`` of ``phase`` under ``name`` on every module; returns them in module order."""
    hooks = []
    for module in modules:
        hook = CountingHook(phase)
        HookRegistry.get_or_create(module).register_hook(name, hook)
        hooks.append(hook)
    return hooks
