"""The cache nodes check what they are given before sampling and name themselves.

Each test fails without its fix: a re-made calibration file re-executes its Apply node (fingerprint), the variant
list offers only files a model can use, non-finite tuning values are refused at execute naming the node and input,
a linked calibration name is re-checked at execute naming the node, an unwritable calibration folder fails before
any sampling, and a non-finite fit is refused naming the node while the previous file stays."""
from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.host


@pytest.fixture(scope="module")
def env(user_dir):
    from omnitest import tiny_models
    from omnitest.pack import pack_module, run_node

    class Env:
        tiny = tiny_models
        case = tiny_models.build_case("wan21_t2v")
        files = pack_module("nodes.caches.calibration_files")
        caches = pack_module("nodes.caches.base")
        teacache = pack_module("nodes.caches.teacache")
        magcache = pack_module("nodes.caches.magcache")
        run = staticmethod(run_node)
        user = user_dir

        @staticmethod
        def calibrate(node, name, cfg=3.0, steps=8):
            latent = {"samples": Env.case.latent}
            return run_node(node, model=Env.case.patcher, seed=0, steps=steps, cfg=cfg, sampler_name="euler",
                            scheduler="simple", positive=Env.case.positive, negative=Env.case.negative,
                            latent_image=latent, name=name)

    yield Env


def test_apply_nodes_fingerprint_the_calibration_file_they_use(env):
    env.files.save("teacache", "refit", {"family": "wan", "coefficients": [0, 0, 0, 1, 0]})
    node = env.teacache.ApplyTeaCache
    before = node.fingerprint_inputs(model_variant="calibration: refit", rel_l1_thresh=0.1)
    assert before == node.fingerprint_inputs(model_variant="calibration: refit", rel_l1_thresh=0.1)
    env.files.save("teacache", "refit", {"family": "wan", "coefficients": [0, 0, 0, 2, 0]})
    assert node.fingerprint_inputs(model_variant="calibration: refit", rel_l1_thresh=0.1) != before
    assert node.fingerprint_inputs(model_variant="auto") == ""
    env.files.save("magcache", "refit", {"family": "wan", "mag_ratios": [1.0, 0.9]})
    mag = env.magcache.ApplyMagCache
    first = mag.fingerprint_inputs(curve="calibration: refit")
    env.files.save("magcache", "refit", {"family": "wan", "mag_ratios": [1.0, 0.8]})
    assert mag.fingerprint_inputs(curve="calibration: refit") != first


def test_the_variant_lists_offer_only_files_the_cache_can_use(env):
    env.files.save("teacache", "usable", {"family": "wan", "coefficients": [0, 0, 0, 1, 0]})
    env.files.save("teacache", "three-coefficients", {"family": "wan", "coefficients": [0, 1, 0]})
    env.files.save("magcache", "empty-curve", {"family": "wan", "mag_ratios": []})
    tea = env.teacache.TEACACHE.variant_options()
    assert "calibration: usable" in tea and "calibration: three-coefficients" not in tea
    assert "calibration: empty-curve" not in env.magcache.MAGCACHE.variant_options()


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_tuning_values_are_refused_at_execute_naming_node_and_input(env, value):
    with pytest.raises(ValueError, match=r"^Apply TeaCache: rel_l1_thresh must be -1 \(recommended\) or a finite "
                                         r"number"):
        env.run(env.teacache.ApplyTeaCache, model=env.case.patcher, rel_l1_thresh=value, start_percent=0.0,
                end_percent=1.0, cache_device="compute device", model_variant="calibration: usable")
    with pytest.raises(ValueError, match=r"^Apply MagCache: threshold must be a finite number"):
        env.run(env.magcache.ApplyMagCache, model=env.case.patcher, threshold=value, max_skip_steps=2,
                retention_ratio=0.2, start_percent=0.0, end_percent=1.0, cache_device="compute device",
                curve="wan2.1_t2v_1.3B")


def test_a_linked_name_is_checked_at_execute_naming_the_node(env):
    node = env.teacache.TeaCacheCalibrate
    assert node.validate_inputs(name=None) is True  # a link: its value is not known at /prompt
    with pytest.raises(ValueError, match=r"^TeaCache Calibrate: calibration name must be text"):
        env.calibrate(node, None)


def test_an_unwritable_calibration_folder_fails_before_sampling(env, monkeypatch):
    folder = env.files.directory("magcache")
    folder.parent.mkdir(parents=True, exist_ok=True)
    backup = folder.with_name("magcache.kept")
    if folder.exists():
        folder.rename(backup)
    folder.write_text("not a folder")  # as root, permissions would not stop a write; a file in the way does
    sampled = []
    monkeypatch.setattr(env.caches, "sample_calibrating", lambda *a, **k: sampled.append(1))
    try:
        with pytest.raises(ValueError, match=r"^MagCache Calibrate: .*magcache"):
            env.calibrate(env.magcache.MagCacheCalibrate, "never-written")
        assert sampled == []
    finally:
        folder.unlink()
        if backup.exists():
            backup.rename(folder)


def test_a_non_finite_fit_is_refused_naming_the_node_and_the_previous_file_stays(env):
    good = env.files.save("teacache", "kept", {"family": "wan", "coefficients": [0, 0, 0, 1, 0]})
    before = good.read_text()
    with pytest.raises(ValueError, match=r"^TeaCache Calibrate: .*kept"):
        env.calibrate(env.teacache.TeaCacheCalibrate, "kept", cfg=math.nan)
    assert good.read_text() == before
    out_latent, _ = env.calibrate(env.teacache.TeaCacheCalibrate, "kept-fresh")
    assert torch.isfinite(out_latent["samples"]).all()
