"""The forward budget (caching.budget) and a cache run under it: the plan, its placement, its count, the policy's
threshold inside it, what a calibrating run records for it and what the statistics say."""
from __future__ import annotations

import itertools

import pytest
import torch

from omni_hooks.caching import budget as budget_module
from omni_hooks.caching.budget import (BUDGET_REASON, SKETCH_VALUES, ForwardBudget, StepProfile, compact, gap_costs,
                                       measured_costs, measured_or_tail, measured_plan, plan_cost, plan_steps,
                                       steps_in_sigma, tail_plan)
from omni_hooks.caching.residuals import SKETCH_ROWS_AT_ONCE, sketch
from omni_hooks.caching.config import StackCacheConfig
from omni_hooks.caching.few_step import FewStepRule
from omni_hooks.magcache import MagCacheConfig, apply_mag_cache_hook
from omni_hooks.blockstack import StackSignal
from omni_hooks.teacache import CallContext, TeaCacheConfig, apply_teacache_hook

from .test_forecast import BASE, Model, quadratic, stack_of


def shifted_schedule(steps: int, shift: float = 5.0) -> list[float]:
    """A flow model's shifted schedule (as Wan's): sigma stays near 1 for most steps and falls fast at the end."""
    t = [1 - i / steps for i in range(steps + 1)]
    return [shift * x / (1 + (shift - 1) * x) for x in t]


def budget_config(steps: int) -> StackCacheConfig:
    """A cache config with a forward budget of ``steps`` (what ``ForwardBudget`` reads)."""
    return StackCacheConfig(threshold=0.0, forward_budget=steps)


def direct_cost(changes, sizes, a, b) -> float:
    return sum(sizes[j] * sum(changes[a + 1:j + 1]) for j in range(a + 1, b)) ** 2


def test_gap_costs_are_the_summed_lag_of_reuse_weighed_by_the_step_sizes():
    changes, sizes = [0.0, 0.1, 0.3, 0.2, 0.5, 0.4], [0.1, 0.2, 0.1, 0.3, 0.2, 0.1]
    cost = gap_costs(changes, sizes)
    for a, b in itertools.combinations(range(6), 2):
        assert cost[a, b] == pytest.approx(direct_cost(changes, sizes, a, b), abs=1e-12)
    assert cost[2, 3] == 0.0 and cost[3, 2] == float("inf")  # adjacent: nothing skipped; backwards: no gap


def test_the_plan_is_the_cheapest_placement_with_the_first_and_last_steps():
    schedule = shifted_schedule(10)
    sizes = [schedule[i] - schedule[i + 1] for i in range(10)]
    changes = steps_in_sigma(schedule)
    for count in range(2, 11):
        plan = plan_steps(count, changes, sizes)
        assert len(plan) == count and plan[0] == 0 and plan[-1] == 9

        def total(chosen):
            return sum(direct_cost(changes, sizes, a, b) for a, b in zip(chosen, chosen[1:]))

        best = min((c for c in itertools.combinations(range(10), count) if c[0] == 0 and c[-1] == 9), key=total)
        assert total(plan) == pytest.approx(total(best), rel=1e-9)
    assert plan_steps(1, changes, sizes) == [0, 9] and plan_steps(50, changes, sizes) == list(range(10))
    assert 5 in plan_steps(3, changes, sizes, protected={5})
    assert plan_steps(3, changes, sizes, first=4) == [4, plan_steps(3, changes, sizes, first=4)[1], 9]


def test_a_run_longer_than_the_exact_plan_allows_gets_its_steps_spread_without_the_cost_table(monkeypatch):
    """A budget on thousands of steps is planned at once, never with the steps x steps cost table."""
    def no_table(*args):
        raise AssertionError("the cost table of a run over MAX_PLANNED_STEPS steps")

    monkeypatch.setattr(budget_module, "gap_costs", no_table)
    total = 4 * budget_module.MAX_PLANNED_STEPS
    schedule = shifted_schedule(total)
    changes, sizes = steps_in_sigma(schedule), [abs(a - b) for a, b in zip(schedule, schedule[1:])]
    for count, protected in ((10, set()), (7, {3, 4, 5}), (total - 1, set())):
        plan = plan_steps(count, changes, sizes, protected=protected)
        assert len(plan) == count and plan == sorted(set(plan))
        assert plan[0] == 0 and plan[-1] == total - 1 and protected <= set(plan)
    gaps = [b - a for a, b in zip(plan_steps(10, changes, sizes), plan_steps(10, changes, sizes)[1:])]
    assert max(gaps) - min(gaps) <= 1
    budget = ForwardBudget(budget_config(12))
    budget.start(total, schedule)
    assert len(budget.plan) == 12 and budget.decide(0) == (True, BUDGET_REASON)


def test_on_a_shifted_schedule_the_plan_computes_most_of_the_final_steps():
    schedule = shifted_schedule(30)
    budget = ForwardBudget(budget_config(10))
    budget.start(30, schedule)
    assert len(budget.plan) == 10 and budget.plan[0] == 0
    assert budget.plan[-4:] == [26, 27, 28, 29]  # the schedule's large sigma steps come last
    assert sum(1 for p in budget.plan if p < 15) <= 3


def test_a_profile_measured_on_a_schedule_gives_its_changes_back_and_fits_another_step_count():
    schedule = shifted_schedule(30)
    rate = lambda s: 1.0 + 4.0 * (1 - s)  # noqa: E731  a residual that changes faster as sigma falls
    changes = [0.0] + [rate((schedule[i - 1] + schedule[i]) / 2) * (schedule[i - 1] - schedule[i])
                       for i in range(1, 30)]
    profile = StepProfile(tuple(schedule[:30]), tuple(changes))
    assert profile.changes_for(schedule) == pytest.approx(changes, rel=1e-9)
    other = shifted_schedule(20)
    expected = [0.0] + [rate((other[i - 1] + other[i]) / 2) * (other[i - 1] - other[i]) for i in range(1, 20)]
    assert profile.changes_for(other) == pytest.approx(expected, rel=0.02)
    assert StepProfile.from_data(profile.to_data()).changes == pytest.approx(profile.changes, abs=1e-6)
    for bad in ({"sigmas": [1.0]}, {"sigmas": [1.0, 0.5], "changes": [0.0, -1.0]}, [1, 2],
                {"sigmas": [1.0, 0.5], "changes": [0.0, "x"]}):
        with pytest.raises(ValueError):
            StepProfile.from_data(bad)


def test_the_threshold_brings_the_next_planned_compute_forward_by_at_most_half_its_gap():
    budget = ForwardBudget(budget_config(4))
    budget.start(12, [1 - i / 12 for i in range(13)])  # equal steps, no profile: an even plan
    assert budget.plan == [0, 4, 7, 11]  # equal gaps, or as near as whole steps allow
    plan = list(budget.plan)
    gap_end = plan[1]
    assert budget.decide(0) == (True, BUDGET_REASON)
    budget.settle(0, True)
    early = 1
    assert budget.decide(early, wants=True) == (False, None) and budget.held_back == 1  # too early in the gap
    budget.settle(early, False)
    middle = (gap_end + 1) // 2
    assert budget.decide(middle, wants=True) == (True, None)
    budget.settle(middle, True)
    assert middle in budget.plan and gap_end not in budget.plan and budget.brought_forward == 1
    assert budget.plan[2:] == plan[2:] and len(budget.plan) == 4  # the later steps stay, the count too
    assert budget.decide(middle) == (True, None)  # the same step asked again: the same answer
    for step in range(middle + 1, 12):
        computed, _ = budget.decide(step, wants=True)
        budget.settle(step, computed)
    assert len(budget.computed) == 4 and budget.computed[-1] == 11  # the last step is never pulled
    assert "forward budget 4: computed 4 of 12 steps" in budget.describe()


def test_a_compute_the_plan_did_not_foresee_replans_the_rest_with_what_is_left():
    budget = ForwardBudget(budget_config(5))
    budget.start(20, shifted_schedule(20))
    first = budget.plan[1]
    budget.settle(0, True)
    assert budget.decide(1, must=True) == (True, None)
    budget.settle(1, True)
    assert len(budget.plan) == 5 and budget.plan[:2] == [0, 1] and budget.plan[-1] == 19
    assert first not in budget.plan or budget.plan.count(first) == 1
    assert compact([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"


def tea_run(model, budget: int, threshold: float = 10.0, **kw):
    signal = StackSignal(compute=lambda block, args, kwargs, captured: kwargs["sigma"][:, None])
    config = TeaCacheConfig(threshold, (0.0, 0.0, 0.0, 1.0, 0.0), forward_budget=budget, few_step=FewStepRule(), **kw)
    return apply_teacache_hook(stack_of(model), config, signal)


def sample(model, run, schedule, branches=("c", "u")):
    x = torch.zeros(len(branches), 4, 3, dtype=torch.float64)
    steps = len(schedule) - 1
    for step, s in enumerate(schedule[:-1]):
        run.begin_call(CallContext(branches=list(branches), labels=list(branches), step=step, total_steps=steps,
                                   sigma=s, schedule=tuple(schedule)))
        try:
            model(x, torch.full((x.shape[0],), s, dtype=torch.float64))
        finally:
            run.end_call()


@pytest.mark.parametrize("steps, budgets", [(30, [2, 5, 8, 10, 12, 20, 30, 40]), (8, [2, 3, 4, 5, 6, 7, 8])])
@pytest.mark.parametrize("forecast", [0, "auto"])
def test_teacache_computes_its_budget_whatever_its_threshold_and_the_few_step_rule(steps, budgets, forecast):
    schedule = shifted_schedule(steps)
    for budget in budgets:
        for threshold in (0.0, 0.05, 10.0):
            model = Model(quadratic)
            run = tea_run(model, budget, threshold, forecast_order=forecast)
            sample(model, run, schedule)
            computed = [e.step for e in run.stats.evaluations if e.computed]
            assert len(computed) == min(budget, steps), (budget, threshold, computed)
            assert computed[0] == 0 and computed[-1] == steps - 1
            assert model.blocks[0].calls == len(computed)
            summary = run.stats.summary()
            assert summary["budget"]["steps"] == budget and summary["budget"]["computed"] == computed
            assert any(n.startswith(f"forward budget {budget}: computed {len(computed)}") for n in summary["notes"])


def test_magcache_retention_and_k_give_way_to_the_budget_and_the_window_counts():
    schedule = shifted_schedule(30)
    model = Model(quadratic)
    config = MagCacheConfig(threshold=10.0, max_skip_steps=1, retention_ratio=0.5, mag_ratios=[1.0] * 30,
                            forward_budget=8, end_percent=0.9)
    run = apply_mag_cache_hook(stack_of(model), config)
    sample(model, run, schedule)
    computed = [e.step for e in run.stats.evaluations if e.computed]
    outside = [s for s in range(30) if s / 29 > 0.9]  # steps 27-29 lie outside the window: always computed
    assert len(computed) == 8 and set(outside) <= set(computed)
    assert sum(1 for s in computed if s < 15) < 15 * 0.5  # retention (the first half) did not hold
    reasons = {b.reason for e in run.stats.evaluations if e.computed for b in e.branches}
    assert BUDGET_REASON in reasons and "window" in reasons


def test_no_budget_changes_nothing_and_a_bad_budget_is_refused():
    schedule = shifted_schedule(12)
    patterns = []
    for budget in (0, None):
        model = Model(quadratic)
        run = tea_run(model, budget or 0, threshold=0.3)
        sample(model, run, schedule)
        patterns.append([e.computed for e in run.stats.evaluations])
        assert run.rule(BUDGET_REASON) is None and run.stats.summary()["budget"] is None
    assert patterns[0] == patterns[1] and not all(patterns[0])
    for bad in (-1, 2.5, True, "4"):
        with pytest.raises((ValueError, TypeError)):
            StackCacheConfig(0.1, forward_budget=bad)
    assert StackCacheConfig(0.1, forward_budget=4.0).forward_budget == 4
    assert StackCacheConfig(0.1, forward_budget=4, calibrate=True).active_budget == 0


def measured_cost(plan, sketches, sigmas, weights, strength: float = 0.0, after=None) -> float:
    """The measured plan's cost of ``plan``, summed skip by skip: per gap, the squared norm of the weighed errors of
    reusing the first step (first gap) or extrapolating linearly in sigma from the two computed steps before it; with
    a ``strength``, less what the skip correction adds at the gap's end ``b``: ``strength * after[b] / sigma_b`` times
    the weighed differences between the interpolation from ``a`` to ``b`` and what the skips used (``after``: the
    sigma each step goes to; nothing at the final step, to sigma 0)."""
    total = 0.0
    for k in range(1, len(plan)):
        a, b = plan[k - 1], plan[k]
        error = torch.zeros(sketches.shape[1], dtype=torch.float64)
        moved = torch.zeros_like(error)
        for j in range(a + 1, b):
            if k == 1:
                forecast = sketches[a]
            else:
                p = plan[k - 2]
                forecast = sketches[a] + (sigmas[j] - sigmas[a]) / (sigmas[a] - sigmas[p]) * (sketches[a] - sketches[p])
            error += weights[j] * (sketches[j] - forecast)
            interpolated = sketches[a] + (sigmas[j] - sigmas[a]) / (sigmas[b] - sigmas[a]) * (sketches[b] - sketches[a])
            moved += weights[j] * (interpolated - forecast)
        if strength and 0 < after[b] < sigmas[b]:
            error -= strength * after[b] / sigmas[b] * moved
        total += float(error.square().sum())
    return total


def random_trajectory(steps: int, values: int = 6, seed: int = 0):
    """A schedule, a smooth random residual trajectory sketched on it (with a bend) and random positive weights."""
    generator = torch.Generator().manual_seed(seed)
    schedule = shifted_schedule(steps)
    sigmas = torch.tensor(schedule[:-1], dtype=torch.float64)
    base = torch.randn(4, values, generator=generator, dtype=torch.float64)
    sketches = base[0] + sigmas[:, None] * base[1] + sigmas[:, None] ** 2 * base[2] \
        + torch.relu(0.4 - sigmas)[:, None] ** 3 * 40 * base[3]
    weights = (torch.rand(steps, generator=generator, dtype=torch.float64) + 0.1).tolist()
    profile = StepProfile(tuple(schedule[:-1]), (0.0,) + (0.1,) * (steps - 1), tuple(map(tuple, sketches.tolist())))
    return schedule, sigmas, sketches, weights, profile


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_measured_plan_is_the_cheapest_placement_by_the_calibrations_forecast_errors(seed):
    steps = 10
    schedule, sigmas, sketches, weights, profile = random_trajectory(steps, seed=seed)
    for count in range(2, steps + 1):
        for protected in (frozenset(), frozenset({4})):
            plan = measured_plan(count, profile, schedule, weights, protected)
            count_here = max(count, 2 + len(protected))
            assert len(plan) == count_here and plan[0] == 0 and plan[-1] == steps - 1 and protected <= set(plan)
            candidates = [c for c in itertools.combinations(range(steps), count_here)
                          if c[0] == 0 and c[-1] == steps - 1 and protected <= set(c)]
            best = min(measured_cost(c, sketches, sigmas, weights) for c in candidates)
            assert measured_cost(plan, sketches, sigmas, weights) == pytest.approx(best, rel=1e-9, abs=1e-15)
    assert measured_plan(50, profile, schedule, weights) == list(range(steps))


@pytest.mark.parametrize("seed", [0, 1])
def test_the_measured_cost_models_the_skip_correction_gap_by_gap(seed):
    steps = 9
    schedule, sigmas, sketches, weights, profile = random_trajectory(steps, seed=seed)
    after = schedule[1:]
    plain, corrected = measured_costs(profile, schedule, weights), measured_costs(profile, schedule, weights, 0.5)
    differs = 0
    for plan in itertools.combinations(range(steps), 4):
        if plan[0] != 0 or plan[-1] != steps - 1:
            continue
        plan = list(plan)
        assert plan_cost(plan, plain) == pytest.approx(measured_cost(plan, sketches, sigmas, weights), rel=1e-9)
        expected = measured_cost(plan, sketches, sigmas, weights, 0.5, after)
        assert plan_cost(plan, corrected) == pytest.approx(expected, rel=1e-9, abs=1e-15)
        differs += abs(plan_cost(plan, corrected) - plan_cost(plan, plain)) > 1e-9
    assert differs  # the correction changes what a gap costs
    assert measured_costs(StepProfile(profile.sigmas, profile.changes), schedule, weights) is None  # no sketches


def test_the_tail_plan_is_the_profiles_plan_with_the_tail_the_measured_cost_favours():
    steps, chose_a_tail, chose_the_profile = 12, 0, 0
    for seed in range(4):
        schedule, sigmas, sketches, weights, profile = random_trajectory(steps, seed=seed)
        changes, sizes = profile.changes_for(schedule), steps_in_sigma(schedule)[1:] + [schedule[-2] - schedule[-1]]
        for count in range(3, 9):
            for protected in (frozenset(), frozenset({5})):
                family = []
                for k in range(1, count):
                    head = plan_steps(count - k + 1, changes[:steps - k + 1], sizes[:steps - k + 1], 0,
                                      {p for p in protected if p <= steps - k})
                    plan = sorted(set(head) | set(range(steps - k, steps)))
                    if len(plan) == count:
                        family.append((measured_cost(plan, sketches, sigmas, weights, 0.5, schedule[1:]), k, plan))
                cost, k, expected = min(family)
                got = tail_plan(count, profile, schedule, weights, protected, correction=0.5)
                assert got == expected, (seed, count, protected)
                assert len(got) == count and got[0] == 0 and got[-1] == steps - 1 and protected <= set(got)
                chose_a_tail += k > 1
                chose_the_profile += got == plan_steps(count, changes, sizes, 0, protected)
    assert chose_a_tail and chose_the_profile  # both outcomes occur: the test can tell them apart
    assert tail_plan(50, profile, schedule, weights) == list(range(steps))
    assert tail_plan(5, StepProfile(profile.sigmas, profile.changes), schedule, weights) is None  # no sketches


def test_a_sampler_without_euler_steps_gets_the_measured_plan_unless_the_tail_plan_rates_better_corrected():
    steps, outcomes = 12, set()
    for seed in range(6):
        schedule, sigmas, sketches, weights, profile = random_trajectory(steps, seed=seed)
        for count in range(3, 9):
            plan, how = measured_or_tail(count, profile, schedule, weights, correction=0.5)
            dp, tail = measured_plan(count, profile, schedule, weights), tail_plan(count, profile, schedule, weights,
                                                                                 correction=0.5)
            corrected = [measured_cost(p, sketches, sigmas, weights, 0.5, schedule[1:]) for p in (dp, tail)]
            expected = (tail, "tail") if corrected[1] < corrected[0] * (1 - 1e-9) else (dp, "measured")
            assert (plan, how) == expected, (seed, count)
            outcomes.add(how)
            # without a correction to model, the plan the DP rates best over all plans stays
            assert measured_or_tail(count, profile, schedule, weights) == (dp, "measured")
    assert outcomes == {"measured", "tail"}  # both occur: the test can tell them apart
    plain = StepProfile(profile.sigmas, profile.changes)
    assert measured_or_tail(5, plain, schedule, weights, correction=0.5) == (None, "measured")


def test_the_measured_plan_computes_where_the_trajectory_bends_and_needs_sketches():
    schedule = shifted_schedule(20)
    sigmas = torch.tensor(schedule[:-1], dtype=torch.float64)
    bend = 0.5 * (sigmas[11] + sigmas[12])
    line = torch.stack([1 + 0 * sigmas, 2 * sigmas, -sigmas], dim=1)  # 1st order forecasts it exactly ...
    sketches = line + torch.relu(bend - sigmas)[:, None] * torch.tensor([0.0, 5.0, 3.0])  # ... but for a kink
    profile = StepProfile(tuple(schedule[:-1]), (0.0,) + (0.1,) * 19, tuple(map(tuple, sketches.tolist())))
    plan = measured_plan(5, profile, schedule, None)
    assert 11 in plan or 12 in plan, plan  # a compute right at the kink, where extrapolating fails
    assert measured_plan(5, StepProfile(profile.sigmas, profile.changes), schedule, None) is None  # no sketches
    # another schedule of the same model: the sketches are read at its sigmas (linear between calibrated steps)
    longer = shifted_schedule(40)
    at = profile.sketches_for(longer)
    assert at.shape == (40, 3) and torch.allclose(torch.tensor(at[::2]), sketches, atol=1e-12)


def test_a_speedup_budget_places_by_the_measured_plan_where_asked_else_by_the_profile():
    schedule, _, _, weights, profile = random_trajectory(30, seed=3)
    config = StackCacheConfig(threshold=0.0, speedup=3.0, step_profile=profile)
    budget = ForwardBudget(config)
    budget.start(30, schedule, weights=weights, by="measured")
    assert budget.placement == "measured" and budget.plan == measured_plan(10, profile, schedule, weights)
    assert "placed by the calibration's measured trajectory" in budget.describe()
    plan, how = budget_module.measured_or_tail(10, profile, schedule, weights, correction=0.5)
    budget.start(30, schedule, weights=weights, by="measured", correction=0.5)  # the tail plan may rate better
    assert (budget.plan, budget.placement) == (plan, how)
    budget.start(30, schedule, weights=weights, by="tail", correction=0.5)  # a sampler that takes Euler steps
    assert budget.placement == "tail" and budget.plan == tail_plan(10, profile, schedule, weights, correction=0.5)
    assert budget.describe().endswith("placed by the calibration's step profile, with as many of the last steps as "
                                      "its measured trajectory favours")
    budget.start(30, schedule, weights=weights)  # not asked (no speed-up)
    assert budget.placement == "calibrated"
    assert budget.plan == plan_steps(10, profile.changes_for(schedule), steps_in_sigma(schedule)[1:] + [
        schedule[-2] - schedule[-1]])
    plain = StepProfile(profile.sigmas, profile.changes)
    budget = ForwardBudget(StackCacheConfig(threshold=0.0, speedup=3.0, step_profile=plain))
    budget.start(30, schedule, weights=weights, by="measured")  # a calibration made before sketches were kept
    assert budget.placement == "calibrated" and budget.summary()["placement"] == "calibrated"
    budget.start(30, schedule, weights=weights, by="tail", correction=0.5)
    assert budget.placement == "calibrated"
    budget = ForwardBudget(StackCacheConfig(threshold=0.0, speedup=3.0))
    budget.start(30, schedule, weights=weights, by="measured")
    assert budget.placement == "schedule" and "placed by the schedule" in budget.describe()


def test_sketches_round_trip_and_bad_ones_are_refused():
    _, _, _, _, profile = random_trajectory(8)
    data = profile.to_data()
    again = StepProfile.from_data(data)
    assert again.sigmas == pytest.approx(profile.sigmas, abs=1e-6) and len(again.sketches) == 8
    assert torch.allclose(torch.tensor(again.sketches), torch.tensor(profile.sketches), rtol=1e-4)  # 5 digits
    old = {"sigmas": data["sigmas"], "changes": data["changes"]}  # a calibration made before sketches
    assert StepProfile.from_data(old).sketches is None
    for bad in ({**data, "sketches": data["sketches"][:-1]}, {**data, "sketches": "x"},
                {**data, "sketches": [k[:-1] if i == 3 else k for i, k in enumerate(data["sketches"])]},
                {**data, "sketches": [[True] * 6] * 8}, {**data, "sketches": [[]] * 8}):
        with pytest.raises(ValueError):
            StepProfile.from_data(bad)
    with pytest.raises(ValueError, match="at most"):
        StepProfile(profile.sigmas, profile.changes, ((0.0,) * (SKETCH_VALUES // 8 + 1),) * 8)
    with pytest.raises(ValueError, match="finite"):
        StepProfile(profile.sigmas, profile.changes, ((float("nan"),) * 6,) * 8)


def test_a_sketch_is_linear_keeps_norms_and_counts_every_value(monkeypatch):
    generator = torch.Generator().manual_seed(5)
    a, b = (torch.randn(1, 300, 256, generator=generator) for _ in range(2))  # 75 rows of 1024
    assert sketch(a).shape == (1024,)
    assert torch.allclose(sketch(a) - sketch(b), sketch(a - b), atol=1e-4)
    ratios = [float(sketch(d).norm() / d.norm()) for d in (a, b, a - b, 3 * a + b)]
    assert all(0.8 < r < 1.2 for r in ratios), ratios  # a random projection: the norm in expectation
    changed = a.clone()
    changed[0, 299, 255] += 10.0  # the very last value (the padded row) counts too
    assert float((sketch(changed) - sketch(a)).norm()) == pytest.approx(10.0, rel=1e-4)
    whole = sketch(a)
    monkeypatch.setattr("omni_hooks.caching.residuals.SKETCH_ROWS_AT_ONCE", 7)  # in blocks: the same numbers
    assert SKETCH_ROWS_AT_ONCE > 75 and torch.allclose(sketch(a), whole, atol=1e-4)
    assert torch.equal(sketch(torch.ones(2, 3)), torch.ones(6))  # a small residual: all of it


def test_a_calibrating_run_records_the_residual_change_of_every_step():
    schedule = shifted_schedule(10)
    model = Model(quadratic)
    run = tea_run(model, 0, threshold=0.0, calibrate=True)
    sample(model, run, schedule)
    profile = run.step_profile()
    assert profile.sigmas == pytest.approx(schedule[:10]) and profile.changes[0] == 0.0
    # the residual is quadratic(s, row) per branch: its relative change from step to step, mean over the branches
    for i in range(1, 10):
        expected = sum(float((quadratic(schedule[i], r) - quadratic(schedule[i - 1], r)).norm()
                             / quadratic(schedule[i - 1], r).norm()) for r in (0, 1)) / 2
        assert profile.changes[i] == pytest.approx(expected, rel=1e-5)
    # and each step's residuals, sketched: both branches of a residual this small whole, one after the other
    for i in (0, 5, 9):
        expected = torch.cat([quadratic(schedule[i], r).reshape(-1) for r in (0, 1)])
        assert torch.allclose(torch.tensor(profile.sketches[i], dtype=torch.float64), expected.double(), atol=1e-6)
    assert tea_run(Model(quadratic), 0).step_profile() is None  # nothing measured: no profile
    assert BASE.shape == (4, 3)


def test_computes_brought_forward_one_after_the_other_never_drift_past_half_their_planned_gap():
    budget = ForwardBudget(budget_config(6))
    budget.start(30, [1 - i / 30 for i in range(31)])  # an even plan
    planned = list(budget.plan)
    for step in range(30):  # the threshold asks for every step
        computed, _ = budget.decide(step, wants=True)
        budget.settle(step, computed)
    assert len(budget.computed) == 6 and budget.brought_forward == 4  # all but the first and the last
    for got, (before, want) in zip(budget.computed[1:-1], zip(planned, planned[1:])):
        assert 2 * got >= before + want and got <= want  # each within the second half of its planned gap


@pytest.mark.parametrize("steps, speedup, computed", [(30, 2.0, 15), (30, 3.0, 10), (30, 3.75, 8), (30, 6.0, 5),
                                                      (30, 20.0, 2), (20, 2.5, 8), (10, 2.0, 5), (8, 2.0, 5),
                                                      (8, 4.0, 5), (6, 3.0, 4), (30, 1.0, 30), (25, 2.0, 13)])
def test_a_speedup_computes_its_share_of_each_run_and_a_few_step_run_what_the_few_step_rule_keeps(steps, speedup,
                                                                                                   computed):
    """``speedup`` is a budget per run (total / speedup, rounded); a run of 8 steps or fewer computes at least the
    steps the few-step rule keeps (8 steps: 5; 6 steps: 4), as a run without a budget would."""
    config = StackCacheConfig(threshold=0.0, speedup=speedup, few_step=FewStepRule())
    assert config.active_budget and config.budget_steps(steps) == computed
    model = Model(quadratic)
    run = apply_teacache_hook(stack_of(model), TeaCacheConfig(0.0, (0.0, 0.0, 0.0, 1.0, 0.0), speedup=speedup,
                                                              few_step=FewStepRule()),
                              StackSignal(compute=lambda block, args, kwargs, captured: kwargs["sigma"][:, None]))
    sample(model, run, shifted_schedule(steps))
    assert sum(e.computed for e in run.stats.evaluations) == computed
    assert run.stats.summary()["budget"]["steps"] == computed


def test_a_speedup_is_checked_and_excludes_a_forward_budget():
    for bad in (0.5, -1, 21, float("nan"), float("inf"), True, "2"):
        with pytest.raises(ValueError, match="speedup must be 0"):
            StackCacheConfig(0.0, speedup=bad)
    with pytest.raises(ValueError, match="speedup .* and forward_budget .* set one of them to 0"):
        StackCacheConfig(0.0, speedup=2.0, forward_budget=8)
    assert not StackCacheConfig(0.0, speedup=2.0, calibrate=True).active_budget
    assert not StackCacheConfig(0.0).active_budget and StackCacheConfig(0.0).budget_steps(30) == 0
