"""``StackCacheConfig``: the fields every block-stack cache shares (TeaCache and MagCache extend it).

A cache's config is built once (by the caller: a node, a test, a script), checked once (``__post_init__``) and then
read, unchanged, by the cache's run (``caching.run.StackCacheRun.config``): it is frozen, holds only plain
values (numbers, strings, tuples, a ``torch.device``) and can be copied or sent as data. What changes during a run
(accumulators, residuals, the call in progress) lives in the run and its branch states, never here.
"""
from __future__ import annotations

from typing import ClassVar

import math
from dataclasses import KW_ONLY, dataclass

import torch

from .budget import StepProfile
from .few_step import FewStepRule
from .forecast import check_order
from .large_steps import LargeStepRule

MAX_SPEEDUP = 20.0  # the largest ``speedup``: 1 computed step in 20


@dataclass(frozen=True)
class StackCacheConfig:
    """What every block-stack cache is told (its own config class adds its policy's fields and their defaults).

    * ``threshold``: how much accumulated change the policy tolerates before it computes again; 0 = never skip (the
      setting that proves the hooks change nothing). Each cache's config gives it its default.
    * ``start_percent`` / ``end_percent``: every step whose position ``step / (total_steps - 1)`` lies outside this
      window is computed.
    * ``cache_device``: where cached residuals are kept; None keeps them where they were computed.
    * ``calibrate``: compute every step and record what the cache's calibration needs.
    * ``forecast_order`` (0, 1, 2): a skipped step adds the residual of the last computed step (0) or the
      extrapolation through the last 1 + order computed residuals to the step's sigma (``caching.forecast``);
      "auto" chooses the order per branch and skipped step from how well each predicted the run's computed
      residuals.
    * ``few_step``: the steps a run of few steps always computes (``caching.few_step``); None: no rule. A
      calibrating run ignores it (it computes every step anyway), and so does a run with a forward budget (its plan
      keeps the first and last steps).
    * ``large_steps``: the steps whose sigma step is large (``caching.large_steps``), always computed; None: no
      rule. A calibrating run and a run with a forward budget (its plan places them) ignore it.
    * ``forward_budget``: compute about this many of a run's steps (``caching.budget``), placed where they matter
      most for the final latent; the policy's threshold can bring one forward, its other rules (retention, K, the
      first steps it always computes) give way to the plan; 0 = no budget, the policy alone decides.
    * ``speedup`` (0, or from 1 to ``MAX_SPEEDUP``): a forward budget per run of ``total_steps / speedup`` steps
      (``budget_steps``; a run of few steps computes at least what ``few_step`` keeps); 0 = none. The caller sets the
      rest of a speed-up's recipe (``caching.speedup.recipe``); with it ``forward_budget`` must be 0.
    * ``skip_correction`` (0 to 1): after skipped steps, the next computed step also moves the latent by this fraction
      of what interpolating the gap between the two computed steps corrects in what the skipped steps added
      (``caching.skip_correction``); only with a sampler that takes Euler steps (``CallContext.euler_steps``);
      0 = off.
    * ``step_profile``: how fast the model's residual changes along sigma, from the cache's calibration; where the
      budget's plan places the computed steps (None: as if it changed in proportion to sigma).
    * ``model_label`` / ``notes``: what the run's statistics say about the model and the choice made for it.
    * ``with_reference``: the config a run uses instead when its conditioning carries reference latents (the
      caller decides; e.g. Flux Kontext's published entry where 'auto' chose Flux dev's), built and checked with
      this one; None: this config serves every run.

    Raises ValueError naming the field for a value no run can use.
    """

    threshold: float
    _: KW_ONLY  # the shared fields after ``threshold`` are keywords (a subclass's own fields may follow it)
    start_percent: float = 0.0
    end_percent: float = 1.0
    cache_device: torch.device | None = None
    calibrate: bool = False
    forecast_order: int | str = 0
    few_step: FewStepRule | None = None
    large_steps: LargeStepRule | None = None
    forward_budget: int = 0
    speedup: float = 0.0
    skip_correction: float = 0.0
    step_profile: StepProfile | None = None
    model_label: str = "unknown"
    notes: tuple[str, ...] = ()
    with_reference: "StackCacheConfig | None" = None

    threshold_values: ClassVar[str] = "a finite number >= 0"  # in words, for the error a bad threshold raises

    def __post_init__(self) -> None:
        object.__setattr__(self, "forecast_order", check_order(self.forecast_order))
        if not (isinstance(self.threshold, (int, float)) and math.isfinite(self.threshold) and self.threshold >= 0):
            raise ValueError(f"threshold must be {self.threshold_values}, got {self.threshold}")
        if isinstance(self.forward_budget, bool) or int(self.forward_budget) != self.forward_budget \
                or self.forward_budget < 0:
            raise ValueError(f"forward_budget must be a whole number of steps >= 0 (0: no budget), got "
                             f"{self.forward_budget!r}")
        object.__setattr__(self, "forward_budget", int(self.forward_budget))
        if isinstance(self.speedup, bool) or not isinstance(self.speedup, (int, float)) \
                or not (self.speedup == 0 or 1 <= self.speedup <= MAX_SPEEDUP):
            raise ValueError(f"speedup must be 0 (off) or a number from 1 to {MAX_SPEEDUP:g}, got {self.speedup!r}")
        object.__setattr__(self, "speedup", float(self.speedup))
        if self.speedup and self.forward_budget:
            raise ValueError(f"speedup ({self.speedup:g}) and forward_budget ({self.forward_budget}) both say how "
                             "many steps to compute: set one of them to 0")
        if isinstance(self.skip_correction, bool) or not isinstance(self.skip_correction, (int, float)) \
                or not 0.0 <= self.skip_correction <= 1.0:
            raise ValueError(f"skip_correction must be a number from 0 (off) to 1, got {self.skip_correction!r}")
        object.__setattr__(self, "skip_correction", float(self.skip_correction))
        if not 0.0 <= self.start_percent <= self.end_percent <= 1.0:
            raise ValueError(f"start_percent ({self.start_percent}) must not be above end_percent "
                             f"({self.end_percent}), both within 0..1")
        object.__setattr__(self, "notes", tuple(self.notes))

    @property
    def active_few_step(self) -> FewStepRule | None:
        """The few-step rule a run applies: none while calibrating or with a forward budget."""
        return None if self.calibrate or self.active_budget else self.few_step

    @property
    def active_large_steps(self) -> LargeStepRule | None:
        """The large-step rule a run applies: none while calibrating or with a forward budget."""
        return None if self.calibrate or self.active_budget else self.large_steps

    @property
    def active_budget(self) -> bool:
        """Whether a run applies a forward budget (``forward_budget`` or ``speedup``): never while calibrating."""
        return not self.calibrate and bool(self.forward_budget or self.speedup)

    def budget_steps(self, total_steps: int) -> int:
        """The steps a budgeted run of ``total_steps`` computes: ``forward_budget``, or ``total_steps / speedup``
        rounded, halves up (at least 2: the first and the last), and in a run of few steps at least as many as
        ``few_step`` keeps computing (its first and last steps, no two skipped in a row: 5 of 8)."""
        if self.forward_budget or not self.speedup:
            return self.forward_budget
        count = max(2, math.floor(total_steps / self.speedup + 0.5))  # halves round up
        if self.few_step is not None and self.few_step.applies(total_steps):
            count = max(count, total_steps - self.few_step.most_skippable(total_steps))
        return min(count, total_steps)

    def in_window(self, step: int, total_steps: int) -> bool:
        """True when ``step`` of ``total_steps`` lies within ``[start_percent, end_percent]``."""
        position = step / max(total_steps - 1, 1)
        return self.start_percent <= position <= self.end_percent
