"""The caches' ``forecast`` input inside a real ComfyUI (in-process, tiny Wan): threshold 0 stays bit-identical with
forecasting on, a workflow without the input samples as 'off' does, skipped steps forecast from the sampler's sigma
(euler, heun, denoise < 1, a batch of two, the Wan 2.2 two-expert split), and an unknown value is refused naming the
node. 'auto' chooses an order per skipped step and the run's statistics say which."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from omnitest.cache_nodes import apply_magcache, apply_teacache, save_identity_calibrations

pytestmark = pytest.mark.host

STEPS = 10
IDENTITY = "forecast-identity"
ORDERS = ["1st order", "2nd order"]


@pytest.fixture(scope="module")
def env(user_dir):
    from omnitest import tiny_models
    from omnitest.pack import pack_module

    save_identity_calibrations(IDENTITY, STEPS)

    class Env:
        tiny = tiny_models
        case = tiny_models.build_case("wan21_t2v")

        @staticmethod
        def apply(cache: str, threshold: float, forecast: str | None, model=None):
            model = model or Env.case.patcher
            if cache == "teacache":
                return apply_teacache(model, IDENTITY, threshold, forecast=forecast)
            return apply_magcache(model, IDENTITY, threshold, forecast=forecast, max_skip_steps=2)

        @staticmethod
        def last_run():
            return pack_module("nodes.stats_store").recent_runs(1)[0]

    yield Env


def reasons(run) -> list[str]:
    return [b["reason"] for e in run["evaluations"] for b in e["branches"]]


def skipped_reasons(run) -> set[str]:
    return {b["reason"] for e in run["evaluations"] if not e["computed"] for b in e["branches"]}


REUSING = {"teacache": 1.5, "magcache": 0.3}


@pytest.mark.parametrize("cache", ["teacache", "magcache"])
@pytest.mark.parametrize("forecast", ORDERS + ["auto"])
def test_threshold_zero_with_forecast_is_bit_identical_to_no_node(env, cache, forecast):
    baseline = env.tiny.sample(env.case, steps=STEPS, cfg=3.0)
    assert torch.equal(env.tiny.sample(env.case, model=env.apply(cache, 0.0, forecast), steps=STEPS, cfg=3.0),
                       baseline)
    assert env.last_run()["summary"]["reused"] == 0


@pytest.mark.parametrize("cache", ["teacache", "magcache"])
def test_a_workflow_without_the_input_samples_as_off_and_forecasting_changes_the_skipped_steps(env, cache):
    without = env.tiny.sample(env.case, model=env.apply(cache, REUSING[cache], None), steps=STEPS, cfg=3.0)
    reuse_run = env.last_run()
    off = env.tiny.sample(env.case, model=env.apply(cache, REUSING[cache], "off"), steps=STEPS, cfg=3.0)
    assert torch.equal(without, off)
    assert reuse_run["summary"]["reused"] > 0 and skipped_reasons(reuse_run) == {"reuse"}
    for forecast in ORDERS:
        out = env.tiny.sample(env.case, model=env.apply(cache, REUSING[cache], forecast), steps=STEPS, cfg=3.0)
        run = env.last_run()
        assert "forecast" in skipped_reasons(run)
        assert torch.isfinite(out).all() and not torch.equal(out, off)
        assert run["summary"]["cache_bytes"] > reuse_run["summary"]["cache_bytes"]


@pytest.mark.parametrize("cache", ["teacache", "magcache"])
@pytest.mark.parametrize("sampling", [dict(sampler_name="heun"), dict(denoise=0.5), dict(batch=2)],
                         ids=["heun", "denoise-0.5", "batch-2"])
def test_forecast_under_other_sampling_situations(env, cache, sampling):
    sampling = dict(sampling)
    case = env.case
    if "batch" in sampling:
        case = dataclasses.replace(case, latent=torch.zeros(sampling.pop("batch"), *case.latent.shape[1:]))
    baseline = env.tiny.sample(case, steps=STEPS, cfg=3.0, **sampling)
    assert torch.equal(env.tiny.sample(case, model=env.apply(cache, 0.0, "2nd order"), steps=STEPS, cfg=3.0,
                                       **sampling), baseline)
    out = env.tiny.sample(case, model=env.apply(cache, REUSING[cache], "2nd order"), steps=STEPS, cfg=3.0, **sampling)
    run = env.last_run()
    assert out.shape == baseline.shape and torch.isfinite(out).all()
    assert "forecast" in skipped_reasons(run), reasons(run)
    assert "forecast-fallback" not in reasons(run)


def test_wan22_experts_forecast_each_from_their_own_segment(env):
    import comfy.sample

    wan = env.case
    high = env.apply("magcache", REUSING["magcache"], "2nd order")
    low = env.apply("magcache", REUSING["magcache"], "2nd order")
    steps, switch = 12, 6
    runs = []
    with torch.inference_mode():
        noise = comfy.sample.prepare_noise(wan.latent, 0)
        mid = comfy.sample.sample(high, noise, steps, 3.0, "euler", "simple", wan.positive, wan.negative, wan.latent,
                                  start_step=0, last_step=switch, force_full_denoise=False, disable_pbar=True, seed=0)
        runs.append(env.last_run())
        out = comfy.sample.sample(low, torch.zeros_like(noise), steps, 3.0, "euler", "simple", wan.positive,
                                  wan.negative, mid, start_step=switch, last_step=steps, disable_noise=True,
                                  disable_pbar=True, seed=0)
        runs.append(env.last_run())
    assert torch.isfinite(out).all()
    for run in runs:
        # each expert's run starts with nothing cached: its first call computes, its skips forecast from its own
        assert run["evaluations"][0]["computed"] and reasons(run)[0] == "first"
        assert "forecast" in skipped_reasons(run), reasons(run)


@pytest.mark.parametrize("cache", ["teacache", "magcache"])
def test_an_unknown_forecast_value_is_refused_naming_the_node(env, cache):
    title = "Apply TeaCache" if cache == "teacache" else "Apply MagCache"
    with pytest.raises(ValueError, match=rf"^{title}: unknown forecast '3rd order'"):
        env.apply(cache, 0.1, "3rd order")


@pytest.mark.parametrize("cache", ["teacache", "magcache"])
def test_auto_records_the_candidate_of_every_skipped_step_in_the_run_statistics(env, cache):
    out = env.tiny.sample(env.case, model=env.apply(cache, REUSING[cache], "auto"), steps=STEPS, cfg=3.0)
    assert torch.isfinite(out).all()
    run = env.last_run()
    skipped = [b for e in run["evaluations"] if not e["computed"] for b in e["branches"]]
    computed = [b for e in run["evaluations"] if e["computed"] for b in e["branches"]]
    names = {0: "reuse", 1: "1st order", 2: "2nd order", 3: "Taylor", 4: "Chebyshev fit"}  # the candidates
    assert skipped and all(b["candidate"] in names for b in skipped)
    assert all(b["candidate"] is None for b in computed)
    assert all((b["reason"] == "reuse") == (b["candidate"] == 0) for b in skipped)
    counted = {}
    for b in skipped:
        counted[names[b["candidate"]]] = counted.get(names[b["candidate"]], 0) + 1
    assert run["summary"]["candidates"] == counted


def test_off_records_no_candidate_and_auto_is_an_option_of_both_nodes(env):
    from omnitest.pack import pack_module

    env.tiny.sample(env.case, model=env.apply("teacache", REUSING["teacache"], None), steps=STEPS, cfg=3.0)
    run = env.last_run()
    assert run["summary"]["candidates"] is None
    assert all(b["candidate"] is None for e in run["evaluations"] for b in e["branches"])
    for module, node in (("nodes.caches.teacache", "ApplyTeaCache"), ("nodes.caches.magcache", "ApplyMagCache")):
        inputs = getattr(pack_module(module), node).INPUT_TYPES()
        options = inputs["optional"]["forecast"]
        assert "auto" in str(options) and "2nd order" in str(options)
