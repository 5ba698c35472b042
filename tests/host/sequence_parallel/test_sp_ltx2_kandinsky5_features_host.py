"""LTX-2 and Kandinsky 5 (ComfyUI 0.33) through the Sequence Parallel node's session, in one ComfyUI process (rank 0)
and one local worker process (rank 1, gloo on CPU), with ComfyUI's KSampler: each cache on top and CPU Offload on top
(its real path, on the CPU as if it were a GPU) give what the same nodes give without Sequence Parallel, bit for bit
with Ulysses and within 1e-3 relative with ring, at cfg 1 and cfg > 1, the caches skipping the same steps on every
rank (LTX-2's deciding on video and audio together); the resolution changes between runs of the same group."""
from __future__ import annotations

import pytest
import torch

from omnitest.cache_nodes import apply_magcache, apply_teacache, save_identity_calibrations
from omnitest.sp_families import INPUT_VARIANTS, relative_error

pytestmark = pytest.mark.host

STEPS = 8
RING_RELATIVE = 1e-3
ONE_HEAD = {"ltxav": {"num_attention_heads": 1, "attention_head_dim": 64, "audio_num_attention_heads": 1,
                      "audio_attention_head_dim": 32},
            "kandinsky5": {"model_dim": 32}}
LAYERS = {"ltxav": "num_layers", "kandinsky5": "num_visual_blocks"}


@pytest.fixture(scope="module")
def env(user_dir):
    from omnitest import tiny_models
    from omnitest.pack import pack_module, run_node

    sp_node = pack_module("nodes.sequence_parallel.node")
    offload_node = pack_module("nodes.offload.node")
    group = pack_module("nodes.sequence_parallel.group")

    class Env:
        tiny = tiny_models
        offload_module = offload_node
        stats = pack_module("nodes.stats_store")

        @staticmethod
        def sequence_parallel(model, ring: bool):
            degrees = ("1", "2") if ring else ("2", "1")
            return run_node(sp_node.SequenceParallel, node_id="30", model=model, world_size=2,
                            ulysses_degree=degrees[0], ring_degree=degrees[1], devices="cpu,cpu", backend="gloo",
                            master_address="127.0.0.1", master_port=0, cfg_parallel=False)[0]

        @staticmethod
        def offload(model):
            return run_node(offload_node.CPUOffload, node_id="20", model=model, blocks_to_offload=2,
                            prefetch_blocks=1, pin_memory="auto", vram_budget_gb=0.0)[0]

    yield Env
    group.close_group()


def build(env, case_name: str, ring: bool):
    case = env.tiny.build_case(case_name, unet_overrides={**(ONE_HEAD[case_name] if ring else {}),
                                                          LAYERS[case_name]: 4})
    identity = f"sp-{case.family}-identity"
    save_identity_calibrations(identity, STEPS, family=case.family)
    return case, identity


def cached(kind: str, identity: str):
    if kind == "magcache":
        return lambda model: apply_magcache(model, identity, threshold=1.0)
    return lambda model: apply_teacache(model, identity, threshold=2.0)


def summary(env) -> dict:
    return env.stats.recent_runs(1)[0]["summary"]


def assert_same(got: torch.Tensor, alone: torch.Tensor, ring: bool) -> None:
    if ring:
        assert relative_error(got, alone) < RING_RELATIVE
    else:
        assert torch.equal(got, alone), relative_error(got, alone)


@pytest.mark.parametrize("cfg", [1.0, None])
@pytest.mark.parametrize("ring", [False, True], ids=["ulysses", "ring"])
@pytest.mark.parametrize("cache", ["teacache", "magcache"])
@pytest.mark.parametrize("case_name", ["ltxav", "kandinsky5"])
def test_a_cache_on_top_skips_the_same_steps_and_gives_the_same_latent(env, case_name, cache, ring, cfg):
    case, identity = build(env, case_name, ring)
    apply = cached(cache, identity)
    alone = env.tiny.sample(case, model=apply(case.patcher), steps=STEPS, cfg=cfg)
    alone_summary = summary(env)
    got = env.tiny.sample(case, model=apply(env.sequence_parallel(case.patcher, ring)), steps=STEPS, cfg=cfg)
    entry = env.stats.recent_runs(1)[0]
    assert entry["status"] == "success" and entry["world_size"] == 2
    assert alone_summary["reused"] > 0
    assert (entry["summary"]["reused"], entry["summary"]["computed"]) == (alone_summary["reused"],
                                                                          alone_summary["computed"])
    assert_same(got, alone, ring)


@pytest.mark.parametrize("cfg", [1.0, None])
@pytest.mark.parametrize("ring", [False, True], ids=["ulysses", "ring"])
@pytest.mark.parametrize("case_name", ["ltxav", "kandinsky5"])
def test_cpu_offload_on_top_gives_the_same_latent(env, monkeypatch, case_name, ring, cfg):
    """Rank 0's offload runs its real path on the CPU (as if it were a GPU): its offloaded blocks hold placeholders
    during the run; with TeaCache too, a skipped step moves no weights."""
    case, identity = build(env, case_name, ring)
    monkeypatch.setattr(env.offload_module, "offload_target", lambda patcher: torch.device("cpu"))
    alone = env.tiny.sample(case, model=env.offload(case.patcher), steps=STEPS, cfg=cfg)
    got = env.tiny.sample(case, model=env.offload(env.sequence_parallel(case.patcher, ring)), steps=STEPS, cfg=cfg)
    assert_same(got, alone, ring)
    kinds = {f["kind"]: f["summary"] for f in env.stats.recent_runs(1)[0]["features"]}
    assert set(kinds) == {"sequence_parallel", "offload"} and kinds["offload"]["bytes_moved"] > 0
    teacache = cached("teacache", identity)
    alone = env.tiny.sample(case, model=env.offload(teacache(case.patcher)), steps=STEPS, cfg=cfg)
    got = env.tiny.sample(case, model=teacache(env.offload(env.sequence_parallel(case.patcher, ring))), steps=STEPS,
                          cfg=cfg)
    assert_same(got, alone, ring)
    entry = env.stats.recent_runs(1)[0]
    kinds = {f["kind"]: f["summary"] for f in entry["features"]}
    assert entry["summary"]["reused"] > 0 and kinds["offload"]["bytes_moved_on_skipped_calls"] == 0


@pytest.mark.parametrize("case_name, variants", [
    ("ltxav", [None, "ltx2_odd", "ltx2_video_only", "ltx2_short_audio"]),
    ("kandinsky5", [None, "kandinsky5_odd", "kandinsky5_one_frame"])])
def test_the_resolution_changes_between_runs_of_one_group(env, case_name, variants):
    """One group, one run after the other: LTX-2 with audio, 27 video tokens, video only, one audio token; Kandinsky 5
    with 32 tokens, 27, one latent frame. Each against one process (the one-audio-token run within 1e-3: see
    test_sp_ltx2_kandinsky5_host.py)."""
    import copy
    import dataclasses

    built, _ = build(env, case_name, ring=False)
    model = env.sequence_parallel(built.patcher, ring=False)
    for variant in variants:
        case = dataclasses.replace(built, positive=copy.deepcopy(built.positive),
                                   negative=copy.deepcopy(built.negative))
        if variant is not None:
            INPUT_VARIANTS[variant](case)
        alone = env.tiny.sample(case, steps=3)
        got = env.tiny.sample(case, model=model, steps=3)
        assert_same(got, alone, ring=variant == "ltx2_short_audio")


def test_an_audio_video_latent_larger_than_a_command_reaches_the_worker(env):
    """A call's tensors over what a command carries go to the workers by broadcast. LTX-2's video and audio are views
    into ComfyUI's packed latent, not contiguous when cond and uncond are batched: they are sent from a contiguous
    copy (768 video tokens: 393 KiB a sample)."""
    import comfy.nested_tensor

    from omnitest.pack import pack_module

    protocol = pack_module("nodes.sequence_parallel.protocol")
    case, _ = build(env, "ltxav", ring=False)
    case.latent = comfy.nested_tensor.NestedTensor([torch.zeros(1, 128, 3, 16, 16), torch.zeros(1, 8, 40, 16)])
    assert case.latent.unbind()[0].numel() * 4 > protocol.BROADCAST_BYTES
    alone = env.tiny.sample(case, steps=2)
    got = env.tiny.sample(case, model=env.sequence_parallel(case.patcher, ring=False), steps=2)
    assert_same(got, alone, ring=False)
