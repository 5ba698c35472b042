"""The nodes under mechanisms of ComfyUI 0.35-0.39, reproduced on the host under test by the stand-ins of
``omnitest.newer_comfy`` (built from those releases' source, as docs/compatibility.md lists it).

* The model compiler (0.35): a cached run leaves it out for its own run, before its first call, and puts it back
  after, also after an error or an interrupt; it says so in the run's notes; the user's ``--disable-comfy-compiler``
  is left as it is; runs without a cache compile as before. Without that, the compiler's recorded pattern breaks
  (the stand-in raises as ``--assert-graph-breaks`` makes the real one raise).
* BlockSparseAttention (0.35): Sequence Parallel on the same MODEL is refused in one clear error naming both, before
  anything reaches another rank, whichever node comes first (tests/host/sequence_parallel/test_sp_features_host.py);
  the caches compose with it (they leave attention alone).
* Fast pins (0.37): per-model fast disk is a matter of dynamic VRAM's pins, where CPU Offload stands aside as on 0.33;
  on ComfyUI's legacy path, a model marked fast-disk, CPU Offload places the blocks as before, bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from omnitest.cache_nodes import apply_magcache, apply_teacache, save_identity_calibrations
from omnitest.comfy_path import requires_comfy_class
from omnitest.newer_comfy import block_sparse_attention_035, fast_pins_037, model_compiler_035

pytestmark = pytest.mark.host
# the compiler came into comfy/model_prefetch.py, which ComfyUI 0.33 has and 0.3.x had not
PREFETCH = requires_comfy_class("comfy.model_prefetch", "make_prefetch_queue")

STEPS = 8
IDENTITY = "newer-comfy-identity"
CACHES = {"teacache": lambda model: apply_teacache(model, IDENTITY, threshold=5.0),
          "magcache": lambda model: apply_magcache(model, IDENTITY, threshold=1.0)}


@pytest.fixture(scope="module")
def env(user_dir):
    from omnitest import tiny_models
    from omnitest.pack import pack_module

    save_identity_calibrations(IDENTITY, STEPS)

    class Env:
        tiny = tiny_models
        stats = pack_module("nodes.stats_store")
        compiler = pack_module("nodes.caches.compiler")

    return Env


@pytest.fixture(scope="module")
def wan(env):
    return env.tiny.build_case("wan21_t2v")


def compiler(wan, **kwargs):
    return model_compiler_035(wan.patcher.model, wan.diffusion_model.blocks, **kwargs)


def last_summary(env) -> dict:
    return env.stats.recent_runs(1)[0]["summary"]


@pytest.mark.parametrize("cache", list(CACHES))
@PREFETCH
def test_a_cached_run_leaves_the_model_compiler_out_for_itself_and_says_so(env, wan, cache):
    import comfy.cli_args

    blocks = len(wan.diffusion_model.blocks)
    reference = env.tiny.sample(wan, model=CACHES[cache](wan.patcher), steps=STEPS)
    with compiler(wan, assert_graph_breaks=True) as record:
        plain = env.tiny.sample(wan, steps=STEPS)  # no node of ours: every call compiled, one pattern
        assert len(record.regions) == STEPS and record.breaks == 0
        record.regions.clear()
        got = env.tiny.sample(wan, model=CACHES[cache](wan.patcher), steps=STEPS)
        assert record.regions == []
        assert comfy.cli_args.args.disable_comfy_compiler is False  # put back
        summary = last_summary(env)
        assert summary["reused"] > 0 and env.compiler.NOTE in summary["notes"]
        assert torch.equal(env.tiny.sample(wan, steps=STEPS), plain) and len(record.regions) == STEPS
        assert record.breaks == 0 and all(len(region) == blocks + 1 for region in record.regions)
    assert torch.equal(got, reference)  # the compiler's switch changes nothing else


@PREFETCH
def test_without_leaving_it_out_the_compilers_pattern_breaks(env, wan, monkeypatch):
    """What the stand-in reproduces: a cache under the compiler changes the recorded allocation pattern (its first
    steps compute what later steps reuse, its skipped steps run no block's ops)."""
    monkeypatch.setattr(env.compiler.CompilerLeftOut, "leave_out", lambda self, device: None)
    with compiler(wan, assert_graph_breaks=True) as record:
        with pytest.raises(RuntimeError, match="aimdo memory compile error"):
            env.tiny.sample(wan, model=CACHES["teacache"](wan.patcher), steps=STEPS)
    assert record.breaks == 1 and record.regions[-1] != record.regions[0]


@PREFETCH
def test_the_users_own_disable_comfy_compiler_is_left_as_it_is(env, wan):
    import comfy.cli_args

    with compiler(wan) as record:
        comfy.cli_args.args.disable_comfy_compiler = True
        env.tiny.sample(wan, model=CACHES["magcache"](wan.patcher), steps=STEPS)
        assert comfy.cli_args.args.disable_comfy_compiler is True and record.regions == []
        assert env.compiler.NOTE not in last_summary(env)["notes"]


@PREFETCH
def test_the_compiler_is_put_back_after_an_interrupted_run(env, wan):
    import comfy.cli_args
    import comfy.model_management

    def interrupt(step, *_):
        if step == 2:
            raise comfy.model_management.InterruptProcessingException()

    with compiler(wan) as record:
        with pytest.raises(comfy.model_management.InterruptProcessingException):
            env.tiny.sample(wan, model=CACHES["teacache"](wan.patcher), steps=STEPS, callback=interrupt)
        assert comfy.cli_args.args.disable_comfy_compiler is False and record.regions == []
        env.tiny.sample(wan, steps=2)
        assert len(record.regions) == 2 and record.breaks == 0


@pytest.mark.parametrize("cache", list(CACHES))
def test_a_cache_composes_with_block_sparse_attention(env, wan, cache):
    sparse, record = block_sparse_attention_035(wan.patcher)
    reference = env.tiny.sample(wan, model=CACHES[cache](wan.patcher), steps=STEPS)
    got = env.tiny.sample(wan, model=CACHES[cache](sparse), steps=STEPS)
    assert record.calls > 0 and last_summary(env)["reused"] > 0
    assert torch.equal(got, reference)  # the stand-in's attention is the host's own: the same latent


@PREFETCH
def test_a_compiler_the_switch_does_not_turn_off_makes_the_cache_compute_every_step_and_say_why(env, wan):
    """What the pack relies on, checked at every run: where the switch does not turn the compiler off (a later ComfyUI
    changed it), nothing is skipped under the compiler."""
    import comfy.model_prefetch

    with compiler(wan) as record:  # puts back (here: removes) what it and the line below set
        comfy.model_prefetch.malloc_graph_enabled = lambda device: True
        got = env.tiny.sample(wan, model=CACHES["teacache"](wan.patcher), steps=STEPS)
        summary = last_summary(env)
    assert summary["reused"] == 0 and summary["computed"] == STEPS and len(record.regions) == STEPS
    assert any("did not turn it off" in w for w in summary["warnings"]), summary["warnings"]
    assert torch.equal(got, env.tiny.sample(wan, steps=STEPS))


@requires_comfy_class("comfy.model_management", "pin_memory")  # the static pinning path, from ComfyUI 0.3.75
def test_cpu_offload_on_a_fast_disk_model_keeps_its_placement_rules(env, wan, monkeypatch):
    from omnitest.pack import pack_module, run_node

    host = pack_module("nodes.offload.host")
    monkeypatch.setattr(host, "offload_target", lambda patcher: torch.device("cpu"))  # the real path, on the CPU
    node = pack_module("nodes.offload.node").CPUOffload

    def offloaded():
        model = run_node(node, node_id="20", model=wan.patcher, blocks_to_offload=1, prefetch_blocks=1,
                         pin_memory="auto", vram_budget_gb=0.0)[0]
        latent = env.tiny.sample(wan, model=model, steps=STEPS)
        (card,) = env.stats.recent_runs(1)[0]["features"]
        return latent, card["summary"]

    reference, as_before = offloaded()
    with fast_pins_037(wan.patcher):
        got, summary = offloaded()
    assert as_before["active"] and as_before["bytes_moved"] > 0
    assert (summary["active"], summary["blocks"], summary["bytes_moved"]) == (
        as_before["active"], as_before["blocks"], as_before["bytes_moved"])
    assert torch.equal(got, reference) and torch.equal(got, env.tiny.sample(wan, steps=STEPS))
