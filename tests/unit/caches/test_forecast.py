"""Forecasting skipped residuals (caching.forecast) in TeaCache and MagCache on a model whose block stack adds a
known function of sigma: exactness on polynomials, per-branch histories, the non-finite fallback, memory."""
from __future__ import annotations

import math

import pytest
import torch

from omni_hooks.caching.forecast import (ACCUMULATED_GAPS, ALTERNATING_COHERENCE, AUTO, AUTO_KEPT, CANDIDATE,
                                         CANDIDATES, CHEBYSHEV, CHEBYSHEV_WINDOW, COHERENCE_RANGE, FORECAST,
                                         FORECAST_FALLBACK, TAYLOR, WEIGHT_RANGE, ErrorPerMetric, CandidateScores,
                                         ResidualHistory, accumulation, chebyshev_weights, history_limit,
                                         lagrange_weights, taylor_weights)
from omni_hooks.magcache import MagCacheConfig, apply_mag_cache_hook
from omni_hooks.blockstack import StackSignal
from omni_hooks.teacache import CallContext, TeaCacheConfig, apply_teacache_hook
from omnitest.sigma_stack import Model, stack_of

ALWAYS_REUSE = (0.0, 0.0, 0.0, 0.0, 0.0)
SIGMAS = [1.0, 0.93, 0.81, 0.64, 0.45, 0.3, 0.17, 0.05]  # non-uniform, like a shifted flow schedule


BASE = torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(4, 3)


def quadratic(s: float, row: int) -> torch.Tensor:
    """Degree 2 in sigma, another polynomial per batch row (branch)."""
    return (1 + row) * BASE + (2 - row) * s * BASE.flip(0) + (3 + row) * s * s * BASE.flip(1)


def teacache(model: Model, order: int, ret_steps: int = 3, threshold: float = 0.5, **kw):
    signal = StackSignal(compute=lambda block, args, kwargs, captured: kwargs["sigma"][:, None])
    config = TeaCacheConfig(threshold, ALWAYS_REUSE, ret_steps=ret_steps, forecast_order=order, **kw)
    return apply_teacache_hook(stack_of(model), config, signal)


def sample(model: Model, run, x: torch.Tensor, sigmas=SIGMAS, with_sigma=True, branches=("c",)):
    outputs = []
    for step, s in enumerate(sigmas):
        run.begin_call(CallContext(branches=list(branches), labels=list(branches), step=step,
                                   total_steps=len(sigmas), sigma=s if with_sigma else None))
        try:
            outputs.append(model(x, torch.full((x.shape[0],), s, dtype=torch.float64)))
        finally:
            run.end_call()
    return outputs


def reasons(run, branch=0):
    return [e.branches[branch].reason for e in run.stats.evaluations]


def errors(residual, order, **kw):
    x = torch.zeros(2, 4, 3, dtype=torch.float64)
    reference = sample(Model(residual), NoCache(), x)
    model = Model(residual)
    got = sample(model, teacache(model, order, **kw), x)
    return [float((a - b).abs().max()) for a, b in zip(got, reference)]


class NoCache:
    """No cache: begin_call/end_call do nothing."""

    def begin_call(self, context):
        pass

    def end_call(self):
        pass


def test_lagrange_weights_reproduce_polynomials_on_a_non_uniform_grid():
    nodes = [1.0, 0.81, 0.45]
    w = lagrange_weights(nodes, 0.3)
    for p in (lambda s: 2.0, lambda s: 1 - 3 * s, lambda s: 0.5 + s - 4 * s * s):
        assert sum(wj * p(xj) for wj, xj in zip(w, nodes)) == pytest.approx(p(0.3), abs=1e-12)
    assert lagrange_weights([0.5], 0.1) == [1.0]


@pytest.mark.parametrize("order", [1, 2])
def test_forecast_of_order_k_is_exact_on_a_residual_polynomial_in_sigma_of_degree_k(order):
    # steps 0..2 computed (ret_steps), 3..6 forecast, 7 forced; each batch row is a branch of its own polynomial
    def residual(s, row):
        return quadratic(s, row) if order == 2 else (1 + row) * BASE - (2 + row) * s * BASE.flip(0)

    x = torch.randn(2, 4, 3, dtype=torch.float64)
    reference = sample(Model(residual), NoCache(), x, branches=("c", "u"))
    model = Model(residual)
    run = teacache(model, order)
    got = sample(model, run, x, branches=("c", "u"))
    assert [e.computed for e in run.stats.evaluations] == [True] * 3 + [False] * 4 + [True]
    for b in (0, 1):
        assert reasons(run, b)[3:7] == [FORECAST] * 4
    assert model.blocks[0].calls == 4
    for a, b in zip(got, reference):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_higher_orders_beat_reuse_on_a_quadratic_and_order_zero_is_todays_reuse():
    # at the first skipped step (one step past the last computed one)
    e0, e1, e2 = (errors(quadratic, order)[3] for order in (0, 1, 2))
    assert e2 < 1e-10 < e1 < e0
    model = Model(quadratic)
    run = teacache(model, 0)
    sample(model, run, torch.zeros(1, 4, 3, dtype=torch.float64))
    assert set(reasons(run)[3:7]) == {"reuse"}


def test_with_one_computed_residual_the_forecast_is_plain_reuse():
    model = Model(quadratic)
    run = teacache(model, 2, ret_steps=1)
    sample(model, run, torch.zeros(1, 4, 3, dtype=torch.float64))
    assert reasons(run)[1:-1] == ["reuse"] * (len(SIGMAS) - 2)


def test_without_a_sigma_the_step_index_is_the_coordinate():
    # residual linear in the step index: SIGMAS[step] -> step via the inverse map, order 1 exact in the step
    def residual(s, row):
        return (1 + SIGMAS.index(s)) * BASE

    x = torch.zeros(1, 4, 3, dtype=torch.float64)
    reference = sample(Model(residual), NoCache(), x, with_sigma=False)
    model = Model(residual)
    run = teacache(model, 1, ret_steps=2)
    got = sample(model, run, x, with_sigma=False)
    assert reasons(run)[2] == FORECAST
    for a, b in zip(got, reference):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_threshold_zero_with_forecast_is_bit_identical_to_no_cache():
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    reference = sample(Model(quadratic), NoCache(), x)
    model = Model(quadratic)
    run = teacache(model, 2, threshold=0.0)
    got = sample(model, run, x)
    assert all(torch.equal(a, b) for a, b in zip(got, reference))
    assert run.stats.reused == 0


def test_a_non_finite_forecast_falls_back_to_the_last_residual_and_says_so():
    big = 1.5e38  # float32: 3 * big overflows, so extrapolating alternating residuals gives inf

    def residual(s, row):
        return torch.full((4, 3), big if SIGMAS.index(s) % 2 == 0 else -big, dtype=torch.float32)

    x = torch.zeros(1, 4, 3, dtype=torch.float32)
    model = Model(residual)
    model.blocks[1].residual = lambda s, i: torch.zeros(4, 3, dtype=torch.float32)
    run = teacache(model, 2)
    got = sample(model, run, x)
    assert reasons(run)[3] == FORECAST_FALLBACK
    assert torch.equal(got[3], torch.full((1, 4, 3), big))  # the residual of step 2, reused
    assert any("not finite" in w for w in run.stats.warnings)
    assert all(torch.isfinite(o).all() for o in got)


def residual_bytes(order: int, steps: int) -> int:
    model = Model(quadratic)
    config = MagCacheConfig(threshold=0.0, mag_ratios=[1.0] * steps, forecast_order=order)
    run = apply_mag_cache_hook(stack_of(model), config)
    sample(model, run, torch.zeros(2, 4, 3, dtype=torch.float64), sigmas=SIGMAS[:steps], branches=("c", "u"))
    return run.cache_bytes(), run.stats.cache_bytes


@pytest.mark.parametrize("order", [0, 1, 2])
def test_cache_bytes_count_the_kept_residuals_and_stay_bounded(order):
    one = 4 * 3 * 8  # one branch's residual, float64
    for steps in (order + 1, len(SIGMAS)):
        now, peak = residual_bytes(order, steps)
        assert now == peak == 2 * (order + 1) * one  # two branches, order + 1 residuals each, however many steps


def test_history_restarts_on_a_new_shape_and_replaces_a_repeated_coordinate():
    h = ResidualHistory(limit=3)
    h.add(1.0, torch.zeros(2))
    h.add(0.5, torch.ones(2))
    h.add(0.5, torch.full((2,), 2.0))
    assert h.coords == [1.0, 0.5] and torch.equal(h.last, torch.full((2,), 2.0))
    h.add(0.25, torch.zeros(3))
    assert h.coords == [0.25]
    assert h.forecast(0.1).candidate == 0 and h.forecast(None).residual is h.last


def test_magcache_forecasts_too():
    x = torch.randn(1, 4, 3, dtype=torch.float64)
    reference = sample(Model(quadratic), NoCache(), x)
    model = Model(quadratic)
    config = MagCacheConfig(threshold=1.0, max_skip_steps=2, retention_ratio=0.4, mag_ratios=[1.0] * len(SIGMAS),
                            forecast_order=2)
    run = apply_mag_cache_hook(stack_of(model), config)
    got = sample(model, run, x)
    skipped = [i for i, e in enumerate(run.stats.evaluations) if not e.computed]
    assert skipped and all(reasons(run)[i] == FORECAST for i in skipped)
    assert max(float((a - b).abs().max()) for a, b in zip(got, reference)) < 1e-10
    assert not math.isnan(run.stats.summary()["hit_rate"])


# -- auto: the candidate chosen from the run's own computed residuals -------------------------------------------------

def linear(s: float, row: int) -> torch.Tensor:
    return (1 + row) * BASE - (2 + row) * s * BASE.flip(0)


def candidates(run, branch=0):
    return [e.branches[branch].candidate for e in run.stats.evaluations]


@pytest.mark.parametrize("residual, ret_steps, candidate", [(linear, 3, 1), (quadratic, 4, 2)])
def test_auto_picks_the_candidate_that_predicted_the_computed_steps_and_forecasts_exactly(residual, ret_steps,
                                                                                          candidate):
    # ret_steps computed (the later ones score the candidates on the earlier), the rest forecast, the last forced
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    reference = sample(Model(residual), NoCache(), x, branches=("c", "u"))
    model = Model(residual)
    run = teacache(model, AUTO, ret_steps=ret_steps)
    got = sample(model, run, x, branches=("c", "u"))
    skipped = list(range(ret_steps, len(SIGMAS) - 1))
    assert [e.computed for e in run.stats.evaluations] == [i not in skipped for i in range(len(SIGMAS))]
    for b in (0, 1):
        assert [candidates(run, b)[i] for i in skipped] == [candidate] * len(skipped)
        assert [reasons(run, b)[i] for i in skipped] == [FORECAST] * len(skipped)
        assert candidates(run, b)[0] is None  # computed steps use no candidate
    for a, b in zip(got, reference):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)


def noisy(s: float, row: int) -> torch.Tensor:
    """No trend in sigma: a fixed residual plus independent noise per step (seeded by the step)."""
    g = torch.Generator().manual_seed(SIGMAS.index(s))
    return BASE + 0.5 * torch.randn(4, 3, generator=g, dtype=torch.float64)


def test_auto_falls_back_to_reuse_where_extrapolating_would_have_been_worse():
    model = Model(noisy)
    run = teacache(model, AUTO, ret_steps=4)
    x = torch.zeros(1, 4, 3, dtype=torch.float64)
    got = sample(model, run, x)
    assert candidates(run)[4:7] == [0, 0, 0] and reasons(run)[4:7] == ["reuse"] * 3
    assert torch.equal(got[4], got[5])  # the last computed residual, unchanged: x is zero, so the output is it
    scores = run.branch_state("c").scores.errors
    assert scores[0] < scores[1] < scores[2]
    assert e_auto_not_worse_than_reuse(noisy)


def e_auto_not_worse_than_reuse(residual) -> bool:
    auto, reuse = errors(residual, AUTO, ret_steps=4), errors(residual, 0, ret_steps=4)
    return max(auto) <= max(reuse) + 1e-12


def test_the_scores_need_one_residual_more_than_each_candidate_and_cache_bytes_count_them():
    h = ResidualHistory(limit=history_limit(AUTO))
    count = len(CANDIDATES)
    residual = torch.ones(4, 3, dtype=torch.float64)
    assert h.prediction_errors(1.0, residual)[:count] == [None] * count  # nothing kept: nothing to score
    for s in SIGMAS[:3]:
        h.add(s, quadratic(s, 0))
    measured = h.prediction_errors(SIGMAS[3], quadratic(SIGMAS[3], 0))
    # three kept: every candidate but the Chebyshev fit (it spans four) predicts; 2nd order exactly
    assert [m is not None for m in measured[:count]] == [CANDIDATE[k].needs <= 3 for k in CANDIDATES]
    assert float(measured[2]) < 1e-9 * float(measured[1])
    # how a candidate's error aligns with its error one step before needs one residual more
    assert [m is not None for m in measured[count:2 * count]] == [CANDIDATE[k].needs + 1 <= 3 for k in CANDIDATES]
    for s in SIGMAS[3:5]:
        h.add(s, quadratic(s, 0))
    assert len(h.residuals) == AUTO_KEPT == CHEBYSHEV_WINDOW + 1
    assert all(m is not None for m in h.prediction_errors(SIGMAS[5], quadratic(SIGMAS[5], 0)))
    one = 4 * 3 * 8
    model = Model(quadratic)
    config = MagCacheConfig(threshold=0.0, mag_ratios=[1.0] * len(SIGMAS), forecast_order=AUTO)
    run = apply_mag_cache_hook(stack_of(model), config)
    sample(model, run, torch.zeros(2, 4, 3, dtype=torch.float64), branches=("c", "u"))
    assert run.cache_bytes() == run.stats.cache_bytes == 2 * AUTO_KEPT * one


def measurement(errors: list, norm: float | None, products: list | None = None, before: list | None = None) -> list:
    """``ResidualHistory.prediction_errors``' layout, as floats: errors, products with the errors one computed step
    before and those errors, per candidate (the ones not given: not measured); then the residual's norm."""
    def padded(values):
        values = list(values or [])
        return values + [None] * (len(CANDIDATES) - len(values))
    return [*padded(errors), *padded(products), *padded(before), norm]


def test_candidate_scores_choose_the_smallest_running_error():
    scores = CandidateScores()
    assert scores.best() == 0  # nothing measured: reuse
    scores.update(measurement([4.0, 1.0, None], 4.0))  # relative errors 1, 0.25; 2nd order not measurable yet
    assert scores.best() == 1 and scores.best(kept=1) == 0
    scores.update(measurement([4.0, 0.0, 0.0], 4.0))
    assert scores.errors[1] == pytest.approx(0.125) and scores.errors[2] == 0.0
    assert scores.best() == 2 and scores.best(kept=2) == 1
    scores.update(measurement([1.0, float("nan"), 9.0], None))  # no norm: not a measurement
    assert scores.errors[1] == pytest.approx(0.125)


def test_accumulation_is_the_power_of_a_sum_of_correlated_errors_over_independent_ones():
    assert accumulation(0.0) == 1.0
    rho = 0.5  # ACCUMULATED_GAPS errors e_i with <e_i, e_j> = rho ** |i - j|: |sum|^2 / (n |e|^2)
    n = ACCUMULATED_GAPS
    gram = sum(rho ** abs(i - j) for i in range(n) for j in range(n))
    assert accumulation(rho) == pytest.approx(gram / n)
    low, high = COHERENCE_RANGE
    assert accumulation(0.99) == accumulation(high) > 1.0
    assert accumulation(-1.0) == accumulation(low) == 1.0  # errors that alternate are not credited


def test_a_candidate_whose_errors_add_up_loses_to_one_of_the_same_size_whose_errors_alternate():
    scores = CandidateScores()  # reuse and 1st order err alike, predicting each computed step
    scores.update(measurement([1.0, 1.0, None], 1.0))
    assert scores.best() == 0  # a tie: reuse
    # reuse's consecutive errors point the same way (a drift it lags behind); 1st order's alternate
    scores.update(measurement([1.0, 1.0, None], 1.0, products=[0.9, -0.5, None], before=[1.0, 1.0, None]))
    assert scores.coherence[0] == pytest.approx(0.9) and scores.coherence[1] == pytest.approx(-0.5)
    assert scores.best() == 1
    assert scores.expected(1) == scores.errors[1] == scores.errors[0] < scores.expected(0)
    scores.clear()
    assert scores.coherence == [None] * len(CANDIDATES)


def test_a_cache_that_credits_alternating_errors_picks_a_candidate_reuse_beats_on_size_alone():
    assert accumulation(-0.5, low=ALTERNATING_COHERENCE) < 1.0 == accumulation(-0.5)
    floor = ALTERNATING_COHERENCE
    assert accumulation(-1.0, low=floor) == accumulation(floor, low=floor)  # bounded below
    scores = CandidateScores()  # 1st order errs 1.5x as much as reuse per step, but its errors alternate
    scores.update(measurement([1.0, 1.5, None], 1.0, products=[0.0, -0.5 * 1.5, None], before=[1.0, 1.5, None]))
    assert scores.coherence[1] == pytest.approx(-0.5)
    assert scores.best() == 0  # not credited: 1.5 > 1
    assert scores.best(low=ALTERNATING_COHERENCE) == 1  # credited: 1.5 * accumulation(-0.5) < 1
    assert scores.expected(1, low=ALTERNATING_COHERENCE) < scores.expected(0, low=ALTERNATING_COHERENCE)


def test_teacache_credits_alternating_errors_and_magcache_does_not():
    from omni_hooks.magcache.hook import MagCacheRun
    from omni_hooks.teacache.hook import TeaCacheRun

    assert TeaCacheRun.coherence_floor == ALTERNATING_COHERENCE < 0
    assert MagCacheRun.coherence_floor == COHERENCE_RANGE[0] == 0


def test_the_history_measures_how_consecutive_errors_of_a_candidate_align():
    def coherence_after(residual) -> list[float | None]:
        h, scores = ResidualHistory(limit=history_limit(AUTO)), CandidateScores()
        for s in SIGMAS[:5]:
            scores.update([None if m is None else float(m) for m in h.prediction_errors(s, residual(s, 0))])
            h.add(s, residual(s, 0))
        return scores.coherence

    drift = coherence_after(linear)  # reuse lags a straight drift the same way at every step: cosine 1
    assert drift[0] == pytest.approx(1.0)
    assert coherence_after(quadratic)[1] == pytest.approx(1.0)  # ... and 1st order lags a constant curvature
    assert coherence_after(noisy)[0] < 0  # no trend: each reuse error undoes part of the one before


def test_auto_with_threshold_zero_is_bit_identical_and_forecast_values_are_checked():
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    reference = sample(Model(quadratic), NoCache(), x)
    model = Model(quadratic)
    got = sample(model, teacache(model, AUTO, threshold=0.0), x)
    assert all(torch.equal(a, b) for a, b in zip(got, reference))
    for bad in ("Auto", 3, 1.5, "1"):
        with pytest.raises(ValueError, match="forecast order must be one of"):
            TeaCacheConfig(forecast_order=bad)



def test_candidate_scores_carry_their_errors_to_the_distance_of_the_skip():
    scores = CandidateScores()
    scores.update(measurement([1.0, 1.2, None], 1.0), horizon=0.2)  # 1st order erred 1.2x reuse over 0.2
    assert scores.horizon == 0.2
    assert scores.best() == 0 and scores.best(horizon=0.2) == 0
    assert scores.best(horizon=0.1) == 1  # half the distance: 1.2 * 0.5 ** 2 < 1
    scores = CandidateScores()
    scores.update(measurement([1.0, 0.3, 0.2], 1.0), horizon=0.2)
    assert scores.best() == 2 and scores.best(horizon=0.2) == 2
    assert scores.best(horizon=0.3) == 1  # 1.5x the distance: 0.3 * 1.5 ** 2 < 0.2 * 1.5 ** 4, both below 1
    assert scores.best(horizon=0.4) == 0  # twice: 0.3 * 4 and 0.2 * 16 both exceed reuse's 1
    scores.update(measurement([1.0, 0.3, 0.2], 1.0), horizon=0.4)
    assert scores.horizon == pytest.approx(0.3)  # a running distance, like the errors
    scores.clear()
    assert scores.errors == scores.coherence == [None] * len(CANDIDATES) and scores.horizon is None


def test_error_per_metric_weighs_the_recent_record_against_the_runs_mean():
    record = ErrorPerMetric()
    assert record.weight() == 1.0  # nothing measured
    for error in (0.1, 0.1, 0.1):
        record.update(error, 0.1)
    assert record.weight() == pytest.approx(1.0)
    record.update(0.4, 0.1)  # the forecast erred 4x as much per unit of metric: recent 2.5, mean 1.75
    assert record.weight() == pytest.approx(2.5 / 1.75)
    record.update(10.0, 0.1)
    assert record.weight() == WEIGHT_RANGE[1]
    record.update(1.0, None)  # no metric (a forced compute): not a measurement
    record.update(1.0, 0.0)
    assert record.count == 5
    low = ErrorPerMetric()
    for error in (1.0,) * 5 + (0.001,) * 2:
        low.update(error, 1.0)
    assert low.recent < 0.5 * low.total / low.count and low.weight() == WEIGHT_RANGE[0] == 1.0  # never later


KINK_SIGMAS = [1.0 - 0.04 * i for i in range(24)]


def kinked(s: float, row: int) -> torch.Tensor:
    """Linear in sigma (1st order forecasts it exactly) down to sigma 0.6, then bending along a sine (every forecast
    errs, less the closer its computed steps lie)."""
    bend = math.sin(15 * (0.6 - s)) if s < 0.6 else 0.0
    return (1 + s) * BASE + 0.5 * bend * BASE.flip(0)


@pytest.mark.parametrize("order", [AUTO, 1])
def test_teacache_auto_and_1st_order_compute_sooner_where_the_forecast_erred(order):
    """A constant change per step computes every 3rd step; once the forecast errs far more per unit of that change
    than it had, the weighed change crosses the threshold sooner. MagCache's error is never weighed."""
    x = torch.zeros(1, 4, 3, dtype=torch.float64)
    reference = sample(Model(kinked), NoCache(), x, sigmas=KINK_SIGMAS)
    runs = {}
    for weighs in (False, True):
        model = Model(kinked)
        signal = StackSignal(compute=lambda block, args, kwargs, captured: kwargs["sigma"][:, None])
        run = apply_teacache_hook(stack_of(model), TeaCacheConfig(0.25, (0, 0, 0, 0, 0.1), ret_steps=3,
                                                                  forecast_order=order), signal)
        run.weighs_metric_by_forecast = weighs
        got = sample(model, run, x, sigmas=KINK_SIGMAS)
        error = sum(float((a - b).abs().mean()) for a, b in zip(got, reference))
        runs[weighs] = ([e.computed for e in run.stats.evaluations], error, run)
    (plain, plain_error, _), (weighed, weighed_error, run) = runs[False], runs[True]
    kink = next(i for i, s in enumerate(KINK_SIGMAS) if s < 0.6)
    assert plain[:kink] == weighed[:kink]  # the forecast was exact: nothing to weigh
    assert sum(weighed[kink:]) > sum(plain[kink:]) and weighed_error < plain_error
    weighed_metrics = [e.branches[0].metric for e in run.stats.evaluations[kink:] if e.branches[0].metric]
    assert any(m > 0.25 and m / 2 < 0.25 for m in weighed_metrics)  # crossed only because of the weight
    assert run.branch_state("c").error_per_metric.count > 0
    note = next(n for n in run.stats.summary()["notes"] if n.startswith("forecast: "))
    assert f"{run.stats.sooner_by_forecast} branch step(s) computed sooner" in note and run.stats.sooner_by_forecast > 0
    assert runs[False][2].stats.sooner_by_forecast == 0 and not runs[False][2].stats.forecast_note()


def test_teacache_2nd_order_and_off_are_not_weighed():
    for order in (0, 2):
        model = Model(kinked)
        run = teacache(model, order, threshold=0.25)
        sample(model, run, torch.zeros(1, 4, 3, dtype=torch.float64), sigmas=KINK_SIGMAS)
        st = run.branch_state("c")
        assert not run.weighs_metric and run.metric_weight(st) == 1.0 and st.error_per_metric.count == 0


def test_magcache_auto_never_weighs_its_error():
    model = Model(kinked)
    config = MagCacheConfig(threshold=0.3, mag_ratios=[0.97] * len(KINK_SIGMAS), retention_ratio=0.1,
                            max_skip_steps=4, forecast_order=AUTO)
    run = apply_mag_cache_hook(stack_of(model), config)
    sample(model, run, torch.zeros(1, 4, 3, dtype=torch.float64), sigmas=KINK_SIGMAS)
    st = run.branch_state("c")
    assert run.metric_weight(st) == 1.0 and st.error_per_metric.count == 0
    assert any(not e.computed for e in run.stats.evaluations)


# -- the candidates the forecasting packs carry: TaylorSeer's Taylor step and a Chebyshev fit -------------------------

def combine(weights: list[float], residuals: list[torch.Tensor]) -> torch.Tensor:
    return sum(w * r for w, r in zip(weights, residuals))


def test_taylor_weights_are_taylorseers_derivative_update_across_refreshes():
    # TaylorSeer keeps, per refresh, the residual and its derivative factors: f0 = r, f(i+1) = (f(i) - the f(i) of
    # the refresh before) / (the distance between the two refreshes), and forecasts sum(f(i) * dx ** i / i!)
    coords = [1.0, 0.93, 0.81]  # non-uniform, as a shifted schedule's computed steps
    g = torch.Generator().manual_seed(0)
    residuals = [torch.randn(6, generator=g, dtype=torch.float64) for _ in coords]
    factors: dict[int, torch.Tensor] = {}
    for i, (t, r) in enumerate(zip(coords, residuals)):
        updated = {0: r}
        for k in range(2):
            if k in factors and i > 0:
                updated[k + 1] = (updated[k] - factors[k]) / (t - coords[i - 1])
        factors = updated
    for x in (0.74, 0.6, 0.3):
        dx = x - coords[-1]
        taylorseer = factors[0] + factors[1] * dx + factors[2] * dx * dx / 2
        torch.testing.assert_close(combine(taylor_weights(coords, x), residuals), taylorseer, rtol=0, atol=1e-12)
    linear_residuals = [(1 - 3 * t) * BASE for t in coords]
    torch.testing.assert_close(combine(taylor_weights(coords, 0.5), linear_residuals), (1 - 3 * 0.5) * BASE)
    # a curved trajectory: the lagged derivatives err, unlike Lagrange through the same three points
    assert not torch.allclose(combine(taylor_weights(coords, 0.5), [quadratic(t, 0) for t in coords]),
                              quadratic(0.5, 0))


def test_the_chebyshev_fit_keeps_the_level_smooths_alternation_and_without_ridge_is_a_least_squares_fit():
    nodes, x = [0.93, 0.81, 0.64, 0.45], 0.3
    assert sum(chebyshev_weights(nodes, x)) == pytest.approx(1.0, abs=1e-12)  # constants exactly: the level unshrunk
    # no ridge: three nodes give Lagrange's 2nd order, four fit a quadratic exactly
    assert chebyshev_weights(nodes[:3], x, ridge=0.0) == pytest.approx(lagrange_weights(nodes[:3], x), abs=1e-9)
    fitted = combine(chebyshev_weights(nodes, x, ridge=0.0), [quadratic(t, 0) for t in nodes])
    torch.testing.assert_close(fitted, quadratic(x, 0), rtol=0, atol=1e-9)
    # a level with an alternating wobble: 1st order extrapolates the last swing, the fit keeps near the level
    wobble = [BASE + 0.3 * (-1) ** i * BASE.flip(0) for i in range(len(nodes))]
    truth = BASE + 0.3 * BASE.flip(0)  # the next one swings back
    fit_error = (combine(chebyshev_weights(nodes, x), wobble) - truth).norm()
    first_error = (combine(lagrange_weights(nodes[-2:], x), wobble[-2:]) - truth).norm()
    assert fit_error < first_error
    assert CANDIDATE[CHEBYSHEV].needs == len(nodes) and CANDIDATE[TAYLOR].needs == 3


WOBBLE_SIGMAS = [1.0 - 0.04 * i for i in range(16)]


def wobbling(s: float, row: int) -> torch.Tensor:
    """A straight trend in sigma plus a swing that changes sign at every step."""
    step = WOBBLE_SIGMAS.index(s)
    return (1 + 2 * s) * BASE + 0.3 * (-1) ** step * BASE.flip(0)


def test_auto_chooses_the_chebyshev_fit_where_the_computed_residuals_alternate_and_it_costs_no_model_call():
    x = torch.zeros(1, 4, 3, dtype=torch.float64)
    reference = sample(Model(wobbling), NoCache(), x, sigmas=WOBBLE_SIGMAS)
    ret_steps = 8  # enough computed steps to score the fit (it spans four) and its consecutive errors

    def run_with(order):
        model = Model(wobbling)
        run = teacache(model, order, ret_steps=ret_steps, threshold=100.0)
        got = sample(model, run, x, sigmas=WOBBLE_SIGMAS)
        error = sum(float((a - b).norm()) for a, b in zip(got, reference))
        return run, model, error

    run, model, auto_error = run_with(AUTO)
    skipped = [i for i, e in enumerate(run.stats.evaluations) if not e.computed]
    assert skipped == list(range(ret_steps, len(WOBBLE_SIGMAS) - 1))
    assert model.blocks[0].calls == len(WOBBLE_SIGMAS) - len(skipped)  # forecasting runs no block
    chosen = [candidates(run)[i] for i in skipped]
    assert chosen[0] == CHEBYSHEV and set(chosen) <= {0, CHEBYSHEV}  # far from the last computed step: reuse
    assert run.stats.summary()["candidates"] == {name: chosen.count(key) for key, name in
                                                 ((0, "reuse"), (CHEBYSHEV, "Chebyshev fit")) if key in chosen}
    assert auto_error < min(run_with(order)[2] for order in (0, 1, 2))


def test_candidate_scores_choose_a_pack_candidate_that_predicted_best():
    scores = CandidateScores()
    errors = [1.0, 0.5, 0.4, 0.2, 0.3]  # the Taylor step predicted the computed steps best
    scores.update(measurement(errors, 1.0), horizon=0.1)
    assert scores.best() == TAYLOR
    assert scores.best(kept=2) == 1  # with two residuals kept, only reuse and 1st order can be made
    assert scores.best(horizon=0.5) == 0  # five times the distance: every candidate's error grows past reuse's
