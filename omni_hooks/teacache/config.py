"""TeaCache configuration."""
from __future__ import annotations

from typing import ClassVar

from dataclasses import dataclass

from ..caching.config import StackCacheConfig

RECOMMENDED = -1.0  # a ``threshold`` that means: the coefficients' ``recommended_threshold``
#: the recommended threshold of coefficients that come without one (a calibration file made before calibrations
#: wrote theirs)
DEFAULT_RECOMMENDED_THRESHOLD = 0.2
#: the speed-up a calibration's recommended threshold gives on the calibration's own run: the published
#: recommendations' (ComfyUI-TeaCache's README: Wan 2.1 14B 0.2 about 1.8x, FLUX 0.4 1.8x, HunyuanVideo 0.15 1.9x)
RECOMMENDED_SPEEDUP = 1.8


@dataclass(frozen=True)
class TeaCacheConfig(StackCacheConfig):
    """What TeaCache skips and when (the shared fields: ``StackCacheConfig``).

    ``coefficients`` map the relative L1 change of the modulated input to an estimate of the relative change of the
    transformer output: ``f(x) = c0*x^4 + c1*x^3 + c2*x^2 + c3*x + c4`` (highest degree first, numpy.poly1d order).
    ``|f(rel)|`` is accumulated per branch; while the sum stays below ``threshold`` (the node's ``rel_l1_thresh``)
    the block stack is skipped. ``threshold == 0`` means "never skip": the setting that proves the hooks change
    nothing. ``threshold == RECOMMENDED`` (-1, the default) becomes ``recommended_threshold``, the one published (or
    calibrated) with the coefficients.
    Steps ``< ret_steps`` and, with ``force_last_step``, the last step are always computed, and so is every step
    outside the start/end window. ``signal`` names which modulated input the coefficients were fitted on (the
    caller's extractor picks it; "default" for most models). ``calibrate`` computes every step and records (input
    change, output change) pairs for fitting coefficients.
    """

    threshold: float = RECOMMENDED
    coefficients: tuple[float, ...] = (0.0, 0.0, 0.0, 1.0, 0.0)
    ret_steps: int = 1
    force_last_step: bool = True
    signal: str = "default"
    recommended_threshold: float = DEFAULT_RECOMMENDED_THRESHOLD

    threshold_values: ClassVar[str] = f"{RECOMMENDED:g} (recommended) or a finite number >= 0"

    def __post_init__(self) -> None:
        if self.threshold == RECOMMENDED:
            object.__setattr__(self, "threshold", self.recommended_threshold)
        super().__post_init__()  # checks the threshold
        object.__setattr__(self, "coefficients", tuple(float(c) for c in self.coefficients))
        if len(self.coefficients) != 5:
            raise ValueError(f"coefficients must contain exactly 5 elements, got {len(self.coefficients)}")
        if self.ret_steps < 0:
            raise ValueError(f"ret_steps must be >= 0, got {self.ret_steps}")
