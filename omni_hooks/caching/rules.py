"""Step rules: which calls a block-stack cache computes whatever its policy measured.

``StackCacheRun.decide`` asks the cache's policy (``decide_branches``) for one ``Decision`` per branch, then each rule
of its ``step_rules`` in order; a rule may turn a branch's verdict into a compute, and gives it its ``reason``. After
the call's verdict (the group's, under sequence parallelism) each rule hears it (``settle``). A rule is its own
statistics entry: the run's ``CacheRunStats.rules`` lists the run's rules, and the statistics show what each says
(``note``, ``summary``). Adding a rule is one class here (or anywhere: ``StackCacheRun.step_rules`` is a class
attribute) and one line in ``STEP_RULES``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .budget import BUDGET_REASON, MEASURED, TAIL, ForwardBudget
from .few_step import FEW_STEP_REASON
from .large_steps import LARGE_STEP_REASON
from .state import ActiveCall, Decision
from .stats import CALIBRATE, FIRST, MODEL_CACHE, REUSE, SHAPE, THRESHOLD, WINDOW

if TYPE_CHECKING:
    from ..blockstack import BlockStack
    from .config import StackCacheConfig

#: the reasons a branch computes whatever a forward budget says: nothing usable is cached, the step is outside the
#: user's start/end window, or the run calibrates
NEEDED_REASONS = frozenset({FIRST, SHAPE, WINDOW, CALIBRATE})


def compute_instead(decisions: list[Decision], reason: str) -> list[Decision]:
    """``decisions`` with every branch that may reuse made to compute for ``reason``."""
    return [Decision(reason, d.metric) if d.reason == REUSE else d for d in decisions]


class StepRule:
    """One rule of which steps compute. ``name``: its key among the run's rules (``StackCacheRun.rule``);
    ``reason``: what it records for a branch it makes compute (one of ``stats.REASONS``)."""

    name: str
    reason: str

    @classmethod
    def for_run(cls, config: StackCacheConfig, stack: BlockStack) -> StepRule | None:
        """The rule for a run of ``config`` on ``stack``; None where it does not apply to such a run."""
        return cls()

    def revise(self, call: ActiveCall, decisions: list[Decision]) -> list[Decision]:
        """The call's decisions after this rule (``decisions`` as they are where it has nothing to say)."""
        return decisions

    def settle(self, call: ActiveCall, compute: bool) -> None:
        """Hear the call's verdict."""

    def note(self) -> str | None:
        """What the rule did in this run, in words, for the statistics (None: nothing worth saying)."""
        return None

    def summary(self) -> dict[str, Any] | None:
        """The rule's figures for the statistics' summary (None: none)."""
        return None


class NothingCached(StepRule):
    """A branch with no residual kept yet computes."""

    name = reason = FIRST

    def revise(self, call: ActiveCall, decisions: list[Decision]) -> list[Decision]:
        return [Decision(FIRST, d.metric) if d.reason == REUSE and st.previous_residual is None else d
                for d, st in zip(decisions, call.states)]


class OtherShape(StepRule):
    """A branch whose residual was kept for an input of another shape computes."""

    name = reason = SHAPE

    def revise(self, call: ActiveCall, decisions: list[Decision]) -> list[Decision]:
        return [Decision(SHAPE, d.metric) if d.reason == REUSE and st.residual_input_shape != shape else d
                for d, st, shape in zip(decisions, call.states, call.branch_shapes)]


class Budget(StepRule):
    """A forward budget (``budget.ForwardBudget``): the plan's steps compute, a branch's threshold may bring one
    forward, what must compute does (``NEEDED_REASONS``); the policy's other rules (its first steps, retention, K)
    give way. Off while calibrating."""

    name = reason = BUDGET_REASON

    def __init__(self, budget: ForwardBudget, config: StackCacheConfig):
        self.budget = budget
        self.config = config

    @classmethod
    def for_run(cls, config: StackCacheConfig, stack: BlockStack) -> StepRule | None:
        return cls(ForwardBudget(config), config) if config.active_budget else None

    def revise(self, call: ActiveCall, decisions: list[Decision]) -> list[Decision]:
        step, total = call.context.step, call.context.total_steps
        if step is None or not total:
            return decisions
        if self.budget.total != total:
            outside = {s for s in range(total) if not self.config.in_window(s, total)}
            # a speed-up places by the measured trajectory: with a sampler that takes Euler steps, the step
            # profile's plan with the tail it favours; with any other, the plan it rates best unless that tail rates
            # better; the skip correction the run applies modelled (caching/budget.py says why)
            euler = call.context.euler_steps
            corrects = euler or call.context.weighted_correction
            by = (TAIL if euler else MEASURED) if self.config.speedup > 0 else None
            self.budget.start(total, list(call.context.schedule) if call.context.schedule else None, outside,
                              call.context.step_weights, by, self.config.skip_correction if corrects else 0.0)
        must = any(d.reason in NEEDED_REASONS for d in decisions)
        wants = self.config.threshold > 0 and any(d.reason == THRESHOLD for d in decisions)  # 0: the plan alone
        compute, why = self.budget.decide(step, wants, must)
        if not compute:
            return [d if d.reason in NEEDED_REASONS else Decision(REUSE, d.metric) for d in decisions]
        keep = {*NEEDED_REASONS, THRESHOLD}
        return [d if d.reason in keep else Decision(why or d.reason, d.metric) for d in decisions]

    def settle(self, call: ActiveCall, compute: bool) -> None:
        if call.context.step is not None and call.context.total_steps:
            self.budget.settle(call.context.step, compute)

    def note(self) -> str | None:
        return self.budget.describe() if self.budget.total else None

    def summary(self) -> dict[str, Any] | None:
        return self.budget.summary() if self.budget.total else None


class FewSteps(StepRule):
    """The few-step rule (``few_step.FewStepRule``): in a run of few steps, its first and last steps and the step
    after a skipped one compute. Off while calibrating and under a forward budget."""

    name = reason = FEW_STEP_REASON

    def __init__(self, config: StackCacheConfig):
        self.rule = config.active_few_step
        self.skipped: set[int] = set()  # the steps skipped so far
        self.described: str | None = None  # what the rule allowed, once a run of few steps began

    @classmethod
    def for_run(cls, config: StackCacheConfig, stack: BlockStack) -> StepRule | None:
        return cls(config) if config.active_few_step is not None else None

    def revise(self, call: ActiveCall, decisions: list[Decision]) -> list[Decision]:
        step, total = call.context.step, call.context.total_steps
        if not self.rule.applies(total):
            return decisions
        if self.described is None:  # once per run: the run's step count does not change
            self.described = self.rule.describe(total)
        if self.rule.forces(step, total, step is not None and step - 1 in self.skipped):
            return compute_instead(decisions, FEW_STEP_REASON)
        return decisions

    def settle(self, call: ActiveCall, compute: bool) -> None:
        if not compute and call.context.step is not None:
            self.skipped.add(call.context.step)

    def note(self) -> str | None:
        return self.described


class LargeSteps(StepRule):
    """The large-step rule (``large_steps.LargeStepRule``): the steps of large sigma steps compute, except in a run
    the few-step rule takes. Off while calibrating and under a forward budget."""

    name = reason = LARGE_STEP_REASON

    def __init__(self, config: StackCacheConfig):
        self.rule = config.active_large_steps
        self.few_step = config.active_few_step
        self.steps: frozenset[int] | None = None  # the run's large steps, once its schedule is known
        self.total = 0  # ... and its step count

    @classmethod
    def for_run(cls, config: StackCacheConfig, stack: BlockStack) -> StepRule | None:
        return cls(config) if config.active_large_steps is not None else None

    def revise(self, call: ActiveCall, decisions: list[Decision]) -> list[Decision]:
        context = call.context
        if self.few_step is not None and self.few_step.applies(context.total_steps):
            return decisions  # a run of few steps has the few-step rule (its last step included)
        if context.step is None or not context.schedule:
            return decisions
        if self.steps is None:  # once per run: the schedule does not change within it
            self.steps = self.rule.steps(context.schedule)
            self.total = len(context.schedule) - 1
        return compute_instead(decisions, LARGE_STEP_REASON) if context.step in self.steps else decisions

    def note(self) -> str | None:
        return self.rule.describe(self.steps, self.total) if self.steps else None


class ModelCache(StepRule):
    """A call the block stack says must compute (``BlockStack.must_compute``: it fills the model's own key/value
    cache) computes, for the reason the stack gives."""

    name = reason = MODEL_CACHE

    def __init__(self, stack: BlockStack):
        self.must_compute = stack.must_compute

    @classmethod
    def for_run(cls, config: StackCacheConfig, stack: BlockStack) -> StepRule | None:
        return cls(stack) if stack.must_compute is not None else None

    def revise(self, call: ActiveCall, decisions: list[Decision]) -> list[Decision]:
        must = self.must_compute(*call.head_call)
        return decisions if must is None else compute_instead(decisions, must)


#: the rules a cache run asks, in this order, after its policy
STEP_RULES: tuple[type[StepRule], ...] = (NothingCached, OtherShape, Budget, FewSteps, LargeSteps, ModelCache)
