"""Few-step runs (``caching.few_step``): with at most 8 steps both caches compute the first two and the last step
and never skip two steps in a row, on every branch alike; longer runs are unchanged; the statistics say in words what
the rule allowed, and that a run too short to skip anything gained nothing."""
from __future__ import annotations

import pytest
import torch

from omni_hooks.caching.few_step import FEW_STEP_REASON, FewStepRule
from omni_hooks.magcache import MagCacheConfig, apply_mag_cache_hook
from omni_hooks.blockstack import StackSignal
from omni_hooks.teacache import TeaCacheConfig, apply_teacache_hook

from .test_magcache import ToyDiT, computed, run_steps, toy_stack

SIGNAL = StackSignal(compute=lambda block, args, kwargs, captured: kwargs["t"])


def magcache(model, steps, rule):
    # ratios of 1 and a generous threshold: without a rule every step after the first may reuse (K bounds the run)
    return apply_mag_cache_hook(toy_stack(model), MagCacheConfig(threshold=10.0, max_skip_steps=steps,
                                                                  retention_ratio=0.0, mag_ratios=[1.0] * steps,
                                                                  few_step=rule))


def teacache(model, steps, rule):
    return apply_teacache_hook(toy_stack(model), TeaCacheConfig(threshold=100.0, force_last_step=False,
                                                                few_step=rule), SIGNAL)


@pytest.mark.parametrize("apply", [magcache, teacache])
@pytest.mark.parametrize("steps, expected", [
    (8, [True, True, False, True, False, True, False, True]),
    (4, [True, True, False, True]),
    (3, [True, True, True]),
])
def test_a_few_step_run_keeps_its_ends_and_never_skips_twice_in_a_row(apply, steps, expected):
    model = ToyDiT()
    x = torch.randn(2, 5, 8)
    run = apply(model, steps, FewStepRule())
    run_steps(model, run, steps, x, branches=("c", "u"), labels=("cond", "uncond"))
    assert computed(run) == expected
    reasons = [e.branches[0].reason for e in run.stats.evaluations]
    assert reasons[1] == "few-step"
    note = run.stats.summary()["notes"][-1]
    assert note.startswith(f"few-step run ({steps} steps)")
    if steps == 3:  # nothing skippable: the run was too short to gain anything, and the statistics say so
        assert "too short for a cache to gain anything" in note
        assert run.stats.why_nothing_was_reused() == note
        assert any("too short" in w for w in run.stats.summary()["warnings"])
    else:
        assert run.stats.reused == FewStepRule().most_skippable(steps)
    run.remove()


@pytest.mark.parametrize("apply", [magcache, teacache])
def test_longer_runs_and_runs_without_the_rule_are_unchanged(apply):
    x = torch.randn(2, 5, 8)
    model = ToyDiT()
    with_rule = apply(model, 9, FewStepRule())
    run_steps(model, with_rule, 9, x, branches=("c", "u"), labels=("cond", "uncond"))
    with_rule.remove()
    without = apply(model, 9, None)
    run_steps(model, without, 9, x, branches=("c", "u"), labels=("cond", "uncond"))
    without.remove()
    assert computed(with_rule) == computed(without)
    assert with_rule.stats.rule_note(FEW_STEP_REASON) is None
    short = apply(model, 8, None)
    run_steps(model, short, 8, x, branches=("c", "u"), labels=("cond", "uncond"))
    assert computed(short)[1] is False  # without the rule the second step of a short run may reuse
    short.remove()


def test_the_rule_counts():
    rule = FewStepRule()
    assert [rule.most_skippable(n) for n in (1, 2, 3, 4, 5, 6, 7, 8)] == [0, 0, 0, 1, 1, 2, 2, 3]
    assert rule.most_skippable(20) == 20 and not rule.applies(20) and not rule.applies(None)
    assert not rule.forces(None, 8, False) and rule.forces(3, 8, True) and not rule.forces(3, 8, False)
    with pytest.raises(ValueError):
        FewStepRule(keep_start=-1)
