"""What the pack needs to know about one model family, in one place shared by every cache node."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ...omni_hooks.blockstack import BlockStack, SkipFn
from ...omni_hooks.teacache import ModulatedInput
from ..coefficients import PUBLISHED, TeaCacheCoefficients


class UnsupportedModelError(ValueError):
    """The MODEL is not a diffusion transformer this pack has an adapter for."""


@dataclass
class ModelAdapter:
    """One detected model: its family and variant, its block stack, and its TeaCache signal.

    ``teacache_key`` is the published coefficient set that fits the detected variant (None when none is published
    or the weights cannot tell which one fits); ``notes`` are facts the user should see (e.g. "720p i2v uses
    the same weights shape as 480p: choose the variant"). ``magcache_key`` / ``magcache_notes`` are the same for
    MagCache's published curves.
    """

    family: str
    variant: str
    build_stack: Callable[[torch.nn.Module], BlockStack]
    build_modulated_input: Callable[[torch.nn.Module, str], ModulatedInput]
    teacache_key: str | None = None
    notes: list[str] = field(default_factory=list)
    # the published MagCache curve that fits (nodes/magcache_curves.py), and what the user should know about it
    magcache_key: str | None = None
    magcache_notes: list[str] = field(default_factory=list)

    @property
    def teacache_coefficients(self) -> TeaCacheCoefficients | None:
        return PUBLISHED.get(self.teacache_key) if self.teacache_key else None

    def describe(self) -> str:
        return f"{self.family} ({self.variant})"


def call_arg(args: tuple, kwargs: dict, name: str, index: int, default=None):
    """An argument of a block call, by keyword ``name`` or else at position ``index`` (``default`` if absent)."""
    if name in kwargs:
        return kwargs[name]
    return args[index] if index < len(args) else default


def skip_by_type(skips: dict[type, SkipFn], inner: Callable[[torch.nn.Module], torch.nn.Module] | None = None
                 ) -> SkipFn:
    """A ``skip_block`` for stacks of several block types: the skip of the first type ``block`` is an instance of.

    ``inner(block)`` picks the module whose type decides (for wrapper blocks such as HiDream's ``HiDreamImageBlock``).
    """
    items = list(skips.items())

    def skip(block: torch.nn.Module, args: tuple, kwargs: dict):
        probe = inner(block) if inner is not None else block
        for cls, fn in items:
            if isinstance(probe, cls):
                return fn(block, args, kwargs)
        raise TypeError(f"no skip rule for block type {type(probe).__name__}")

    return skip
