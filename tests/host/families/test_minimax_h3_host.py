"""MiniMax-H3 (ComfyUI 0.33) through the Calibrate nodes: no numbers are published for it, so 'auto' says to calibrate;
a TeaCache / MagCache calibration of the tiny model samples exactly as without the node (every call computed, cond
and uncond called one after the other at batch size 1), records both branches, and the Apply node then skips with it.
Every cache and offload contract runs on its tiny model through the family-parametrised host tests; on a ComfyUI
without the class every test here skips in one line naming the version."""
from __future__ import annotations

import json

import pytest
import torch

from omnitest.comfy_path import requires_comfy_class

pytestmark = [pytest.mark.host, requires_comfy_class("comfy.model_base", "MiniMaxH3")]

STEPS = 8


@pytest.fixture(scope="module")
def env(user_dir):
    from omnitest import tiny_models
    from omnitest.pack import pack_module

    class Env:
        tiny = tiny_models
        case = tiny_models.build_case("minimax_h3")
        teacache = pack_module("nodes.caches.teacache")
        magcache = pack_module("nodes.caches.magcache")
        files = pack_module("nodes.caches.calibration_files")

        @staticmethod
        def last_run():
            return pack_module("nodes.stats_store").recent_runs(1)[0]

    yield Env


def calibrate(env, node, name):
    from omnitest.pack import run_node

    case = env.case
    latent, text = run_node(node, model=case.patcher, seed=0, steps=STEPS, cfg=case.cfg, sampler_name="euler",
                            scheduler="simple", positive=case.positive, negative=case.negative,
                            latent_image={"samples": case.latent}, name=name)
    return env.tiny.packed_latent(latent["samples"]), json.loads(text)


def apply_teacache(env, threshold, variant):
    from omnitest.pack import run_node
    return run_node(env.teacache.ApplyTeaCache, model=env.case.patcher, rel_l1_thresh=threshold, start_percent=0.0,
                    end_percent=1.0, cache_device="compute device", model_variant=variant)[0]


def apply_magcache(env, threshold, curve):
    from omnitest.pack import run_node
    return run_node(env.magcache.ApplyMagCache, model=env.case.patcher, threshold=threshold, max_skip_steps=4,
                    retention_ratio=0.0, start_percent=0.0, end_percent=1.0, cache_device="compute device",
                    curve=curve)[0]


def test_auto_says_to_calibrate(env):
    with pytest.raises(ValueError, match=r"(?i)no TeaCache coefficients are published for MiniMax-H3: run "
                                         r"TeaCache Calibrate"):
        apply_teacache(env, -1.0, "auto")
    with pytest.raises(ValueError,
                       match=r"(?i)no MagCache curves are published for MiniMax-H3: run MagCache Calibrate"):
        apply_magcache(env, 0.1, "auto")


def test_teacache_calibrate_then_apply_skips(env):
    baseline = env.tiny.sample(env.case, steps=STEPS)
    out, data = calibrate(env, env.teacache.TeaCacheCalibrate, "tiny minimax")
    assert torch.equal(out, baseline)  # every call computed
    assert data["family"] == "minimax_h3" and len(data["coefficients"]) == 5 and data["points"] == 2 * (STEPS - 1)
    assert "calibration: tiny minimax" in env.teacache.TEACACHE.variant_options()
    reused = []
    for threshold in (0.0, 0.5, 3.0):
        env.tiny.sample(env.case, model=apply_teacache(env, threshold, "calibration: tiny minimax"), steps=STEPS)
        summary = env.last_run()["summary"]
        assert set(summary["branches"]) == {"cond", "uncond"}, summary
        reused.append(summary["reused"])
    assert reused[0] == 0 and reused == sorted(reused) and reused[-1] > 0, reused


def test_magcache_calibrate_then_apply_skips(env):
    baseline = env.tiny.sample(env.case, steps=STEPS)
    out, data = calibrate(env, env.magcache.MagCacheCalibrate, "tiny minimax mag")
    assert torch.equal(out, baseline)  # every call computed
    assert data["family"] == "minimax_h3" and data["calibrated_steps"] == STEPS
    assert set(data["mag_ratios"]) == {"cond", "uncond"}
    assert all(len(v) == STEPS for v in data["mag_ratios"].values())
    assert data["mag_ratios"]["cond"][0] == 1.0 and all(r > 0 for r in data["mag_ratios"]["uncond"])
    reused = []
    for threshold in (0.0, 0.5, 3.0):
        env.tiny.sample(env.case, model=apply_magcache(env, threshold, "calibration: tiny minimax mag"), steps=STEPS)
        reused.append(env.last_run()["summary"]["reused"])
    assert reused[0] == 0 and reused == sorted(reused) and reused[-1] > 0, reused


def test_first_frame_keyframe_rows_are_cached_with_the_sequence(env):
    """Image to video (MiniMaxH3ImageToVideo with a first frame): the encoded keyframe's rows pack between the text and
    the audio, pinned at the condition timestep, in the positive branch only, so the two branches' packed sequences
    differ in length. TeaCache at threshold 0 is bit-identical to no node, and a real threshold skips."""
    import dataclasses

    from omnitest.pack import run_node

    case = env.case
    g = torch.Generator().manual_seed(7)
    keyframes = [{"resolved_frame_index": 0, "latent": torch.randn(1, 24, 1, 4, 4, generator=g)}]
    positive = [[case.positive[0][0], {**case.positive[0][1], "minimax_keyframes": keyframes}]]
    i2v = dataclasses.replace(case, positive=positive)
    env.files.save("teacache", "tiny-identity-minimax", {"coefficients": [0, 0, 0, 1, 0], "family": "minimax_h3"})

    lengths = []
    head = i2v.diffusion_model.blocks[0]
    handle = head.register_forward_pre_hook(lambda module, args: lengths.append(args[0].shape[0]))
    try:
        baseline = env.tiny.sample(i2v, steps=STEPS)
    finally:
        handle.remove()
    assert not torch.equal(baseline, env.tiny.sample(case, steps=STEPS))  # the keyframe conditions the result
    # text, keyframe (1 x 2 x 2 patches), stereo audio, video (2 x 2 x 2 patches); the negative has no keyframe
    assert lengths[:2] == [8 + 4 + 2 * 8 + 8, 5 + 2 * 8 + 8]

    def apply(threshold):
        return run_node(env.teacache.ApplyTeaCache, model=case.patcher, rel_l1_thresh=threshold, start_percent=0.0,
                        end_percent=1.0, cache_device="compute device",
                        model_variant=env.files.option("tiny-identity-minimax"))[0]

    assert torch.equal(env.tiny.sample(i2v, model=apply(0.0), steps=STEPS), baseline)
    assert env.last_run()["summary"]["reused"] == 0
    out = env.tiny.sample(i2v, model=apply(1.0), steps=STEPS)
    assert env.last_run()["summary"]["reused"] > 0 and torch.isfinite(out).all()
