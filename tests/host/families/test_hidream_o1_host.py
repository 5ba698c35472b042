"""HiDream-O1 (ComfyUI 0.33) and the key/value cache the model keeps itself, inside a real ComfyUI (in-process).

The model's first call for a prompt runs the whole sequence and keeps the prompt's keys and values of every layer;
later calls run only the image tokens on them. These tests check what the family relies on, on the tiny model: a
call that fills that cache is never skipped (whatever the threshold), the kept keys and values after a cached or an
offloaded run are bit for bit those of a plain run, and both Calibrate nodes make a calibration their Apply node
skips with. On a ComfyUI without the class every test skips in one line naming the version.
"""
from __future__ import annotations

import json

import pytest
import torch

from omnitest.cache_nodes import apply_magcache, apply_teacache, save_identity_calibrations
from omnitest.pack import drift_report

pytestmark = pytest.mark.host

STEPS = 12  # more than the few-step rule's 8
IDENTITY = "hidream-o1-identity"


@pytest.fixture(scope="module")
def case(user_dir):
    from omnitest.tiny_models import build_case

    case = build_case("hidream_o1")
    save_identity_calibrations(IDENTITY, STEPS, family="hidream_o1")
    return case


def last_run():
    from omnitest.pack import pack_module

    return pack_module("nodes.stats_store").recent_runs(1)[0]


def kept_keys_and_values(dm) -> list[torch.Tensor]:
    """Every tensor of the model's key/value cache entries, in order."""
    return [t for entry in dm._kv_cache_entries for kv in entry["kv"] for t in kv]


def sample_cold(case, model=None, every_call=False):
    """Sample with the model's key/value cache empty at the start (``every_call``: before every call, so that every
    call fills it)."""
    import comfy.patcher_extension as pe

    dm = case.diffusion_model
    dm.clear_kv_cache()
    model = model or case.patcher
    if every_call:
        def cold(executor, *args, **kwargs):
            dm.clear_kv_cache()
            return executor(*args, **kwargs)

        model = model.clone()
        model.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "test.cold", cold)
    return case_sample(case, model)


def case_sample(case, model):
    from omnitest.tiny_models import sample

    return sample(case, model=model, steps=STEPS)


@pytest.mark.parametrize("apply", [apply_teacache, apply_magcache], ids=["teacache", "magcache"])
def test_a_call_that_fills_the_models_cache_is_never_skipped(case, apply):
    baseline = sample_cold(case, every_call=True)
    out = sample_cold(case, apply(case.patcher, IDENTITY, threshold=1e9), every_call=True)
    evaluations = last_run()["evaluations"]
    assert [e["computed"] for e in evaluations] == [True] * STEPS
    # after the first call ("first") and before the last step (TeaCache forces it): the reason is the model's cache
    reasons = {b["reason"] for e in evaluations[1:-1] for b in e["branches"]}
    assert reasons == {"model-cache"}, reasons
    assert any("the model filled its own key/value cache on every call" in w
               for w in last_run()["summary"]["warnings"])
    assert torch.equal(out, baseline)


@pytest.mark.parametrize("apply", [apply_teacache, apply_magcache], ids=["teacache", "magcache"])
def test_a_cached_run_keeps_the_keys_and_values_of_a_plain_run(case, apply):
    sample_cold(case)
    plain = [t.clone() for t in kept_keys_and_values(case.diffusion_model)]
    assert plain
    sample_cold(case, apply(case.patcher, IDENTITY, threshold=1e9))
    run = last_run()
    assert run["summary"]["reused"] > 0
    # the call after the filling one has another length: computed ("shape"); the residuals reused are its own
    assert [b["reason"] for b in run["evaluations"][1]["branches"]] == ["shape"] * 2
    kept = kept_keys_and_values(case.diffusion_model)
    assert len(kept) == len(plain) and all(torch.equal(a, b) for a, b in zip(kept, plain))


def test_offload_from_a_filling_call_on_is_bit_identical(case, monkeypatch):
    from omnitest.pack import pack_module, run_node

    node = pack_module("nodes.offload.node")
    baseline = sample_cold(case)
    plain = [t.clone() for t in kept_keys_and_values(case.diffusion_model)]
    # the real path, on the CPU
    monkeypatch.setattr(pack_module("nodes.offload.host"), "offload_target", lambda patcher: torch.device("cpu"))
    offloaded = run_node(node.CPUOffload, node_id="20", model=case.patcher, blocks_to_offload=-1, prefetch_blocks=1,
                         pin_memory="auto", vram_budget_gb=0.0)[0]
    assert torch.equal(sample_cold(case, offloaded), baseline)
    kept = kept_keys_and_values(case.diffusion_model)
    assert len(kept) == len(plain) and all(torch.equal(a, b) for a, b in zip(kept, plain))


@pytest.mark.parametrize("kind", ["teacache", "magcache"])
def test_calibrate_then_apply_skips(case, kind):
    from omnitest.pack import pack_module, run_node

    module = pack_module(f"nodes.caches.{kind}")
    calibrate = module.TeaCacheCalibrate if kind == "teacache" else module.MagCacheCalibrate
    case.diffusion_model.clear_kv_cache()
    out_latent, text = run_node(calibrate, model=case.patcher, seed=0, steps=STEPS, cfg=case.cfg,
                                sampler_name="euler", scheduler="simple", positive=case.positive,
                                negative=case.negative, latent_image={"samples": case.latent},
                                name=f"tiny hidream-o1 {kind}")
    data = json.loads(text)
    assert data["family"] == "hidream_o1"
    # every step was computed: the calibration run equals plain sampling
    assert torch.equal(out_latent["samples"], sample_cold(case))
    choice = f"calibration: tiny hidream-o1 {kind}"
    model = (apply_teacache(case.patcher, choice.split(": ", 1)[1], threshold=2.0) if kind == "teacache"
             else apply_magcache(case.patcher, choice.split(": ", 1)[1], threshold=2.0))
    sample_cold(case, model)
    assert last_run()["summary"]["reused"] > 0


def test_with_reference_images_a_cached_and_an_offloaded_run_equal_a_plain_run(case, monkeypatch):
    """HiDream-O1 Reference Images: the reference goes through the vision tower (resident) and into the sequence; the
    model refills its cache on (nearly) every call, here on every call, and nothing is skipped or changed."""
    import dataclasses

    from omnitest.pack import pack_module, run_node

    ref = torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(1))
    edit = dataclasses.replace(case, positive=[[c[0], {**c[1], "reference_latents": [ref]}] for c in case.positive],
                               negative=[[c[0], {**c[1], "reference_latents": [ref]}] for c in case.negative])
    baseline = sample_cold(edit, every_call=True)
    assert not torch.equal(baseline, sample_cold(case, every_call=True))  # the reference changes the image
    assert torch.equal(sample_cold(edit, apply_teacache(case.patcher, IDENTITY, threshold=1e9), every_call=True),
                       baseline)
    node = pack_module("nodes.offload.node")
    monkeypatch.setattr(pack_module("nodes.offload.host"), "offload_target", lambda patcher: torch.device("cpu"))
    offloaded = run_node(node.CPUOffload, node_id="20", model=case.patcher, blocks_to_offload=-1, prefetch_blocks=1,
                         pin_memory="auto", vram_budget_gb=0.0)[0]
    assert torch.equal(sample_cold(edit, offloaded, every_call=True), baseline)


def test_the_drift_check_reaches_the_layers_inside_the_language_model(case, monkeypatch):
    """The family reads the layers' x and past_key_value: a layer forward without past_key_value is drift."""
    assert drift_report(case.patcher, sequence_parallel=False).differences == []
    layer_cls = type(case.diffusion_model.language_model.layers[0])

    def forward(self, x, attention_mask=None, freqs_cis=None, optimized_attention=None):
        raise AssertionError("never called")

    monkeypatch.setattr(layer_cls, "forward", forward)
    found = [f.what for f in drift_report(case.patcher, sequence_parallel=False).differences]
    assert found and all("language_model.layers" in what and "past_key_value" in what for what in found), found
