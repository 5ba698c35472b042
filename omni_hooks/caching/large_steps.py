"""Large steps: the steps of a run's schedule that a block-stack cache always computes.

What a skipped step's made-up residual errs by reaches the latent multiplied by the step's sigma step, and nothing
after the last steps repairs it. A shifted flow schedule (Wan, Flux, HunyuanVideo at their usual shifts) takes its
largest sigma steps at the end: at 30 steps with shift 5 the last one moves sigma by 0.22 and the three before it by
0.15, 0.11 and 0.08, against a mean of 0.033. An accumulated-change policy skips most there, because the model's
input changes little from step to step, and one more computed step elsewhere can push a skip onto one of them: on the
benchmark models that made a lower threshold, with more computed steps, lose up to 4 dB (docs/benchmarks.md). So a
step whose sigma step is at least ``factor`` times the schedule's mean step is never skipped. The rule needs the
run's schedule (``CallContext.schedule``); it is the same on every rank. A run of few steps has the few-step rule
instead (``omni_hooks.caching.few_step``: its first steps, its last, no two skips in a row).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..context import sigma_steps

LARGE_STEP_REASON = "large-step"


@dataclass(frozen=True)
class LargeStepRule:
    """Which steps a run always computes: those whose sigma step is at least ``factor`` times the mean one."""

    factor: float = 2.0

    def __post_init__(self) -> None:
        if not self.factor > 1:
            raise ValueError(f"LargeStepRule: factor must be above 1, got {self.factor}")

    def steps(self, schedule: tuple[float, ...] | list[float]) -> frozenset[int]:
        """The large steps of ``schedule`` (its sigmas, the last one after the final step)."""
        sizes = sigma_steps(schedule)
        if not sizes:
            return frozenset()
        bound = self.factor * sum(sizes) / len(sizes)
        return frozenset(i for i, size in enumerate(sizes) if size > 0 and size >= bound)

    def describe(self, steps: frozenset[int], total: int) -> str:
        """In words, for the run's statistics (steps numbered from 1)."""
        listed = ", ".join(str(s + 1) for s in sorted(steps))
        return (f"large steps: {len(steps)} of {total} steps move sigma by at least {self.factor:g}x the schedule's "
                f"mean step and are always computed (steps {listed})")
