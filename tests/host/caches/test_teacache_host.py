"""Apply TeaCache inside a real ComfyUI (in-process): bit-identical at threshold 0, monotone, branches, lifecycle."""
from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.host

STEPS = 12


IDENTITY = "tiny-identity"


@pytest.fixture(scope="module")
def env(user_dir):
    from omnitest import tiny_models
    from omnitest.pack import pack_module, run_node

    node_module = pack_module("nodes.caches.teacache")
    files = pack_module("nodes.caches.calibration_files")
    # Published polynomials are fitted on real weights; on random tiny weights they explode. The identity
    # polynomial makes the decision the raw relative L1 change, which a threshold sweep can exercise.
    files.save("teacache", IDENTITY, {"coefficients": [0, 0, 0, 1, 0], "family": "wan", "signal": "default"})

    class Env:
        tiny = tiny_models
        teacache = node_module

        @staticmethod
        def apply(model, rel_l1_thresh=0.0, variant="calibration: " + IDENTITY, start=0.0, end=1.0,
                  device="compute device"):
            return run_node(node_module.ApplyTeaCache, model=model, rel_l1_thresh=rel_l1_thresh,
                            start_percent=start, end_percent=end, cache_device=device, model_variant=variant)[0]

    yield Env


@pytest.fixture(scope="module")
def wan(env):
    return env.tiny.build_case("wan21_t2v")


def last_run(env):
    from omnitest.pack import pack_module
    return pack_module("nodes.stats_store").recent_runs(1)[0]


def module_fingerprint(dm: torch.nn.Module):
    return {name: sorted(m.__dict__) for name, m in dm.named_modules()}


def test_threshold_zero_is_bit_identical_to_no_node_and_computes_everything(env, wan):
    baseline = env.tiny.sample(wan, steps=STEPS)
    patched = env.apply(wan.patcher, rel_l1_thresh=0.0, variant="wan2.1_t2v_1.3B")
    out = env.tiny.sample(wan, model=patched, steps=STEPS)
    assert torch.equal(out, baseline)
    summary = last_run(env)["summary"]
    assert summary["reused"] == 0 and summary["computed"] == STEPS
    assert any("threshold is 0" in w for w in summary["warnings"])


def test_original_model_untouched_and_module_restored(env, wan):
    dm = wan.patcher.model.diffusion_model
    baseline = env.tiny.sample(wan, steps=STEPS)
    before = module_fingerprint(dm)  # after a first run: ComfyUI's loader marks modules (comfy_patched_weights)
    patched = env.apply(wan.patcher, rel_l1_thresh=0.5)
    assert module_fingerprint(dm) == before  # execute itself touches nothing
    env.tiny.sample(wan, model=patched, steps=STEPS)
    assert module_fingerprint(dm) == before
    assert torch.equal(env.tiny.sample(wan, steps=STEPS), baseline)


def test_computed_steps_never_rise_with_the_threshold_first_and_last_computed(env, wan):
    counts = []
    for thresh in [0.0, 0.05, 0.2, 0.5, 1.0, 3.0]:
        env.tiny.sample(wan, model=env.apply(wan.patcher, rel_l1_thresh=thresh, variant="calibration: " + IDENTITY),
                        steps=STEPS)
        run = last_run(env)
        counts.append(run["summary"]["computed"])
        steps = [e for e in run["evaluations"]]
        assert steps[0]["computed"] and steps[-1]["computed"]
        assert steps[0]["step"] == 0 and steps[-1]["step"] == STEPS - 1
    assert counts == sorted(counts, reverse=True)
    assert counts[0] == STEPS and counts[-1] < STEPS


def test_cond_and_uncond_have_separate_branches(env, wan):
    env.tiny.sample(wan, model=env.apply(wan.patcher, rel_l1_thresh=0.3), steps=STEPS, cfg=3.0)
    run = last_run(env)
    assert set(run["summary"]["branches"]) == {"cond", "uncond"}
    env.tiny.sample(wan, model=env.apply(wan.patcher, rel_l1_thresh=0.3), steps=STEPS, cfg=1.0)
    assert set(last_run(env)["summary"]["branches"]) == {"cond"}


def test_state_is_new_for_every_run(env, wan):
    patched = env.apply(wan.patcher, rel_l1_thresh=1.0)
    first = env.tiny.sample(wan, model=patched, steps=STEPS)
    run1 = last_run(env)
    second = env.tiny.sample(wan, model=patched, steps=STEPS)
    run2 = last_run(env)
    assert torch.equal(first, second)
    assert run1["summary"]["reused"] > 0
    assert run1["summary"]["computed"] == run2["summary"]["computed"]
    assert run1["run_id"] != run2["run_id"]


def test_error_mid_run_removes_hooks(env, wan):
    import comfy.patcher_extension as pe

    dm = wan.patcher.model.diffusion_model
    before = module_fingerprint(dm)
    patched = env.apply(wan.patcher, rel_l1_thresh=0.3)
    calls = []

    def failing(executor, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("simulated interrupt")
        return executor(*args, **kwargs)

    patched.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "test.fail", failing)
    with pytest.raises(KeyboardInterrupt):
        env.tiny.sample(wan, model=patched, steps=STEPS)
    assert module_fingerprint(dm) == before


def test_two_teacache_nodes_on_one_model_is_a_clear_error(env, wan):
    once = env.apply(wan.patcher, rel_l1_thresh=0.3)
    with pytest.raises(Exception, match=r"Apply TeaCache.*already has Apply TeaCache \(node #7\)"):
        env.apply(once, rel_l1_thresh=0.3)


def test_unsupported_model_is_a_clear_error(env):
    import comfy.model_patcher

    class NotADiT(torch.nn.Module):
        pass

    class FakeBase(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.diffusion_model = NotADiT()

    patcher = comfy.model_patcher.ModelPatcher(FakeBase(), torch.device("cpu"), torch.device("cpu"))
    with pytest.raises(ValueError, match=r"Apply TeaCache: NotADiT .* Supported families"):
        env.apply(patcher)


def test_auto_on_an_unpublished_size_says_what_to_do(env, wan):
    with pytest.raises(ValueError, match="TeaCache Calibrate"):
        env.apply(wan.patcher, variant="auto")


def test_a_reused_step_is_its_block0_input_plus_the_cached_residual(env, wan):
    dm = wan.patcher.model.diffusion_model
    calls = []
    handles = [
        dm.blocks[0].register_forward_pre_hook(
            lambda m, args, kwargs: calls.append({"x0": args[0].clone()}), with_kwargs=True),
        dm.head.register_forward_pre_hook(lambda m, args: calls[-1].update(head_in=args[0].clone(), e=args[1])),
        dm.head.register_forward_hook(lambda m, args, out: calls[-1].update(out=out.clone())),
    ]
    try:
        env.tiny.sample(wan, model=env.apply(wan.patcher, rel_l1_thresh=1.0), steps=STEPS, cfg=3.0)
    finally:
        for h in handles:
            h.remove()
    computed = [e["computed"] for e in last_run(env)["evaluations"]]
    assert len(calls) == len(computed) and not all(computed)
    head_forward = type(dm.head).forward
    checked = 0
    for i in range(1, len(calls)):
        if computed[i]:
            continue
        last = max(j for j in range(i) if computed[j])
        residual = calls[last]["head_in"] - calls[last]["x0"]
        with torch.inference_mode():
            expected = head_forward(dm.head, calls[i]["x0"] + residual, calls[i]["e"])
        assert torch.equal(calls[i]["out"], expected)
        checked += 1
    assert checked > 0


def test_calibrate_writes_a_file_that_apply_teacache_offers_and_uses(env, wan):
    import json

    from omnitest.pack import pack_module, run_node

    calibrate = pack_module("nodes.caches.teacache").TeaCacheCalibrate
    files = pack_module("nodes.caches.calibration_files")
    latent = {"samples": wan.latent}
    out_latent, text = run_node(calibrate, model=wan.patcher, seed=0, steps=16, cfg=3.0, sampler_name="euler",
                                scheduler="simple", positive=wan.positive, negative=wan.negative,
                                latent_image=latent, name="tiny wan")
    data = json.loads(text)
    assert data["family"] == "wan" and len(data["coefficients"]) == 5 and data["points"] == 2 * 15
    assert "calibration: tiny wan" in env.teacache.TEACACHE.variant_options()
    assert files.load("teacache", "tiny wan")["coefficients"] == data["coefficients"]
    # every step was computed: the calibration run equals plain sampling
    assert torch.equal(out_latent["samples"], env.tiny.sample(wan, steps=16, cfg=3.0))
    reused = []
    for thresh in [0.1, 0.5, 2.0]:
        env.tiny.sample(wan, model=env.apply(wan.patcher, rel_l1_thresh=thresh, variant="calibration: tiny wan"),
                        steps=16, cfg=3.0)
        reused.append(last_run(env)["summary"]["reused"])
    assert reused == sorted(reused) and reused[-1] > 0
    # -1 uses the threshold the file recommends: about 1.8x fewer steps on the run it measured
    assert files.load("teacache", "tiny wan")["recommended_threshold"] == data["recommended_threshold"] > 0
    env.tiny.sample(wan, model=env.apply(wan.patcher, rel_l1_thresh=-1.0, variant="calibration: tiny wan"),
                    steps=16, cfg=3.0)
    summary = last_run(env)["summary"]
    assert summary["threshold"] == data["recommended_threshold"]
    assert math.ceil(16 / 1.8) <= summary["computed"] <= math.ceil(16 / 1.8) + 2, summary


def test_a_calibration_file_of_another_family_is_refused(env, wan):
    from omnitest.pack import pack_module

    pack_module("nodes.caches.calibration_files").save("teacache", "a flux one", {"family": "flux",
                                                                          "coefficients": [0, 0, 0, 1, 0]})
    with pytest.raises(ValueError, match="made on a flux model"):
        env.apply(wan.patcher, rel_l1_thresh=0.2, variant="calibration: a flux one")


def test_coefficients_on_a_signal_the_family_does_not_offer_are_refused_naming_the_node(env, wan):
    """TeaCache asks the family for the signal its coefficients were fitted on: a calibration file or a published
    entry whose signal the family does not offer is refused by the Apply node, by name, before any run."""
    import dataclasses

    from omnitest.pack import pack_module

    families = pack_module("nodes.families")
    detected = families.detect(wan.patcher)
    assert sorted(detected.family.signals) == ["default", "ret"]
    pack_module("nodes.caches.calibration_files").save("teacache", "a hidden one", {
        "family": "wan", "coefficients": [0, 0, 0, 1, 0], "signal": "hidden"})
    with pytest.raises(ValueError, match=r"^Apply TeaCache: calibration 'a hidden one' .* has signal 'hidden', which "
                                         r"wan models do not have \(one of \['default', 'ret'\]\)"):
        env.apply(wan.patcher, rel_l1_thresh=0.2, variant="calibration: a hidden one")
    # the same Wan, as a family that offers only its default signal: the retention-mode coefficients need "ret"
    lacking = dataclasses.replace(detected, family=dataclasses.replace(
        detected.family, signals={"default": detected.family.signals["default"]}))
    inputs = dict(rel_l1_thresh=0.2, start_percent=0.0, end_percent=1.0, cache_device="compute device",
                  model_variant="wan2.1_t2v_1.3B_ret_mode")
    with pytest.raises(ValueError, match=r"^Apply TeaCache: coefficients 'wan2.1_t2v_1.3B_ret_mode': wan \(.*\) does "
                                         r"not offer the signal 'ret' these coefficients were fitted on \(its family "
                                         r"offers default\)\. Choose another model_variant, or run TeaCache "
                                         r"Calibrate"):
        env.teacache.TEACACHE.config_for(wan.patcher, lacking, inputs)
    assert env.teacache.TEACACHE.config_for(wan.patcher, detected, inputs).signal == "ret"


def test_what_auto_chose_is_noted_in_the_run_statistics(env):
    flux = env.tiny.build_case("flux")
    env.tiny.sample(flux, model=env.apply(flux.patcher, rel_l1_thresh=0.0, variant="auto"), steps=4)
    notes = last_run(env)["summary"]["notes"]
    assert any("flux-kontext" in n for n in notes)
    env.tiny.sample(flux, model=env.apply(flux.patcher, rel_l1_thresh=0.0, variant="flux"), steps=4)
    notes = last_run(env)["summary"]["notes"]
    # chosen by the user: nothing to explain but what the few-step rule allows in a 4-step run
    assert [n for n in notes if not n.startswith("few-step run (4 steps)")] == [] and len(notes) == 1
