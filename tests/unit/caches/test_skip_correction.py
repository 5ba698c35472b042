"""Skip correction (caching.skip_correction): once the step after a run of skipped steps is computed, its stack
output carries what interpolating the gap corrects in what the skipped steps added, for a sampler that takes Euler
steps, and under a speed-up for a multistep sampler, weighed by its step weights; nothing changes otherwise."""
from __future__ import annotations

import math

import pytest
import torch

from omni_hooks.magcache import MagCacheConfig, apply_mag_cache_hook
from omni_hooks.caching.skip_correction import SkipCorrection
from omni_hooks.blockstack import StackSignal
from omni_hooks.teacache import CallContext, TeaCacheConfig, apply_teacache_hook
from omnitest.sigma_stack import Model, stack_of

SIGMAS = [1.0, 0.96, 0.9, 0.81, 0.68, 0.52, 0.33, 0.15]  # one sigma per step, like a shifted flow schedule
SCHEDULE = tuple(SIGMAS + [0.0])                          # ... and the sigma after the last step
BASE = torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(4, 3)


def linear(s: float, row: int) -> torch.Tensor:
    """Linear in sigma, another line per batch row (branch): an interpolation between two computed steps is exact."""
    return (1 + row) * BASE + (3 - row) * s * BASE.flip(0)


def quadratic(s: float, row: int) -> torch.Tensor:
    return linear(s, row) + 4 * s * s * BASE.flip(1)


#: a multistep sampler's step weights (``CallContext.step_weights``): unlike the sigma steps, one below a quarter of
#: the weights before it (step 3: its gap is not corrected) and one negative (step 6)
WEIGHTS = (0.05, 0.09, 0.08, -0.02, 0.2, 0.23, -0.3, 0.15)


def teacache(model: Model, strength: float, budget: int = 4, order: int | str = 0, speedup: float = 0.0):
    """TeaCache whose plan (a forward budget, or a ``speedup``; threshold 0) computes ``budget`` of the steps, with
    skip correction."""
    signal = StackSignal(compute=lambda block, args, kwargs, captured: kwargs["sigma"][:, None])
    config = TeaCacheConfig(0.0, (0.0, 0.0, 0.0, 1.0, 0.0), forward_budget=0 if speedup else budget,
                            forecast_order=order, skip_correction=strength, speedup=speedup)
    return apply_teacache_hook(stack_of(model), config, signal)


def sample(model: Model, run, x: torch.Tensor, euler_steps: bool = True, branches=("c", "u"), weights=None,
           weighted: bool = False):
    """The stack output of every step (the same input ``x`` at each: the outputs differ by their residuals);
    ``weights`` / ``weighted``: the sampler's step weights and whether its correction is weighed by them."""
    outputs = []
    for step, s in enumerate(SIGMAS):
        run.begin_call(CallContext(branches=list(branches), labels=list(branches), step=step, total_steps=len(SIGMAS),
                                   sigma=s, schedule=SCHEDULE, euler_steps=euler_steps, step_weights=weights,
                                   weighted_correction=weighted))
        try:
            outputs.append(model(x, torch.full((x.shape[0],), s, dtype=torch.float64)))
        finally:
            run.end_call()
    return outputs


def computed_steps(run) -> list[int]:
    return [e.step for e in run.stats.evaluations if e.computed]


def expected_correction(residual, used, computed: list[int], step: int, row: int, strength: float,
                        weights=None) -> torch.Tensor:
    """By hand, step by step: what a computed ``step`` adds after the skipped steps before it, with the true
    residual (exact for a linear one) in place of the interpolation and ``used(k)`` what skipped step k used; each
    step weighed by its sigma step, or by ``weights``."""
    before = max(c for c in computed if c < step)
    gap = range(before + 1, step)
    h = weights or [SCHEDULE[k] - SCHEDULE[k + 1] for k in range(len(SIGMAS))]
    total = sum((residual(SIGMAS[k], row) - used(k)) * h[k] for k in gap)
    return total * strength * (SCHEDULE[step + 1] / SCHEDULE[step]) / h[step]


def test_the_running_sums_give_the_step_by_step_interpolation_of_any_gap():
    """``SkipCorrection`` against an explicit sum over the gap with the interpolation written out per step, for
    arbitrary residuals used (a forecast's) and arbitrary sigmas."""
    g = torch.Generator().manual_seed(0)
    previous, computed = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    sigmas = [0.97, 0.9, 0.86, 0.71]          # skipped steps, after a computed one at 1.0, before one at 0.6
    nexts = sigmas[1:] + [0.6]
    used = [torch.randn(3, 5, generator=g) for _ in sigmas]
    gap = SkipCorrection()
    for r, s, n in zip(used, sigmas, nexts):
        gap.skipped(r, s, n)
    got = gap.correction(previous, 1.0, computed, 0.6, 0.45, strength=0.5)
    interpolated = [previous + (computed - previous) * (s - 1.0) / (0.6 - 1.0) for s in sigmas]
    want = sum((i - u) * (s - n) for i, u, s, n in zip(interpolated, used, sigmas, nexts)) * 0.5 * (0.45 / 0.6) / 0.15
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert gap.used is None and gap.steps == 0 and gap.moments == 0  # the gap is forgotten
    assert gap.correction(previous, 0.6, computed, 0.45, 0.3, strength=0.5) is None  # no skip since


def test_with_step_weights_the_running_sums_weigh_each_step_by_its_weight():
    g = torch.Generator().manual_seed(1)
    previous, computed = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    sigmas, weights = [0.97, 0.9, 0.86], [0.02, -0.01, 0.07]
    used = [torch.randn(3, 5, generator=g) for _ in sigmas]
    gap = SkipCorrection()
    for r, s, n, w in zip(used, sigmas, sigmas[1:] + [0.6], weights):
        gap.skipped(r, s, n, w)
    got = gap.correction(previous, 1.0, computed, 0.6, 0.45, strength=0.5, weight=0.11)
    interpolated = [previous + (computed - previous) * (s - 1.0) / (0.6 - 1.0) for s in sigmas]
    want = sum((i - u) * w for i, u, w in zip(interpolated, used, weights)) * 0.5 * (0.45 / 0.6) / 0.11
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for own in (0.0, 0.004):  # below a quarter of the gap's largest weight (0.02): the gap is forgotten
        gap.skipped(used[0], 0.9, 0.8, 0.02)
        assert gap.correction(previous, 1.0, computed, 0.8, 0.7, strength=0.5, weight=own) is None
        assert gap.used is None
    gap.skipped(used[0], 0.9, 0.8, 0.02)  # a negative weight of some size corrects the other way
    got = gap.correction(previous, 1.0, computed, 0.8, 0.7, strength=0.5, weight=-0.05)
    want = (previous + (computed - previous) * (0.9 - 1.0) / (0.8 - 1.0) - used[0]) * 0.02 * 0.5 * (0.7 / 0.8) / -0.05
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("why", ["no skip", "no previous", "shape", "final step", "rising sigma", "same sigma"])
def test_a_gap_that_cannot_be_interpolated_adds_nothing(why):
    r = torch.ones(2, 3)
    gap = SkipCorrection()
    if why != "no skip":
        gap.skipped(r, 0.9, 0.8)
    previous = None if why == "no previous" else torch.zeros(3, 3) if why == "shape" else r
    sigma, next_sigma = {"final step": (0.8, 0.0), "rising sigma": (0.8, 0.85), "same sigma": (1.0, 0.5)}.get(
        why, (0.8, 0.7))
    assert gap.correction(previous, 1.0, 2 * r, sigma, next_sigma, strength=1.0) is None
    assert gap.used is None


@pytest.mark.parametrize("strength", [1.0, 0.5])
def test_each_computed_step_after_a_gap_adds_the_interpolations_correction_of_what_the_skips_reused(strength):
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    plain_model = Model(linear)
    plain = sample(plain_model, teacache(plain_model, 0.0), x)
    model = Model(linear)
    run = teacache(model, strength)
    got = sample(model, run, x)
    computed = computed_steps(run)
    assert len(computed) == 4 and computed[0] == 0 and computed[-1] == len(SIGMAS) - 1
    corrected = 0
    for step in range(len(SIGMAS)):
        if step not in computed or step == 0 or step - 1 in computed or SCHEDULE[step + 1] == 0:
            assert torch.equal(got[step], plain[step]), step  # skips, and computed steps after no gap, unchanged
            continue
        before = max(c for c in computed if c < step)
        for row in range(2):
            want = expected_correction(linear, lambda k: linear(SIGMAS[before], row), computed, step, row, strength)
            torch.testing.assert_close(got[step][row] - plain[step][row], want, rtol=1e-9, atol=1e-12)
        corrected += 1
    assert corrected >= 1 and run.stats.corrected_steps == corrected
    assert f"skip correction {strength:g}: {corrected} computed step(s)" in " ".join(run.stats.summary()["notes"])


def test_the_skips_after_a_corrected_step_reuse_its_computed_residual_not_the_corrected_output():
    x = torch.zeros(2, 4, 3, dtype=torch.float64)
    model = Model(linear)
    run = teacache(model, 1.0)
    got = sample(model, run, x)
    computed = computed_steps(run)
    for step in range(1, len(SIGMAS)):
        if step not in computed:
            source = max(c for c in computed if c < step)
            for row in range(2):
                torch.testing.assert_close(got[step][row], linear(SIGMAS[source], row), rtol=0, atol=1e-12)


def test_with_a_forecast_the_correction_is_of_what_the_forecast_used():
    """1st order: the skips used an extrapolation; on a quadratic residual the interpolation is not exact either, so
    the check is the running sums against the step-by-step sum with the interpolation written out."""
    x = torch.zeros(1, 4, 3, dtype=torch.float64)
    plain_model, model = Model(quadratic), Model(quadratic)
    plain_run, run = teacache(plain_model, 0.0, budget=5, order=1), teacache(model, 1.0, budget=5, order=1)
    plain, got = sample(plain_model, plain_run, x, branches=("c",)), sample(model, run, x, branches=("c",))
    computed = computed_steps(run)
    assert computed == computed_steps(plain_run)
    for step in computed[2:-1]:
        before = max(c for c in computed if c < step)
        if before == step - 1:
            continue
        used = {k: plain[k][0] for k in range(before + 1, step)}  # x is 0: a skip's output is the residual it used
        s0, s1 = SIGMAS[before], SIGMAS[step]

        def interpolated(s, row, before=before, step=step, s0=s0, s1=s1):
            return plain[before][0] + (plain[step][0] - plain[before][0]) * (s - s0) / (s1 - s0)

        want = expected_correction(interpolated, used.__getitem__, computed, step, 0, 1.0)
        torch.testing.assert_close(got[step][0] - plain[step][0], want, rtol=1e-9, atol=1e-12)


def test_without_euler_steps_nothing_is_corrected_and_the_statistics_say_why():
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    plain_model, model = Model(linear), Model(linear)
    plain = sample(plain_model, teacache(plain_model, 0.0), x, euler_steps=False)
    run = teacache(model, 0.5)
    got = sample(model, run, x, euler_steps=False)
    assert all(torch.equal(a, b) for a, b in zip(got, plain))
    assert run.stats.corrected_steps == 0
    notes = " ".join(run.stats.summary()["notes"])
    assert "skip correction: not applied, the sampler does not take plain Euler steps" in notes


def test_under_a_speed_up_a_multistep_sampler_is_corrected_by_its_step_weights():
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    plain_model, model = Model(linear), Model(linear)
    plain_run, run = teacache(plain_model, 0.0, speedup=2.0), teacache(model, 0.5, speedup=2.0)
    plain = sample(plain_model, plain_run, x, euler_steps=False, weights=WEIGHTS, weighted=True)
    got = sample(model, run, x, euler_steps=False, weights=WEIGHTS, weighted=True)
    computed = computed_steps(run)
    assert computed == computed_steps(plain_run) and len(computed) == 4
    corrected = 0
    for step in range(len(SIGMAS)):
        gap = step in computed and step > 0 and step - 1 not in computed and SCHEDULE[step + 1] > 0
        before = max((c for c in computed if c < step), default=0)
        if not gap or abs(WEIGHTS[step]) < 0.25 * max(abs(w) for w in WEIGHTS[before + 1:step]):
            assert torch.equal(got[step], plain[step]), step
            continue
        for row in range(2):
            want = expected_correction(linear, lambda k: linear(SIGMAS[before], row), computed, step, row, 0.5,
                                       list(WEIGHTS))
            torch.testing.assert_close(got[step][row] - plain[step][row], want, rtol=1e-9, atol=1e-12)
        corrected += 1
    assert corrected >= 1 and run.stats.corrected_steps == corrected
    notes = " ".join(run.stats.summary()["notes"])
    assert f"skip correction 0.5 (weighed by the sampler's step weights): {corrected} computed step(s)" in notes


@pytest.mark.parametrize("case", ["no speed-up", "not weighted", "no weights"])
def test_a_multistep_sampler_is_not_corrected_without_a_speed_up_its_weights_or_their_use(case):
    """A workflow saved with the skip correction and such a sampler corrected nothing; it keeps doing so."""
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    speedup = 0.0 if case == "no speed-up" else 2.0
    plain_model, model = Model(linear), Model(linear)
    plain_run, run = teacache(plain_model, 0.0, speedup=speedup), teacache(model, 0.5, speedup=speedup)
    options = {"euler_steps": False, "weights": None if case == "no weights" else WEIGHTS,
               "weighted": case != "not weighted"}
    plain, got = sample(plain_model, plain_run, x, **options), sample(model, run, x, **options)
    assert all(torch.equal(a, b) for a, b in zip(got, plain))
    assert run.stats.corrected_steps == 0
    assert "skip correction: not applied, the sampler does not take plain Euler steps (use the sampler 'euler', or " \
           "the speed-up" in " ".join(run.stats.summary()["notes"])


def test_strength_zero_is_bit_identical_and_says_nothing():
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    a_model, b_model = Model(linear), Model(linear)
    config = TeaCacheConfig(0.0, (0.0, 0.0, 0.0, 1.0, 0.0), forward_budget=4)
    signal = StackSignal(compute=lambda block, args, kwargs, captured: kwargs["sigma"][:, None])
    run = apply_teacache_hook(stack_of(a_model), config, signal)
    assert all(torch.equal(a, b) for a, b in zip(sample(a_model, run, x), sample(b_model, teacache(b_model, 0.0), x)))
    assert not any("skip correction" in n for n in run.stats.summary()["notes"])


def test_magcache_corrects_too_and_cache_bytes_count_the_open_gap():
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    plain_model, model = Model(linear), Model(linear)
    ratios = tuple([1.0] + [0.999] * (len(SIGMAS) - 1))

    def mag(m, strength):
        return apply_mag_cache_hook(stack_of(m), MagCacheConfig(threshold=0.5, mag_ratios=ratios, max_skip_steps=2,
                                                                retention_ratio=0.0, skip_correction=strength))

    plain_run, run = mag(plain_model, 0.0), mag(model, 1.0)
    plain, got = sample(plain_model, plain_run, x), sample(model, run, x)
    assert computed_steps(run) == computed_steps(plain_run)
    assert run.stats.corrected_steps >= 1 and not all(torch.equal(a, b) for a, b in zip(got, plain))
    residual = BASE.numel() * 8  # per branch, float64
    accumulator = BASE.numel() * 8  # per branch, float64 (the residual's, wider than float32)
    assert run.stats.cache_bytes == 2 * (residual + accumulator)
    assert plain_run.stats.cache_bytes == 2 * residual


@pytest.mark.parametrize("value", [-0.1, 1.5, math.nan, True, "0.5"])
def test_a_strength_outside_zero_to_one_is_refused(value):
    with pytest.raises(ValueError, match="skip_correction must be a number from 0"):
        TeaCacheConfig(0.1, (0.0, 0.0, 0.0, 1.0, 0.0), skip_correction=value)

