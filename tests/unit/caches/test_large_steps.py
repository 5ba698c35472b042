"""Large steps (caching.large_steps): the steps of a schedule's large sigma steps are always computed, by either
cache's threshold policy; not under a forward budget (its plan places them) and not without a schedule."""
from __future__ import annotations

import pytest
import torch

from omni_hooks.caching.large_steps import LARGE_STEP_REASON, LargeStepRule
from omni_hooks.blockstack import StackSignal
from omni_hooks.teacache import CallContext, TeaCacheConfig, apply_teacache_hook

from .test_budget import shifted_schedule
from .test_forecast import Model, quadratic, stack_of


def test_a_shifted_schedule_has_its_large_steps_at_the_end_and_an_even_one_has_none():
    rule = LargeStepRule()
    assert rule.steps(shifted_schedule(30)) == {26, 27, 28, 29}
    assert rule.steps(shifted_schedule(8)) == {7}  # few steps: the last, which every cache computes anyway
    assert rule.steps([1 - i / 20 for i in range(21)]) == frozenset()
    assert rule.steps([1.0]) == frozenset()
    with pytest.raises(ValueError):
        LargeStepRule(factor=1.0)


def run(schedule, budget: int = 0, with_schedule: bool = True):
    model = Model(quadratic)
    signal = StackSignal(compute=lambda block, args, kwargs, captured: kwargs["sigma"][:, None])
    config = TeaCacheConfig(100.0, (0.0, 0.0, 0.0, 1.0, 0.0), large_steps=LargeStepRule(), forward_budget=budget)
    cache = apply_teacache_hook(stack_of(model), config, signal)
    x = torch.zeros(1, 4, 3, dtype=torch.float64)
    steps = len(schedule) - 1
    for step, s in enumerate(schedule[:-1]):
        cache.begin_call(CallContext(branches=["c"], labels=["c"], step=step, total_steps=steps, sigma=s,
                                     schedule=tuple(schedule) if with_schedule else None))
        try:
            model(x, torch.full((1,), s, dtype=torch.float64))
        finally:
            cache.end_call()
    return cache


def test_the_threshold_policy_computes_the_large_steps_and_says_so():
    cache = run(shifted_schedule(30))  # threshold 100: nothing else but the first and last step would compute
    computed = [e.step for e in cache.stats.evaluations if e.computed]
    assert computed == [0, 26, 27, 28, 29]
    assert [e.branches[0].reason for e in cache.stats.evaluations][26:29] == [LARGE_STEP_REASON] * 3
    note = next(n for n in cache.stats.summary()["notes"] if n.startswith("large steps"))
    assert "4 of 30 steps" in note and "(steps 27, 28, 29, 30)" in note


def test_a_budget_or_a_run_without_a_schedule_leaves_them_to_the_policy():
    assert [e.step for e in run(shifted_schedule(30), with_schedule=False).stats.evaluations if e.computed] == [0, 29]
    budgeted = run(shifted_schedule(30), budget=3)
    assert sum(e.computed for e in budgeted.stats.evaluations) == 3
    assert not any(b.reason == LARGE_STEP_REASON for e in budgeted.stats.evaluations for b in e.branches)
