"""Step rules (``omni_hooks.caching.rules``): a rule written here, outside the library, plugs into both caches as one
class and one line (the run's ``step_rules``), without touching ``StackCacheRun.decide``: its reason reaches the
records, it hears every verdict, and its statistics entry shows in the run's summary."""
from __future__ import annotations

import pytest
import torch

from omni_hooks.caching.few_step import FewStepRule
from omni_hooks.caching.large_steps import LargeStepRule
from omni_hooks.caching.rules import STEP_RULES, StepRule, compute_instead
from omni_hooks.caching.state import ActiveCall, Decision
from omni_hooks.magcache import MagCacheConfig, MagCacheRun
from omni_hooks.blockstack import StackSignal
from omni_hooks.teacache import TeaCacheConfig, TeaCacheRun

from .test_magcache import ToyDiT, computed, run_steps, toy_stack

STEPS = 9
SIGNAL = StackSignal(compute=lambda block, args, kwargs, captured: kwargs["t"])


class EveryThirdStep(StepRule):
    """The test's own rule: every third step computes."""

    name = reason = "every-third"

    def __init__(self) -> None:
        self.verdicts: list[bool] = []

    def revise(self, call: ActiveCall, decisions: list[Decision]) -> list[Decision]:
        return compute_instead(decisions, self.reason) if call.context.step % 3 == 0 else decisions

    def settle(self, call: ActiveCall, compute: bool) -> None:
        self.verdicts.append(compute)

    def note(self) -> str | None:
        return f"every third step: {self.verdicts.count(True)} computed"


def teacache(model, rules):
    run_cls = type("RuledTeaCacheRun", (TeaCacheRun,), {"step_rules": rules})
    run = run_cls(TeaCacheConfig(threshold=100.0, force_last_step=False, few_step=None, large_steps=None),
                  toy_stack(model), SIGNAL)
    run.install()
    return run


def magcache(model, rules):
    run_cls = type("RuledMagCacheRun", (MagCacheRun,), {"step_rules": rules})
    run = run_cls(MagCacheConfig(threshold=10.0, max_skip_steps=STEPS, retention_ratio=0.0,
                                 mag_ratios=[1.0] * STEPS, few_step=None, large_steps=None), toy_stack(model))
    run.install()
    return run


@pytest.mark.parametrize("apply", [teacache, magcache])
def test_a_rule_of_the_tests_own_plugs_in_without_touching_decide(apply):
    x = torch.randn(2, 5, 8)
    model = ToyDiT()
    plain = apply(model, STEP_RULES)
    run_steps(model, plain, STEPS, x, branches=("c", "u"), labels=("cond", "uncond"))
    plain.remove()
    assert computed(plain)[3] is False and computed(plain)[6] is False  # the policy alone skips those steps

    run = apply(model, (*STEP_RULES, EveryThirdStep))
    run_steps(model, run, STEPS, x, branches=("c", "u"), labels=("cond", "uncond"))
    run.remove()
    rule = run.rule("every-third")
    assert isinstance(rule, EveryThirdStep) and run.stats.rules[-1] is rule
    assert [computed(run)[s] for s in (0, 3, 6)] == [True, True, True]
    assert [e.branches[0].reason for e in run.stats.evaluations][3] == "every-third"
    assert [e.branches[1].reason for e in run.stats.evaluations][6] == "every-third"
    assert rule.verdicts == computed(run)  # it heard the verdict of every call
    assert computed(run)[1:3] == computed(plain)[1:3]  # where it says nothing, the run is the plain one
    assert f"every third step: {computed(run).count(True)} computed" in run.stats.summary()["notes"]


def test_rules_are_asked_in_order_and_only_those_that_apply_are_part_of_the_run():
    stack = toy_stack(ToyDiT())
    rules = {"few_step": FewStepRule(), "large_steps": LargeStepRule()}
    run = TeaCacheRun(TeaCacheConfig(threshold=0.1, **rules), stack, SIGNAL)
    assert [rule.name for rule in run.rules] == ["first", "shape", "few-step", "large-step"]
    assert run.rule("budget") is None and run.stats.rules is run.rules
    budgeted = TeaCacheRun(TeaCacheConfig(threshold=0.1, forward_budget=4, **rules), stack, SIGNAL)
    assert [rule.name for rule in budgeted.rules] == ["first", "shape", "budget"]  # the plan places every step
    calibrating = TeaCacheRun(TeaCacheConfig(calibrate=True, forward_budget=4, **rules), stack, SIGNAL)
    assert [rule.name for rule in calibrating.rules] == ["first", "shape"]
