"""A block ``forward`` another pack wrapped with a plain ``(self, *args, **kwargs)`` function, in one ComfyUI
process: a wrapper that passes its call through (with or without ``functools.wraps``, a closure or a module global,
one wrapper or two) keeps both caches skipping steps and both calibration nodes running; a wrapper that changes the
call is still caught: the cache computes every step and says which wrapper and what it changes, a calibration stops.
The wrappers are installed on ComfyUI's shared ``comfy.ldm.wan.model`` module (``omnitest.other_pack``) and removed
after each test."""
from __future__ import annotations

import json

import pytest
import torch

from omnitest.cache_nodes import apply_magcache, apply_teacache, save_identity_calibrations
from omnitest.pack import drift_report

pytestmark = pytest.mark.host

STEPS = 8
IDENTITY = "pass-through-identity"
PASS_THROUGH = ["plain", "wraps", "profiler", "stacked"]
CHANGES = {"drops_argument": "'transformer_options' is not passed on",
           "alters_argument": "positional argument 0 is not passed on as is",
           "changes_output": "it returns something other than what the function it wraps returned",
           "calls_twice": "it calls comfy.ldm.wan.model.WanAttentionBlock.forward 2 times for one call"}


@pytest.fixture(scope="module")
def env(user_dir):
    from omnitest import other_pack, tiny_models
    from omnitest.pack import pack_module

    save_identity_calibrations(IDENTITY, STEPS)

    class Env:
        tiny = tiny_models
        pack = other_pack
        drift = pack_module("nodes.families.drift")
        stats = pack_module("nodes.stats_store")
        teacache = pack_module("nodes.caches.teacache")
        magcache = pack_module("nodes.caches.magcache")

    return Env


@pytest.fixture(scope="module")
def wan(env):
    return env.tiny.build_case("wan21_t2v")


@pytest.fixture(autouse=True)
def original_forward_back():
    """Every test leaves ComfyUI's own ``WanAttentionBlock.forward`` in place."""
    import comfy.ldm.wan.model as wan_model

    original = wan_model.WanAttentionBlock.__dict__["forward"]
    yield
    assert wan_model.WanAttentionBlock.__dict__["forward"] is original


CACHES = {"teacache": lambda model: apply_teacache(model, IDENTITY, threshold=5.0),
          "magcache": lambda model: apply_magcache(model, IDENTITY, threshold=1.0)}


def calibrate(env, wan, node, name):
    from omnitest.pack import run_node

    return run_node(node, model=wan.patcher, seed=0, steps=STEPS, cfg=3.0, sampler_name="euler", scheduler="simple",
                    positive=wan.positive, negative=wan.negative, latent_image={"samples": wan.latent}, name=name)


@pytest.mark.parametrize("kind", PASS_THROUGH)
def test_a_pass_through_wrapper_passes_the_check(env, wan, kind):
    with env.pack.installed(kind):
        report = drift_report(wan.patcher, sequence_parallel=False)
    assert report.differences == [] and report.undecided == []


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("kind", PASS_THROUGH)
def test_a_cache_reuses_steps_on_blocks_another_pack_wrapped(env, wan, kind, cache):
    reference = env.tiny.sample(wan, model=CACHES[cache](wan.patcher), steps=STEPS)
    reused = env.stats.recent_runs(1)[0]["summary"]["reused"]
    assert reused > 0  # this threshold skips steps on the unwrapped model
    with env.pack.installed(kind):
        got = env.tiny.sample(wan, model=CACHES[cache](wan.patcher), steps=STEPS)
        wrapper_ran = env.pack.CALLS["count"]
    entry = env.stats.recent_runs(1)[0]
    assert entry["status"] == "success" and entry["summary"]["reused"] == reused
    assert not [w for w in entry["summary"]["warnings"] if "could not be fully checked" in w]
    assert torch.equal(got, reference)
    assert 0 < wrapper_ran < STEPS * 2 * len(wan.patcher.model.diffusion_model.blocks)  # ran, and less than all


@pytest.mark.parametrize("kind", ["plain", "wraps"])
def test_both_calibration_nodes_run_on_blocks_another_pack_wrapped(env, wan, kind):
    plain = env.tiny.sample(wan, steps=STEPS, cfg=3.0)
    with env.pack.installed(kind):
        latent, text = calibrate(env, wan, env.teacache.TeaCacheCalibrate, f"wrapped {kind}")
        assert json.loads(text)["family"] == "wan" and torch.equal(latent["samples"], plain)
        latent, text = calibrate(env, wan, env.magcache.MagCacheCalibrate, f"wrapped {kind} mag")
        assert json.loads(text)["calibrated_steps"] == STEPS and torch.equal(latent["samples"], plain)
        assert env.pack.CALLS["count"] > 0


@pytest.mark.parametrize("kind", list(CHANGES))
def test_a_wrapper_that_changes_the_call_is_named_with_what_it_changes(env, wan, kind):
    with env.pack.installed(kind):
        report = drift_report(wan.patcher, sequence_parallel=False)
    assert report.differences == []
    (finding,) = [f.what for f in report.undecided]
    assert finding.startswith("blocks.* (WanAttentionBlock.forward) takes *args and **kwargs, which OmniHooks does "
                              "not know: what its calls pass cannot be checked (omnitest.other_pack."), finding
    assert CHANGES[kind] in finding, finding


def test_a_wrapper_that_changes_the_call_makes_the_cache_compute_every_step_and_a_calibration_stop(env, wan):
    with env.pack.installed("drops_argument"):
        baseline = env.tiny.sample(wan, steps=STEPS)
        got = env.tiny.sample(wan, model=CACHES["teacache"](wan.patcher), steps=STEPS)
        summary = env.stats.recent_runs(1)[0]["summary"]
        with pytest.raises(env.drift.ModelDriftError,
                           match=r"^TeaCache Calibrate \(node #7\): cannot calibrate, the model could not be fully "
                                 r"checked before the run: .*_drops_argument"):
            calibrate(env, wan, env.teacache.TeaCacheCalibrate, "never written")
    assert torch.equal(got, baseline)
    assert summary["reused"] == 0 and summary["computed"] == STEPS
    (warning,) = [w for w in summary["warnings"] if w.startswith("nothing was reused")]
    assert "_drops_argument.<locals>.forward: it changes the call to comfy.ldm.wan.model.WanAttentionBlock.forward: " \
           "'transformer_options' is not passed on" in warning


def test_what_cannot_be_followed_is_said(env):
    """The probe's own answers on toy forwards: a callable object, a forward reached only through an attribute."""
    from omnitest.pack import pack_module

    follow = pack_module("nodes.families.pass_through").follow
    call = ((torch.zeros(1),), {"transformer_options": {}})
    always_opaque = lambda f: True  # noqa: E731

    class Block(torch.nn.Module):
        def forward(self, x, transformer_options={}):
            return x

    original = Block.forward

    class Forwarder:
        def __call__(self, *args, **kwargs):
            return original(*args, **kwargs)

    followed = follow(Forwarder(), Block(), always_opaque, call)
    assert followed.wrappers == () and "not a Python function" in followed.problem

    def by_attribute(self, *args, **kwargs):
        return type(self).kept(self, *args, **kwargs)

    followed = follow(by_attribute, Block(), always_opaque, call)
    assert followed.function is by_attribute and followed.problem == "it calls no function that could be followed"

    def passes(self, *args, **kwargs):
        return original(self, *args, **kwargs)

    followed = follow(passes, Block(), lambda f: f is not original, call)
    assert followed.function is original and followed.problem is None and followed.wrappers[0].endswith(".passes")


NEVER_SKIP = {"teacache": lambda model: apply_teacache(model, IDENTITY, threshold=0.0),
              "magcache": lambda model: apply_magcache(model, IDENTITY, threshold=0.0)}


@pytest.mark.parametrize("cache", list(NEVER_SKIP))
def test_a_cache_that_skips_nothing_calls_each_block_once_per_step(env, wan, cache):
    """Block calls counted as a benchmark counts them, by a wrapper around ``WanAttentionBlock.forward``: a cache that
    skips nothing gives exactly one call per block and step, as the model without it does. The drift check probes a
    new wrapper once per process (its statements run, recorders stand in for the model's code: one count, nothing
    computed); every later run reads the answer and adds no call."""
    steps = 30
    blocks = len(wan.patcher.model.diffusion_model.blocks)
    model = NEVER_SKIP[cache](wan.patcher)
    with env.pack.installed("plain"):
        env.tiny.sample(wan, steps=steps)
        assert env.pack.CALLS["count"] == steps * blocks  # cond and uncond in one batch
        env.pack.CALLS["count"] = 0
        env.tiny.sample(wan, model=model, steps=steps)
        first = env.pack.CALLS["count"]
        for _ in range(2):
            env.pack.CALLS["count"] = 0
            env.tiny.sample(wan, model=model, steps=steps)
            assert env.pack.CALLS["count"] == steps * blocks
    summary = env.stats.recent_runs(1)[0]["summary"]
    assert (summary["computed"], summary["reused"]) == (steps, 0)
    assert first == steps * blocks + 1  # the probe, once
