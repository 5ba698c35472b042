"""Few-step runs: what a block-stack cache keeps computing when a run has very few steps.

Distilled models (Z-Image Turbo, Flux schnell, Wan with 4-step LoRAs) sample in 8 steps or fewer. Each step is then a
large part of the trajectory, and users of every cache pack report that caching such runs gains little or breaks
them. With a run of at most ``max_steps`` steps a cache therefore computes the first ``keep_start`` and the last
``keep_end`` steps and never skips two consecutive steps (one skip already reuses a residual an eighth or more of the
trajectory old). The rule is the same on every rank: it depends only on the step and on what the run did before.
"""
from __future__ import annotations

from dataclasses import dataclass

FEW_STEP_REASON = "few-step"


@dataclass(frozen=True)
class FewStepRule:
    """Which steps of a run of at most ``max_steps`` steps are always computed (see the module docstring)."""

    max_steps: int = 8
    keep_start: int = 2
    keep_end: int = 1

    def __post_init__(self) -> None:
        if self.max_steps < 0 or self.keep_start < 0 or self.keep_end < 0:
            raise ValueError(f"FewStepRule: every count must be >= 0, got {self}")

    def applies(self, total_steps: int | None) -> bool:
        """True for a run whose step count is known and at most ``max_steps``."""
        return bool(total_steps) and total_steps <= self.max_steps

    def forces(self, step: int | None, total_steps: int | None, previous_step_skipped: bool) -> bool:
        """True when ``step`` of a few-step run must be computed."""
        if step is None or not self.applies(total_steps):
            return False
        return step < self.keep_start or step >= total_steps - self.keep_end or previous_step_skipped

    def most_skippable(self, total_steps: int) -> int:
        """The most steps a run of ``total_steps`` can skip under this rule (no two in a row)."""
        if not self.applies(total_steps):
            return total_steps
        free = max(total_steps - self.keep_start - self.keep_end, 0)
        return (free + 1) // 2

    def describe(self, total_steps: int) -> str:
        """In words, for run statistics: what the rule allowed in a run of ``total_steps`` steps."""
        most = self.most_skippable(total_steps)
        last = "the last step" if self.keep_end == 1 else f"the last {self.keep_end} steps"
        text = (f"few-step run ({total_steps} steps): the first {self.keep_start} steps and {last} are computed and "
                f"no two steps in a row are skipped, so at most {most} of {total_steps} can be skipped")
        if most == 0:
            text += "; this run is too short for a cache to gain anything (use it on runs of more steps)"
        return text
