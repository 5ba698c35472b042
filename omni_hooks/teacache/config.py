"""TeaCache configuration."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..forecast import check_order
from ..few_step import FewStepRule


@dataclass
class TeaCacheConfig:
    """What TeaCache skips and when.

    ``coefficients`` map the relative L1 change of the modulated input to an estimate of the relative change of the
    transformer output: ``f(x) = c0*x^4 + c1*x^3 + c2*x^2 + c3*x + c4`` (highest degree first, numpy.poly1d order).
    ``|f(rel)|`` is accumulated per branch; while the sum stays below ``rel_l1_thresh`` the block stack is skipped.
    ``rel_l1_thresh == 0`` is allowed and means "never skip" (unlike vllm-omni, which rejects it): that is the
    setting that proves the hooks change nothing.
    Steps ``< ret_steps`` and, with ``force_last_step``, the last step are always computed, and so is every step whose
    position ``step / (total_steps - 1)`` lies outside ``[start_percent, end_percent]``.
    ``calibrate`` computes every step and records (input change, output change) pairs for fitting coefficients.
    ``forecast_order`` (0, 1, 2): a skipped step adds the residual of the last computed step (0) or the extrapolation
    through the last 1 + order computed residuals to the step's sigma (``omni_hooks.forecast``); "auto" chooses the
    order per branch and skipped step from how well each predicted the run's computed residuals.
    """

    rel_l1_thresh: float = 0.2
    coefficients: tuple[float, ...] = (0.0, 0.0, 0.0, 1.0, 0.0)
    ret_steps: int = 1
    force_last_step: bool = True
    start_percent: float = 0.0
    end_percent: float = 1.0
    cache_device: torch.device | None = None
    calibrate: bool = False
    forecast_order: int | str = 0
    #: the steps a run of few steps always computes (``omni_hooks.few_step``, e.g. ``FewStepRule()``); None: no rule
    few_step: FewStepRule | None = None

    def __post_init__(self) -> None:
        self.forecast_order = check_order(self.forecast_order)
        self.coefficients = tuple(float(c) for c in self.coefficients)
        if len(self.coefficients) != 5:
            raise ValueError(f"coefficients must contain exactly 5 elements, got {len(self.coefficients)}")
        if not self.rel_l1_thresh >= 0:
            raise ValueError(f"rel_l1_thresh must be >= 0, got {self.rel_l1_thresh}")
        if self.ret_steps < 0:
            raise ValueError(f"ret_steps must be >= 0, got {self.ret_steps}")
        if not 0.0 <= self.start_percent <= self.end_percent <= 1.0:
            raise ValueError(f"need 0 <= start_percent <= end_percent <= 1, got {self.start_percent}, {self.end_percent}")
