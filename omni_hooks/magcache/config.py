"""MagCache configuration: threshold, consecutive-skip limit, retention window and the per-branch ratio curves."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..caching.config import StackCacheConfig
from .interp import MagRatioTable

MISSING_RATIOS = ("MagCache needs mag_ratios (the per-step magnitude ratios of this model's residual). Run once with "
                  "calibrate=True, take the recorded ratios from get_calibration_result(), and pass them as "
                  "mag_ratios.")


@dataclass(frozen=True, kw_only=True)
class MagCacheConfig(StackCacheConfig):
    """What MagCache skips and when (the shared fields: ``StackCacheConfig``).

    At step t (of N) a branch multiplies its accumulated ratio by ``mag_ratios[t]`` (its own curve, nearest-
    interpolated to N), adds ``|1 - accumulated_ratio|`` to its accumulated error and counts one more step; it may
    reuse the cached residual while the error stays ``<= threshold`` and at most ``max_skip_steps`` (K) steps in a row
    are skipped; otherwise it computes and the accumulators restart. ``threshold == 0`` and ``K == 0`` both mean
    "never skip" (the settings that prove the hooks change nothing). The first ``int(retention_ratio * N + 0.5)``
    steps and every step outside the start/end window are computed.

    ``mag_ratios``: a flat list (one per step, every branch), a CFG-interleaved list ``[c0, u0, c1, u1, ...]`` with
    ``interleaved=True``, or a mapping ``{"cond": [...], "uncond": [...]}``. Required unless ``calibrate``.
    ``num_inference_steps`` is N when the host cannot say which step a call belongs to (then a branch's calls are
    counted and its state starts afresh after N of them); None means the length of the branch's curve.
    ``calibrate`` computes every step and records the magnitude ratio, its spread and the cosine distance of
    consecutive residuals per branch.
    """

    threshold: float = 0.06
    max_skip_steps: int = 2
    retention_ratio: float = 0.2
    mag_ratios: Sequence[float] | Mapping[str, Sequence[float]] | None = None
    interleaved: bool = False
    num_inference_steps: int | None = None
    ratio_table: MagRatioTable | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if int(self.max_skip_steps) != self.max_skip_steps or self.max_skip_steps < 0:
            raise ValueError(f"max_skip_steps (K) must be an integer >= 0, got {self.max_skip_steps}")
        object.__setattr__(self, "max_skip_steps", int(self.max_skip_steps))
        if not 0.0 <= self.retention_ratio <= 1.0:
            raise ValueError(f"retention_ratio must be in [0, 1], got {self.retention_ratio}")
        if self.num_inference_steps is not None and self.num_inference_steps <= 0:
            raise ValueError(f"num_inference_steps must be > 0, got {self.num_inference_steps}")
        if self.mag_ratios is None:
            if not self.calibrate:
                raise ValueError(MISSING_RATIOS)
        else:
            object.__setattr__(self, "ratio_table", MagRatioTable.from_values(self.mag_ratios, self.interleaved))
