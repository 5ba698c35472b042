"""MagCache per-branch state: accumulated ratio and error, consecutive skips, the step counter, the stored residual."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..caching.state import CachedResidualState


@dataclass
class MagCacheState(CachedResidualState):
    """One CFG branch (one cond entry): its accumulators, its step position, and what a skip reuses.

    ``previous_residual`` (inherited) is the residual of the branch's last computed step. ``calls`` counts the
    branch's model calls; ``step_index`` is the step its last call belonged to. While calibrating, the three lists
    hold one entry per computed call: the magnitude ratio to the previous residual, its spread over tokens, and the
    cosine distance between the two residuals (the first call records 1.0, 0.0, 0.0).
    """

    label: str = ""
    calls: int = 0
    step_index: int | None = None
    accumulated_ratio: float = 1.0
    accumulated_err: float = 0.0
    accumulated_steps: int = 0
    norm_ratios: list[float] = field(default_factory=list)
    norm_stds: list[float] = field(default_factory=list)
    cos_dises: list[float] = field(default_factory=list)

    def reset_accumulators(self) -> None:
        self.accumulated_ratio = 1.0
        self.accumulated_err = 0.0
        self.accumulated_steps = 0
