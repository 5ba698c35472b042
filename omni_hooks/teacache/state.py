"""TeaCache per-branch state."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..caching.state import CachedResidualState


@dataclass
class TeaCacheState(CachedResidualState):
    """One CFG branch (one cond entry): what the next decision compares against and what a skip reuses."""

    cnt: int = 0
    accumulated_rel_l1_distance: float = 0.0
    previous_modulated_input: torch.Tensor | None = None
    # calibration mode: the previous stack output and the (input change, output change) pairs seen so far
    previous_output: torch.Tensor | None = None
    calibration_pairs: list[tuple[float, float]] = field(default_factory=list)
