"""Apply TeaCache under varied sampling situations, in-process on the real host: multi-evaluation samplers,
denoise < 1, batch > 1, cond and uncond in separate calls (low memory), several cond entries, a resolution change
between runs. Threshold 0 must stay bit-identical; a reusing threshold must keep first/last steps computed."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.host

IDENTITY = "sampling-identity"
STEPS = 10


@pytest.fixture(scope="module")
def env(user_dir):
    from omnitest import tiny_models
    from omnitest.pack import pack_module, run_node

    pack_module("nodes.caches.calibration_files").save(
        "teacache", IDENTITY, {"coefficients": [0, 0, 0, 1, 0], "family": "wan", "signal": "default"})
    node = pack_module("nodes.caches.teacache").ApplyTeaCache
    runs = pack_module("nodes.stats_store")

    class Env:
        tiny = tiny_models
        case = tiny_models.build_case("wan21_t2v")

        @staticmethod
        def apply(threshold: float, model=None):
            return run_node(node, model=model or Env.case.patcher, rel_l1_thresh=threshold, start_percent=0.0,
                            end_percent=1.0, cache_device="compute device",
                            model_variant=f"calibration: {IDENTITY}")[0]

        @staticmethod
        def last_run():
            return runs.recent_runs(1)[0]

    yield Env


def check_zero_is_identical(env, **sample_kwargs):
    baseline = env.tiny.sample(env.case, **sample_kwargs)
    out = env.tiny.sample(env.case, model=env.apply(0.0), **sample_kwargs)
    assert torch.equal(out, baseline)
    return env.last_run()


@pytest.mark.parametrize("sampler_name", ["heun", "dpm_2", "dpmpp_2s_ancestral"])
def test_multi_evaluation_samplers_take_steps_from_the_schedule(env, sampler_name):
    run = check_zero_is_identical(env, steps=STEPS, cfg=3.0, sampler_name=sampler_name)
    steps = [e["step"] for e in run["evaluations"]]
    assert len(steps) > STEPS  # several model calls per step
    assert steps == sorted(steps) and steps[0] == 0 and steps[-1] == STEPS - 1
    assert set(steps) == set(range(STEPS))
    env.tiny.sample(env.case, model=env.apply(1.0), steps=STEPS, cfg=3.0, sampler_name=sampler_name)
    evaluations = env.last_run()["evaluations"]
    assert evaluations[0]["computed"]
    assert all(e["computed"] for e in evaluations if e["step"] == STEPS - 1)


def test_denoise_below_one_counts_steps_of_the_truncated_schedule(env):
    run = check_zero_is_identical(env, steps=STEPS, cfg=3.0, denoise=0.5)
    assert run["evaluations"][0]["total_steps"] == STEPS
    assert [e["step"] for e in run["evaluations"]] == list(range(STEPS))


def test_batch_of_two_latents(env):
    import dataclasses
    batch = dataclasses.replace(env.case, latent=torch.zeros(2, *env.case.latent.shape[1:]))
    baseline = env.tiny.sample(batch, steps=STEPS, cfg=3.0)
    assert torch.equal(env.tiny.sample(batch, model=env.apply(0.0), steps=STEPS, cfg=3.0), baseline)
    cached = env.tiny.sample(batch, model=env.apply(1.0), steps=STEPS, cfg=3.0)
    run = env.last_run()
    assert cached.shape == baseline.shape and torch.isfinite(cached).all()
    assert set(run["summary"]["branches"]) == {"cond", "uncond"} and run["summary"]["reused"] > 0


def test_cond_and_uncond_in_separate_calls_under_low_memory(env, monkeypatch):
    import comfy.model_management
    import comfy.model_patcher
    import comfy.samplers

    class LowMemory:
        """comfy.model_management as the sampler sees it, with (almost) no free memory."""

        def __getattr__(self, name):
            return getattr(comfy.model_management, name)

        @staticmethod
        def get_free_memory(*args, torch_free_too=False, **kwargs):
            return (1, 1) if torch_free_too else 1

    baseline = env.tiny.sample(env.case, steps=STEPS, cfg=3.0)
    # ComfyUI batches cond and uncond only if memory_required * 1.5 < free memory: pretend there is almost none where
    # the host's sampler asks (newer hosts ask the model's patcher, older ones comfy.model_management)
    if hasattr(comfy.model_patcher.ModelPatcher, "get_free_memory"):
        monkeypatch.setattr(comfy.model_patcher.ModelPatcher, "get_free_memory", lambda self, device: 1)
    else:
        monkeypatch.setattr(comfy.samplers, "model_management", LowMemory())
    split = env.tiny.sample(env.case, model=env.apply(0.0), steps=STEPS, cfg=3.0)
    run = env.last_run()
    assert len(run["evaluations"]) == 2 * STEPS  # one call per branch per step
    assert all(len(e["branches"]) == 1 for e in run["evaluations"])
    assert torch.allclose(split, baseline, atol=1e-5)  # batching itself may change float rounding
    assert torch.equal(split, env.tiny.sample(env.case, steps=STEPS, cfg=3.0))  # same split path without the node
    env.tiny.sample(env.case, model=env.apply(1.0), steps=STEPS, cfg=3.0)
    run = env.last_run()
    assert set(run["summary"]["branches"]) == {"cond", "uncond"}
    assert run["summary"]["branches"]["cond"]["reused"] > 0


def test_several_cond_entries_get_their_own_branches(env):
    import dataclasses
    extra = [[env.case.positive[0][0] * 0.5, dict(env.case.positive[0][1])]]
    case = dataclasses.replace(env.case, positive=env.case.positive + extra)
    baseline = env.tiny.sample(case, steps=STEPS, cfg=3.0)
    assert torch.equal(env.tiny.sample(case, model=env.apply(0.0), steps=STEPS, cfg=3.0), baseline)
    assert set(env.last_run()["summary"]["branches"]) == {"cond", "cond.1", "uncond"}


def test_a_resolution_change_between_runs_of_one_patched_model(env):
    import dataclasses
    patched = env.apply(1.0)
    first = env.tiny.sample(env.case, model=patched, steps=STEPS, cfg=3.0)
    small = dataclasses.replace(env.case, latent=torch.zeros(1, 16, 2, 4, 4))
    second = env.tiny.sample(small, model=patched, steps=STEPS, cfg=3.0)
    assert second.shape == small.latent.shape and torch.isfinite(second).all()
    assert env.last_run()["evaluations"][0]["branches"][0]["reason"] == "first"  # fresh state, no stale residual
    assert torch.equal(env.tiny.sample(env.case, model=patched, steps=STEPS, cfg=3.0), first)
