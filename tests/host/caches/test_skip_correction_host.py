"""Skip correction through Apply TeaCache and Apply MagCache on this ComfyUI: with the sampler 'euler' a computed step
after skipped ones carries the correction (the run's statistics count it), with any other sampler nothing changes and
the statistics say why, and a workflow without the input runs as before; on two of the quality benchmark's trained
models (``benchmarks/cache_quality_model.py``) it gains quality at the same threshold."""
from __future__ import annotations

import pytest

from omnitest.cache_nodes import apply_magcache, apply_teacache, last_summary, save_identity_calibrations
from omnitest.quality import benchmark_modules, psnr_db

pytestmark = pytest.mark.host

STEPS = 10
IDENTITY = "skip-correction-identity"
MIN_GAIN_DB = 1.5  # TeaCache 0.1 'auto': small +2.8, long +3.3 dB when it was measured


@pytest.fixture(scope="module")
def wan():
    from omnitest import tiny_models

    save_identity_calibrations(IDENTITY, STEPS)
    return tiny_models.build_case("wan21_t2v")


def apply(cache: str, model, correction: float | None):
    """The cache with a budget of 4 of ``STEPS`` and threshold 0 (the plan alone decides, so every variant computes
    the same steps); ``correction`` None leaves the input out, as a workflow saved before it."""
    extra = {} if correction is None else {"skip_correction": correction}
    if cache == "teacache":
        return apply_teacache(model, IDENTITY, threshold=0.0, forecast="1st order", forward_budget=4, **extra)
    return apply_magcache(model, IDENTITY, threshold=0.0, forecast="1st order", forward_budget=4, **extra)


@pytest.mark.parametrize("cache", ["teacache", "magcache"])
def test_with_euler_a_computed_step_after_skips_carries_the_correction(wan, cache):
    from omnitest import tiny_models

    plain = tiny_models.sample(wan, model=apply(cache, wan.patcher, None), steps=STEPS, sampler_name="euler")
    plain_summary = last_summary()
    off = tiny_models.sample(wan, model=apply(cache, wan.patcher, 0.0), steps=STEPS, sampler_name="euler")
    assert off.equal(plain)  # 0 is the node without the input
    got = tiny_models.sample(wan, model=apply(cache, wan.patcher, 0.5), steps=STEPS, sampler_name="euler")
    summary = last_summary()
    assert summary["computed"] == plain_summary["computed"] == 4
    assert got.isfinite().all() and not got.equal(plain)
    (note,) = [n for n in summary["notes"] if n.startswith("skip correction")]
    corrected = int(note.split(": ")[1].split(" ")[0])
    assert note.startswith("skip correction 0.5: ") and 1 <= corrected <= 2  # after each gap but before the last step
    assert not any(n.startswith("skip correction") for n in plain_summary["notes"])


@pytest.mark.parametrize("sampler", ["dpmpp_2m", "uni_pc", "heun"])
def test_with_another_sampler_nothing_changes_and_the_statistics_say_why(wan, sampler):
    from omnitest import tiny_models

    plain = tiny_models.sample(wan, model=apply("teacache", wan.patcher, 0.0), steps=STEPS, sampler_name=sampler)
    got = tiny_models.sample(wan, model=apply("teacache", wan.patcher, 0.5), steps=STEPS, sampler_name=sampler)
    assert got.equal(plain)
    notes = last_summary()["notes"]
    assert "skip correction: not applied, the sampler does not take plain Euler steps" in " ".join(notes)


@pytest.mark.parametrize("name", ["small", "long"])
def test_on_trained_models_the_correction_gains_quality_at_the_same_threshold(name, own_user_directory):
    bench, models = benchmark_modules()
    spec = models.MODELS[name]
    case, counter = bench.calibrated_case(spec, 30)
    reference, _ = bench.sample_all(spec, case, None, counter, 30)
    means = {}
    for correction in (0.0, 0.5):
        outs, evaluations = bench.sample_all(spec, case, bench.tea(case, 0.1, "auto", 0, correction), counter, 30)
        means[correction] = sum(psnr_db(o, r) for o, r in zip(outs, reference)) / len(outs)
        assert sum(evaluations) / len(evaluations) <= 14  # it skips: about 13 of 30 computed on both models
    assert means[0.5] >= means[0.0] + MIN_GAIN_DB, means


def test_only_comfyuis_plain_euler_on_an_eps_or_flow_model_takes_euler_steps():
    import comfy.model_sampling as ms
    import comfy.samplers
    from omnitest.pack import pack_module

    takes_euler_steps = pack_module("nodes.samplers").takes_euler_steps

    class Flow(ms.ModelSamplingDiscreteFlow, ms.CONST):
        pass

    class Eps(ms.ModelSamplingDiscrete, ms.EPS):
        pass

    class VPrediction(ms.ModelSamplingDiscrete, ms.V_PREDICTION):
        pass

    euler = comfy.samplers.ksampler("euler")
    assert takes_euler_steps(euler, Flow()) and takes_euler_steps(euler, Eps())
    assert not takes_euler_steps(euler, VPrediction())
    assert not takes_euler_steps(comfy.samplers.ksampler("euler", {"s_churn": 1.0}), Flow())
    for other in ("euler_ancestral", "dpmpp_2m", "heun", "lcm"):
        assert not takes_euler_steps(comfy.samplers.ksampler(other), Flow()), other
    assert not takes_euler_steps(None, Flow())
