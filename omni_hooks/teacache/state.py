"""TeaCache per-branch state."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..base import BaseState


@dataclass
class TeaCacheState(BaseState):
    """One CFG branch (one cond entry): what the next decision compares against and what a skip reuses."""

    cnt: int = 0
    accumulated_rel_l1_distance: float = 0.0
    previous_modulated_input: torch.Tensor | None = None
    previous_residual: torch.Tensor | None = None
    # shape of the head input the residual was measured on: a skip is only valid for the same shape
    residual_input_shape: torch.Size | None = None
    # calibration mode: the previous stack output and the (input change, output change) pairs seen so far
    previous_output: torch.Tensor | None = None
    calibration_pairs: list[tuple[float, float]] = field(default_factory=list)

    def reset(self) -> None:
        self.__init__()
