"""Apply MagCache and MagCache Calibrate inside a real ComfyUI (in-process), on every tiny model.

Per tiny model (at least one per registered family): threshold 0 is bit-identical to no node, K = 0 never skips, and
the number of skipped steps never rises as the threshold falls. Published curves were measured on real weights; the
sweeps use a flat curve (ratio 0.95 per step) so that the accumulated error, and with it the skip count, depends on
the threshold alone. On Wan: a skipped step is exactly its block-0 input plus the cached residual,
calibrate-then-apply, one cache per MODEL in both orders, and the Wan 2.2 two-expert rule (each sampler segment
counts its own steps).
"""
from __future__ import annotations

import pytest
import torch

from omnitest.tiny_models import CASE_FAMILY, CASES

pytestmark = pytest.mark.host

STEPS = 8
THRESHOLDS = [1.0, 0.3, 0.15, 0.06, 0.03, 0.0]   # falling


def flat_name(family: str) -> str:
    return f"tiny-flat-{family}"


@pytest.fixture(scope="module")
def env(user_dir):
    from omnitest import tiny_models
    from omnitest.pack import pack_module, run_node

    node_module = pack_module("nodes.caches.magcache")
    files = pack_module("nodes.caches.calibration_files")
    for family in sorted(set(CASE_FAMILY.values())):
        files.save("magcache", flat_name(family), {"family": family, "mag_ratios": [1.0] + [0.95] * (STEPS - 1)})

    class Env:
        tiny = tiny_models
        magcache = node_module
        calibration_files = files

        @staticmethod
        def apply(model, threshold=0.0, curve=None, family="wan", K=8, retention=0.0, start=0.0, end=1.0,
                  device="compute device", node_id="7"):
            curve = curve or files.option(flat_name(family))
            return run_node(node_module.ApplyMagCache, node_id=node_id, model=model, threshold=threshold,
                            max_skip_steps=K, retention_ratio=retention, start_percent=start, end_percent=end,
                            cache_device=device, curve=curve)[0]

        @staticmethod
        def last_run():
            return pack_module("nodes.stats_store").recent_runs(1)[0]

    yield Env


@pytest.fixture(scope="module", params=CASES)
def case(request, env):
    return env.tiny.build_case(request.param)


@pytest.fixture(scope="module")
def wan(env):
    return env.tiny.build_case("wan21_t2v")


def cfg_of(case) -> float:
    """CFG > 1 so that cond and uncond are batched into one call (guidance-distilled families too: it is allowed)."""
    return case.cfg if case.cfg > 1 else 2.5


def module_fingerprint(dm: torch.nn.Module):
    return {name: sorted(m.__dict__) for name, m in dm.named_modules()}


# -- every tiny model -------------------------------------------------------------------------------------------------

def test_threshold_zero_is_bit_identical_to_no_node(env, case):
    cfg = cfg_of(case)
    baseline = env.tiny.sample(case, steps=STEPS, cfg=cfg)
    family = case.family
    out = env.tiny.sample(case, model=env.apply(case.patcher, 0.0, family=family), steps=STEPS, cfg=cfg)
    assert torch.equal(out, baseline)
    run = env.last_run()
    summary = run["summary"]
    assert run["kind"] == "magcache"
    assert summary["computed"] == STEPS * case.calls_per_step and summary["reused"] == 0, summary
    assert set(summary["branches"]) == {"cond", "uncond"}, summary["branches"]
    assert [e["step"] for e in run["evaluations"]] == case.call_steps(STEPS)
    assert any("threshold is 0" in w for w in summary["warnings"])


def test_k_zero_never_skips(env, case):
    cfg = cfg_of(case)
    family = case.family
    baseline = env.tiny.sample(case, steps=STEPS, cfg=cfg)
    out = env.tiny.sample(case, model=env.apply(case.patcher, 1.0, family=family, K=0), steps=STEPS, cfg=cfg)
    summary = env.last_run()["summary"]
    assert summary["reused"] == 0 and summary["computed"] == STEPS * case.calls_per_step, summary
    assert any("(K)" in w for w in summary["warnings"]), summary["warnings"]
    assert torch.equal(out, baseline)


def test_skipped_steps_never_rise_as_the_threshold_falls(env, case):
    cfg = cfg_of(case)
    family = case.family
    dm = case.diffusion_model
    env.tiny.sample(case, steps=1, cfg=cfg)  # ComfyUI's loader marks modules on first load
    before = module_fingerprint(dm)
    reused = []
    for threshold in THRESHOLDS:
        env.tiny.sample(case, model=env.apply(case.patcher, threshold, family=family), steps=STEPS, cfg=cfg)
        run = env.last_run()
        assert [e["step"] for e in run["evaluations"]] == case.call_steps(STEPS), (threshold, run["evaluations"])
        assert run["evaluations"][0]["computed"]
        assert not any("cannot be cached" in w or "differs" in w for w in run["summary"]["warnings"]), run["summary"]
        reused.append(run["summary"]["reused"])
        assert module_fingerprint(dm) == before
    assert reused == sorted(reused, reverse=True), reused
    assert reused[0] > 0 and reused[-1] == 0, reused


# -- on Wan ------------------------------------------------------------------------------------------------------------

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
        env.tiny.sample(wan, model=env.apply(wan.patcher, 1.0, K=3), steps=STEPS, cfg=3.0)
    finally:
        for h in handles:
            h.remove()
    computed = [e["computed"] for e in env.last_run()["evaluations"]]
    assert len(calls) == len(computed) and not all(computed)
    head_forward = type(dm.head).forward
    checked = 0
    for i in range(1, len(calls)):
        if computed[i]:
            continue
        last = max(j for j in range(i) if computed[j])
        residual = calls[last]["head_in"] - calls[last]["x0"]  # both branches, batched: cond and uncond chunks
        with torch.inference_mode():
            expected = head_forward(dm.head, calls[i]["x0"] + residual, calls[i]["e"])
        assert torch.equal(calls[i]["out"], expected)  # the residual is added once, not once per block
        checked += 1
    assert checked > 0


def test_calibrate_writes_a_file_that_apply_magcache_offers_and_skips_with(env, wan):
    import json

    from omnitest.pack import pack_module, run_node

    calibrate = pack_module("nodes.caches.magcache").MagCacheCalibrate
    latent = {"samples": wan.latent}
    steps = 16
    out_latent, text = run_node(calibrate, model=wan.patcher, seed=0, steps=steps, cfg=3.0, sampler_name="euler",
                                scheduler="simple", positive=wan.positive, negative=wan.negative,
                                latent_image=latent, name="tiny wan mag")
    data = json.loads(text)
    assert data["kind"] == "magcache" and data["family"] == "wan" and data["calibrated_steps"] == steps
    assert set(data["mag_ratios"]) == {"cond", "uncond"}
    for key in ("mag_ratios", "std", "cos_dist"):
        assert all(len(v) == steps for v in data[key].values()), key
    assert data["mag_ratios"]["cond"][0] == 1.0 and data["std"]["cond"][0] == 0.0
    assert all(r > 0 for r in data["mag_ratios"]["cond"]) and all(s >= 0 for s in data["std"]["uncond"])
    assert all(0 <= c <= 2 for c in data["cos_dist"]["cond"])
    assert data["interleaved"][:4] == [data["mag_ratios"]["cond"][0], data["mag_ratios"]["uncond"][0],
                                       data["mag_ratios"]["cond"][1], data["mag_ratios"]["uncond"][1]]
    assert "calibration: tiny wan mag" in env.magcache.MAGCACHE.variant_options()
    assert env.calibration_files.load("magcache", "tiny wan mag")["mag_ratios"] == data["mag_ratios"]
    # every step was computed: the calibration run equals plain sampling
    assert torch.equal(out_latent["samples"], env.tiny.sample(wan, steps=steps, cfg=3.0))
    reused = []
    for threshold in [2.0, 0.5, 0.1, 0.0]:
        env.tiny.sample(wan, model=env.apply(wan.patcher, threshold, curve="calibration: tiny wan mag", K=4,
                                             retention=0.1), steps=steps, cfg=3.0)
        reused.append(env.last_run()["summary"]["reused"])
    assert reused == sorted(reused, reverse=True) and reused[0] > 0 and reused[-1] == 0, reused


def test_one_cache_per_model_in_both_orders(env, wan):
    from omnitest.pack import pack_module, run_node

    teacache = pack_module("nodes.caches.teacache").ApplyTeaCache
    pack_module("nodes.caches.calibration_files").save("teacache", "tiny-identity-wan",
                                                {"family": "wan", "coefficients": [0, 0, 0, 1, 0]})

    def apply_teacache(model, node_id):
        return run_node(teacache, node_id=node_id, model=model, rel_l1_thresh=0.3, start_percent=0.0,
                        end_percent=1.0, cache_device="compute device",
                        model_variant="calibration: tiny-identity-wan")[0]

    with pytest.raises(Exception, match=r"Apply MagCache \(node #8\): this MODEL already has Apply TeaCache "
                                        r"\(node #7\)"):
        env.apply(apply_teacache(wan.patcher, "7"), 0.1, node_id="8")
    with pytest.raises(Exception, match=r"Apply TeaCache \(node #8\): this MODEL already has Apply MagCache "
                                        r"\(node #7\)"):
        apply_teacache(env.apply(wan.patcher, 0.1, node_id="7"), "8")
    with pytest.raises(Exception, match=r"Apply MagCache \(node #8\): this MODEL already has Apply MagCache"):
        env.apply(env.apply(wan.patcher, 0.1, node_id="7"), 0.1, node_id="8")


def test_auto_without_a_published_curve_points_to_magcache_calibrate(env, wan):
    with pytest.raises(ValueError, match="no published MagCache curve fits wan.*MagCache Calibrate"):
        env.apply(wan.patcher, 0.1, curve="auto")
    from omnitest.pack import pack_module

    curves = pack_module("nodes.caches.magcache_curves")
    without_curves = [name for name in CASES if not curves.for_family(CASE_FAMILY[name])]
    assert without_curves  # e.g. LTX-Video, Lumina 2, HiDream
    for name in without_curves:
        case = env.tiny.build_case(name)
        with pytest.raises(ValueError, match="no MagCache curve is published for .*MagCache Calibrate"):
            env.apply(case.patcher, 0.1, curve="auto")


def test_auto_picks_the_published_curve(env):
    case = env.tiny.build_case("flux")
    patched = env.apply(case.patcher, 0.1, curve="auto")
    config = patched.model_options["transformer_options"]["omni_hooks.features"][0].config
    assert config.model_label.endswith(", flux") and tuple(config.mag_ratios["default"][:2]) == (1.0, 1.21094)


def test_auto_on_a_run_with_reference_latents_uses_flux_kontexts_curve(env):
    # Flux Kontext has Flux dev's weights; its runs carry reference latents (ReferenceLatent)
    for name, curve in (("flux_kontext", "flux_kontext_official"), ("flux", "flux")):
        case = env.tiny.build_case(name)
        patched = env.apply(case.patcher, 0.1, curve="auto")
        config = patched.model_options["transformer_options"]["omni_hooks.features"][0].config
        assert config.with_reference.model_label.endswith(", flux_kontext_official")
        env.tiny.sample(case, model=patched, steps=STEPS)
        assert env.last_run()["summary"]["model"].endswith(f", {curve}"), name


def test_a_curve_of_another_family_is_refused(env, wan):
    with pytest.raises(ValueError, match="'flux' is for flux models, but this MODEL is wan"):
        env.apply(wan.patcher, 0.1, curve="flux")
    with pytest.raises(ValueError, match="made on a flux model"):
        env.apply(wan.patcher, 0.1, curve="calibration: " + flat_name("flux"))


def test_a_malformed_calibration_file_is_a_clear_error(env, wan):
    env.calibration_files.save("magcache", "broken", {"family": "wan", "mag_ratios": ["x"]})
    with pytest.raises(ValueError, match="no valid 'mag_ratios'.*MagCache Calibrate again"):
        env.apply(wan.patcher, 0.1, curve="calibration: broken")


def test_wan22_experts_each_count_their_own_segment(env, wan):
    """KSamplerAdvanced-style split: each expert's sampler sees only its slice of the schedule and counts from 0."""
    import comfy.sample

    high = env.apply(wan.patcher, 0.5, curve="wan2.2_t2v_14B (high noise)", K=2, retention=0.2, node_id="1")
    low = env.apply(wan.patcher, 0.5, curve="wan2.2_t2v_14B (low noise)", K=2, retention=0.2, node_id="2")
    steps, switch = 12, 7
    with torch.inference_mode():
        noise = comfy.sample.prepare_noise(wan.latent, 0)
        mid = comfy.sample.sample(high, noise, steps, 3.0, "euler", "simple", wan.positive, wan.negative, wan.latent,
                                  start_step=0, last_step=switch, force_full_denoise=False, disable_pbar=True, seed=0)
        high_run = env.last_run()
        comfy.sample.sample(low, torch.zeros_like(noise), steps, 3.0, "euler", "simple", wan.positive, wan.negative,
                            mid, start_step=switch, last_step=steps, disable_noise=True, disable_pbar=True, seed=0)
        low_run = env.last_run()
    for run, n in ((high_run, switch), (low_run, steps - switch)):
        evaluations = run["evaluations"]
        assert [e["step"] for e in evaluations] == list(range(n))
        assert {e["total_steps"] for e in evaluations} == {n}
        retained = int(0.2 * n + 0.5)
        assert all(e["computed"] for e in evaluations[:retained])  # retention per phase, on the expert's own steps
        assert {b["reason"] for e in evaluations[:retained] for b in e["branches"]} <= {"retention", "first"}
    assert "(high noise)" in high_run["summary"]["model"] and "(low noise)" in low_run["summary"]["model"]


def test_every_input_has_a_tooltip_and_the_ids_are_namespaced(env):
    from omnitest.pack import pack_module

    calibrate = pack_module("nodes.caches.magcache").MagCacheCalibrate
    for node, node_id in ((env.magcache.ApplyMagCache, "OmniHooks.ApplyMagCache"),
                          (calibrate, "OmniHooks.MagCacheCalibrate")):
        schema = node.define_schema()
        assert schema.node_id == node_id
        assert all(i.tooltip for i in schema.inputs), [i.id for i in schema.inputs if not i.tooltip]
    import asyncio
    nodes = asyncio.run(pack_module("nodes.extension").OmniHooksExtension().get_node_list())
    assert env.magcache.ApplyMagCache in nodes and calibrate in nodes


def test_published_curves_and_the_wan22_expert_split(env):
    from omnitest.pack import pack_module

    curves = pack_module("nodes.caches.magcache_curves")
    for curve in curves.PUBLISHED.values():
        assert curve.source and all(len(v) == curve.calibrated_steps for _, v in curve.curves), curve.key
        assert all(v[0] == 1.0 for _, v in curve.curves), curve.key  # every curve starts with the 1.0 pad
    full = {raw.key: raw for raw in curves._RAW}
    for key, switch in curves.A14B_SWITCH_STEP.items():
        cond = full[key].values[0::2]
        dips = [t for t in range(1, len(cond) - 1) if cond[t] < min(cond[t - 1], cond[t + 1]) - 0.05]
        assert dips == [switch]  # the one sharp dip is the expert switch
        high, low = curves.PUBLISHED[f"{key} (high noise)"], curves.PUBLISHED[f"{key} (low noise)"]
        assert high.calibrated_steps + low.calibrated_steps == full[key].calibrated_steps == 40
        assert low.ratios["cond"][1:] == tuple(cond[switch + 1:])
        assert key not in curves.PUBLISHED  # only the per-expert parts are offered
    # tables published without their two 1.0 pads get them back
    assert curves.PUBLISHED["qwen_image_official"].calibrated_steps == 50
    # that every family's 'auto' curve is published under its family: tests/host/families/test_families_host.py
