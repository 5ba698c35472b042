"""Drift checked before a run, in one ComfyUI process: a model whose code changed under the pack (simulated by
replacing a block class's forward) stops the run with an error naming the node, the family, the ComfyUI version and
what differs, before any hook is installed; a forward whose parameters cannot be checked makes the cache compute every
step and say why; every family's tiny model passes the check on this host."""
from __future__ import annotations

import pytest
import torch

from omnitest.cache_nodes import apply_teacache, save_identity_calibrations
from omnitest.pack import drift_report

pytestmark = pytest.mark.host

STEPS = 8
IDENTITY = "drift-identity"


@pytest.fixture(scope="module")
def env(user_dir):
    from omnitest import tiny_models
    from omnitest.pack import pack_module

    save_identity_calibrations(IDENTITY, STEPS)

    class Env:
        tiny = tiny_models
        drift = pack_module("nodes.families.drift")
        caches = pack_module("nodes.caches.base")
        stats = pack_module("nodes.stats_store")

    return Env


@pytest.fixture(scope="module")
def wan(env):
    return env.tiny.build_case("wan21_t2v")


@pytest.fixture
def installs(env, monkeypatch):
    """Every cache session's ``install`` of the test, recorded (a drift error must come before the first)."""
    seen = []
    original = env.caches.CacheSession.install

    def install(self, diffusion_model):
        seen.append(self.feature.node_id)
        return original(self, diffusion_model)

    monkeypatch.setattr(env.caches.CacheSession, "install", install)
    return seen


def module_fingerprint(dm: torch.nn.Module):
    return {name: sorted(m.__dict__) for name, m in dm.named_modules()}


def test_a_block_that_gained_a_required_argument_stops_the_run_before_anything_is_installed(env, wan, installs,
                                                                                               monkeypatch):
    import comfyui_version
    from omnitest.drift_models import gain_required_argument

    dm = wan.patcher.model.diffusion_model
    baseline = env.tiny.sample(wan, steps=STEPS)
    before = module_fingerprint(dm)
    model = apply_teacache(wan.patcher, IDENTITY, threshold=5.0)
    gain_required_argument(monkeypatch)
    with pytest.raises(env.drift.ModelDriftError) as raised:
        env.tiny.sample(wan, model=model, steps=STEPS)
    message = str(raised.value)
    assert message.startswith("Apply TeaCache (node #21): ")
    assert "Wan 2.1/2.2" in message and f"ComfyUI {comfyui_version.__version__}" in message
    assert "blocks.* (WanAttentionBlock.forward) gained a required parameter 'gate'" in message
    assert installs == []
    monkeypatch.undo()
    assert module_fingerprint(dm) == before
    assert torch.equal(env.tiny.sample(wan, steps=STEPS), baseline)


def test_a_block_that_lost_a_parameter_the_pack_reads_is_named(env, wan, installs, monkeypatch):
    import comfy.ldm.wan.model as wan_model

    original = wan_model.WanAttentionBlock.forward

    def forward(self, x, e, rope, context, context_img_len=257, transformer_options={}):  # freqs renamed
        return original(self, x, e, rope, context, context_img_len, transformer_options)

    monkeypatch.setattr(wan_model.WanAttentionBlock, "forward", forward)
    with pytest.raises(env.drift.ModelDriftError, match=r"has no parameter 'freqs' any more") as raised:
        env.tiny.sample(wan, model=apply_teacache(wan.patcher, IDENTITY), steps=STEPS)
    assert "gained a required parameter 'rope'" in str(raised.value)
    assert installs == []


def test_a_model_call_that_gained_a_required_argument_is_named(env, wan, installs, monkeypatch):
    import comfy.ldm.wan.model as wan_model

    original = wan_model.WanModel.forward

    def forward(self, x, timestep, context, audio, clip_fea=None, time_dim_concat=None, transformer_options={},
                **kwargs):
        return original(self, x, timestep, context, clip_fea, time_dim_concat, transformer_options, **kwargs)

    monkeypatch.setattr(wan_model.WanModel, "forward", forward)
    with pytest.raises(env.drift.ModelDriftError,
                       match=r"the model call \(WanModel.forward\) gained a required parameter 'audio'"):
        env.tiny.sample(wan, model=apply_teacache(wan.patcher, IDENTITY), steps=STEPS)
    assert installs == []


def test_a_block_whose_parameters_cannot_be_checked_makes_the_cache_compute_every_step_and_say_why(
        env, wan, installs, monkeypatch):
    from omnitest.drift_models import take_any_arguments

    env.tiny.sample(wan, model=apply_teacache(wan.patcher, IDENTITY, threshold=5.0), steps=STEPS)
    assert env.stats.recent_runs(1)[0]["summary"]["reused"] > 0  # this threshold skips steps on a checked model
    baseline = env.tiny.sample(wan, steps=STEPS)
    installs.clear()
    take_any_arguments(monkeypatch)
    got = env.tiny.sample(wan, model=apply_teacache(wan.patcher, IDENTITY, threshold=5.0), steps=STEPS)
    assert torch.equal(got, baseline)
    entry = env.stats.recent_runs(1)[0]
    assert entry["status"] == "success"
    summary = entry["summary"]
    assert summary["reused"] == 0 and summary["computed"] == summary["evaluations"] == STEPS
    reasons = {b["reason"] for e in entry["evaluations"] for b in e["branches"]}
    assert reasons == {"disabled"}
    (warning,) = [w for w in summary["warnings"] if w.startswith("nothing was reused")]
    assert "caching was disabled for this run" in warning
    assert "WanAttentionBlock.forward) takes *args" in warning and "**kwargs" in warning


def test_a_calibration_on_a_model_that_cannot_be_checked_stops_before_sampling(env, wan, installs, monkeypatch):
    from omnitest.drift_models import take_any_arguments
    from omnitest.pack import pack_module, run_node

    take_any_arguments(monkeypatch)
    calibrate = pack_module("nodes.caches.teacache").TeaCacheCalibrate
    with pytest.raises(env.drift.ModelDriftError, match=r"cannot calibrate, the model could not be fully checked"):
        run_node(calibrate, model=wan.patcher, seed=0, steps=STEPS, cfg=3.0, sampler_name="euler", scheduler="simple",
                 positive=wan.positive, negative=wan.negative, latent_image={"samples": wan.latent}, name="drifted")
    assert installs == []


@pytest.mark.parametrize("case_name", ["wan21_t2v", "wan21_i2v", "wan22_ti2v", "flux", "flux_kontext", "chroma",
                                       "hunyuan_video", "ltxv", "qwen_image", "lumina2", "hidream", "minimax_h3",
                                       "hidream_o1", "ltxav", "kandinsky5", "kandinsky5_image"])
def test_every_familys_model_passes_the_check_on_this_host(env, case_name):
    from omnitest.pack import pack_module

    case = env.tiny.build_case(case_name)
    family = pack_module("nodes.families").detect(case.patcher).family
    assert family.expects is not None
    report = drift_report(case.patcher, sequence_parallel=family.sequence_plan is not None)
    assert [f.what for f in report.differences] == [] and [f.what for f in report.undecided] == []


def test_a_plan_input_whose_type_changed_is_named(env, monkeypatch):
    """Wan's rotary table as a (real, imaginary) pair instead of one tensor: the plan's single spec no longer fits."""
    from omnitest.drift_models import rope_table_as_pair

    case = env.tiny.build_case("wan21_t2v")
    rope_table_as_pair(monkeypatch)
    report = drift_report(case.patcher, sequence_parallel=True)
    assert [f.what for f in report.differences] == [
        "'freqs' at 'blocks.*' is a tuple of 2, the plan has one spec for a tensor"]
    assert drift_report(case.patcher, sequence_parallel=False).differences == []


@pytest.mark.parametrize("case_name, drift, found", [
    ("ltxav", "compressed_timestep_by_another_name",
     ["'{}' at 'transformer_blocks.*' is a Renamed whose length the plan cannot read (AttributeError: 'Renamed' "
      "object has no attribute 'num_frames')".format(name)
      for name in ("v_timestep", "v_cross_scale_shift_timestep", "v_cross_gate_timestep")]),
    ("kandinsky5", "kandinsky5_rope_as_pair",
     ["'freqs' at 'visual_transformer_blocks.*' is a tuple of 2, the plan has one spec for a tensor"]),
])
def test_a_plan_input_of_ltx2_or_kandinsky5_that_changed_is_named(env, monkeypatch, case_name, drift, found):
    """ComfyUI 0.33's LTX-2 and Kandinsky 5: the plan's inputs checked like every family's, the host's own compressed
    timesteps by reading their length the way the plan does."""
    from omnitest import drift_models

    case = env.tiny.build_case(case_name)
    getattr(drift_models, drift)(monkeypatch)
    report = drift_report(case.patcher, sequence_parallel=True)
    assert [f.what for f in report.differences] == found
    assert drift_report(case.patcher, sequence_parallel=False).differences == []


def test_a_block_stack_that_moved_is_named(env):
    from omnitest.pack import pack_module

    case = env.tiny.build_case("wan21_t2v")
    dm = case.patcher.model.diffusion_model
    family = pack_module("nodes.families").family_named("wan")
    dm.layers = dm.blocks  # renamed upstream: the family's attribute is gone
    del dm.blocks
    assert [f.what for f in env.drift.check_model(family, dm).differences] == ["the block stack 'blocks' is missing"]
    dm.blocks = torch.nn.ModuleList()
    assert [f.what for f in env.drift.check_model(family, dm).differences] == ["the block stack 'blocks' is empty"]
