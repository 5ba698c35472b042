"""What the pack needs to know about one model family, in one place shared by every cache node."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ...omni_hooks.blockstack import BlockStack
from ...omni_hooks.teacache import ModulatedInput
from ..coefficients import PUBLISHED, TeaCacheCoefficients


class UnsupportedModelError(ValueError):
    """The MODEL is not a diffusion transformer this pack has an adapter for."""


@dataclass
class ModelAdapter:
    """One detected model: its family and variant, its block stack, and its TeaCache signal.

    ``teacache_key`` is the published coefficient set that fits the detected variant (None when none is published
    or the weights cannot tell which one fits); ``notes`` are facts the user should see (e.g. "720p i2v uses
    the same weights shape as 480p: choose the variant").
    """

    family: str
    variant: str
    build_stack: Callable[[torch.nn.Module], BlockStack]
    build_modulated_input: Callable[[torch.nn.Module, str], ModulatedInput]
    teacache_key: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def teacache_coefficients(self) -> TeaCacheCoefficients | None:
        return PUBLISHED.get(self.teacache_key) if self.teacache_key else None

    def describe(self) -> str:
        return f"{self.family} ({self.variant})"
