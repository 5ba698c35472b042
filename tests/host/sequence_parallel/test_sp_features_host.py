"""Sequence Parallel with the pack's other features on one MODEL, in one ComfyUI process (rank 0) and one local worker
process (rank 1, gloo on CPU), through ComfyUI's KSampler: the workers run the same caches and offload, every rank
decides alike, rank 0 publishes the run with the world size, and the patched weights (LoRA) reach the workers; LTX-2
and Kandinsky 5 (ComfyUI 0.33) with each cache and with CPU Offload, within ``SPLIT_RELATIVE`` with Ulysses
(``omnitest.sp_families``)."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from omnitest.cache_nodes import apply_magcache, apply_teacache, save_identity_calibrations, tiny_lora
from omnitest.quality import psnr_db
from omnitest.sp_families import INPUT_VARIANTS, assert_split_close

pytestmark = pytest.mark.host

MIN_PSNR_DB = 60.0
STEPS = 8
LAYERS = 4
IDENTITY = "sp-identity"


@pytest.fixture(scope="module")
def env(user_dir):
    from omnitest import tiny_models
    from omnitest.pack import pack_module, run_node

    save_identity_calibrations(IDENTITY, STEPS)
    sp_node = pack_module("nodes.sequence_parallel.node")
    offload_node = pack_module("nodes.offload.node")
    group = pack_module("nodes.sequence_parallel.group")

    class Env:
        tiny = tiny_models
        offload_module = pack_module("nodes.offload.host")  # where the node and its run find the offload target
        stats = pack_module("nodes.stats_store")

        @staticmethod
        def sequence_parallel(model, **inputs):
            settings = dict(world_size=2, ulysses_degree="auto", ring_degree="auto", devices="auto", backend="auto",
                            master_address="127.0.0.1", master_port=0, cfg_parallel=False)
            return run_node(sp_node.SequenceParallel, node_id="30", model=model, **{**settings, **inputs})[0]

        @staticmethod
        def teacache(model, threshold=5.0, forecast=None, forward_budget=None, skip_correction=None):
            # forecasting needs two computed steps before a skip: a threshold that computes more often
            return apply_teacache(model, IDENTITY, 1.5 if forecast else threshold, forecast=forecast,
                                  forward_budget=forward_budget, skip_correction=skip_correction)

        @staticmethod
        def magcache(model, threshold=1.0, forecast=None, forward_budget=None):
            return apply_magcache(model, IDENTITY, 0.3 if forecast else threshold, forecast=forecast,
                                  forward_budget=forward_budget)

        @staticmethod
        def offload(model):
            return run_node(offload_node.CPUOffload, node_id="20", model=model, blocks_to_offload=LAYERS,
                            prefetch_blocks=1, pin_memory="auto", vram_budget_gb=0.0)[0]

    yield Env
    group.close_group()


@pytest.fixture(scope="module")
def wan(env):
    return env.tiny.build_case("wan21_t2v", unet_overrides={"num_layers": LAYERS})


def last_entry(env) -> dict:
    return env.stats.recent_runs(1)[0]


def reasons(entry: dict) -> list[str]:
    return [b["reason"] for e in entry["evaluations"] for b in e["branches"]]


@pytest.mark.parametrize("forecast", [None, "2nd order"])
@pytest.mark.parametrize("cache", ["teacache", "magcache"])
@pytest.mark.parametrize("order", ["parallel first", "cache first"])
def test_a_cache_decides_alike_on_every_rank_and_rank_0_publishes_the_run(env, wan, cache, order, forecast):
    """With forecasting too: every rank extrapolates its shard with the same sigma weights, no extra collective."""
    def apply_cache(model):
        return getattr(env, cache)(model, forecast=forecast)

    alone = env.tiny.sample(wan, model=apply_cache(wan.patcher), steps=STEPS)
    alone_entry = last_entry(env)
    alone_summary = alone_entry["summary"]
    if order == "parallel first":
        model = apply_cache(env.sequence_parallel(wan.patcher))
    else:
        model = env.sequence_parallel(apply_cache(wan.patcher))
    got = env.tiny.sample(wan, model=model, steps=STEPS)
    entry = last_entry(env)
    assert entry["status"] == "success"
    assert alone_summary["reused"] > 0 and entry["summary"]["reused"] == alone_summary["reused"]
    assert entry["summary"]["computed"] == alone_summary["computed"]
    assert reasons(entry) == reasons(alone_entry)
    assert ("forecast" in reasons(entry)) == (forecast is not None)
    assert psnr_db(got, alone) >= MIN_PSNR_DB
    assert entry["world_size"] == 2
    (parallel,) = [f for f in entry["features"] if f["kind"] == "sequence_parallel"]
    assert parallel["node_id"] == "30" and parallel["summary"]["world_size"] == 2
    assert parallel["summary"]["calls"] == alone_summary["computed"] + alone_summary["reused"]
    assert parallel["summary"]["bytes_sent"] > 0


@pytest.mark.parametrize("cache", ["teacache", "magcache"])
def test_a_forward_budget_places_the_same_steps_on_every_rank_as_in_one_process(env, wan, cache):
    """The budget's plan is made from what every rank sees alike (the schedule, the calibration, the rank-mean
    metric): the group computes exactly the budget's steps, the ones the run alone computes, with its forecast."""
    budget = 4

    def apply_cache(model):
        return getattr(env, cache)(model, threshold=0.0, forecast="1st order", forward_budget=budget)

    alone = env.tiny.sample(wan, model=apply_cache(wan.patcher), steps=STEPS)
    alone_entry = last_entry(env)
    got = env.tiny.sample(wan, model=apply_cache(env.sequence_parallel(wan.patcher)), steps=STEPS)
    entry = last_entry(env)
    assert entry["status"] == "success" and entry["world_size"] == 2
    computed = [e["computed"] for e in entry["evaluations"]]
    assert computed == [e["computed"] for e in alone_entry["evaluations"]] and sum(computed) == budget
    assert reasons(entry) == reasons(alone_entry) and "budget" in reasons(entry)
    assert entry["summary"]["budget"] == alone_entry["summary"]["budget"]
    assert psnr_db(got, alone) >= MIN_PSNR_DB


def test_skip_correction_corrects_every_ranks_shard_as_one_process_does(env, wan):
    """Whether the sampler takes Euler steps travels with each call to the workers: every rank corrects its shard
    after the same gaps, so the group's latent is the one process's."""
    def apply_cache(model, correction):
        return env.teacache(model, threshold=0.0, forecast="1st order", forward_budget=4, skip_correction=correction)

    uncorrected = env.tiny.sample(wan, model=apply_cache(wan.patcher, 0.0), steps=STEPS)
    alone = env.tiny.sample(wan, model=apply_cache(wan.patcher, 0.5), steps=STEPS)
    alone_notes = last_entry(env)["summary"]["notes"]
    got = env.tiny.sample(wan, model=apply_cache(env.sequence_parallel(wan.patcher), 0.5), steps=STEPS)
    entry = last_entry(env)
    assert entry["status"] == "success" and entry["world_size"] == 2
    corrected = [n for n in entry["summary"]["notes"] if n.startswith("skip correction 0.5: ")]
    assert corrected and corrected == [n for n in alone_notes if n.startswith("skip correction")]
    assert psnr_db(got, alone) >= MIN_PSNR_DB
    assert psnr_db(alone, uncorrected) < MIN_PSNR_DB  # the correction is there to be matched


def test_with_offload_and_a_cache_the_weights_reach_the_workers_before_offload_places_them(env, wan, monkeypatch):
    """Rank 0's offload runs its real path on the CPU (as if it were a GPU): its blocks hold placeholders during the
    run, so the weights must have been sent before; the worker (a CPU rank) runs offload as a note."""
    alone = env.tiny.sample(wan, model=env.teacache(wan.patcher), steps=STEPS)
    monkeypatch.setattr(env.offload_module, "offload_target", lambda patcher: torch.device("cpu"))
    model = env.offload(env.teacache(env.sequence_parallel(wan.patcher)))
    got = env.tiny.sample(wan, model=model, steps=STEPS)
    assert psnr_db(got, alone) >= MIN_PSNR_DB
    entry = last_entry(env)
    kinds = {f["kind"]: f["summary"] for f in entry["features"]}
    assert set(kinds) == {"sequence_parallel", "offload"}
    assert kinds["offload"]["bytes_moved"] > 0 and kinds["offload"]["bytes_moved_on_skipped_calls"] == 0
    assert (env.tiny.sample(wan, steps=STEPS) == env.tiny.sample(wan, steps=STEPS)).all()


def test_a_lora_strength_change_reaches_the_workers(env, wan):
    import comfy.sd

    lora = tiny_lora(wan.diffusion_model)
    for strength in (1.0, 0.3):
        patched, _ = comfy.sd.load_lora_for_models(wan.patcher, None, lora, strength, 0.0)
        reference = env.tiny.sample(wan, model=patched, steps=STEPS)
        got = env.tiny.sample(wan, model=env.sequence_parallel(patched), steps=STEPS)
        assert psnr_db(got, reference) >= MIN_PSNR_DB, strength


def test_lora_on_layers_comfyui_loaded_in_lowvram_mode_reaches_the_workers(env, wan):
    """In ComfyUI's lowvram mode a layer keeps its LoRA as a cast-time patch, not in its weight: rank 0 sends the
    patched weight (``computed_state``)."""
    import comfy.model_management
    import comfy.patcher_extension as pe
    import comfy.sd

    patched, _ = comfy.sd.load_lora_for_models(wan.patcher, None, tiny_lora(wan.diffusion_model), 1.0, 0.0)
    reference = env.tiny.sample(wan, model=patched, steps=STEPS)
    model = env.sequence_parallel(patched)
    lowvram_layers = []

    def partial_load(executor, patcher, *args, **kwargs):  # ComfyUI's own partial unload, as on a small GPU
        loaded = executor(patcher, *args, **kwargs)
        patcher.partially_unload(patcher.offload_device, memory_to_free=patcher.model_size() // 2)
        lowvram_layers.append(sum(1 for m in patcher.model.diffusion_model.modules()
                                  if getattr(m, "weight_function", None)))
        return loaded

    # added after ours, so inside it: ours sees the partial load
    model.add_wrapper_with_key(pe.WrappersMP.PREPARE_SAMPLING, "test.partial", partial_load)
    try:
        got = env.tiny.sample(wan, model=model, steps=STEPS)
    finally:
        comfy.model_management.unload_all_models()  # the next test loads afresh
    assert lowvram_layers and lowvram_layers[0] > 0
    assert psnr_db(got, reference) >= MIN_PSNR_DB


def test_cfg_parallel_gives_the_one_process_latent_and_runs_with_a_cache(env, wan):
    """cfg 5: ComfyUI batches cond and uncond; with cfg_parallel rank 0 computes one, the worker the other."""
    def cfg_parallel(model):
        return env.sequence_parallel(model, cfg_parallel=True)

    reference = env.tiny.sample(wan, steps=STEPS, cfg=5.0)
    assert psnr_db(env.tiny.sample(wan, model=cfg_parallel(wan.patcher), steps=STEPS, cfg=5.0), reference) >= \
        MIN_PSNR_DB
    cached = env.tiny.sample(wan, model=cfg_parallel(env.teacache(wan.patcher)), steps=STEPS, cfg=5.0)
    entry = last_entry(env)
    (parallel,) = [f for f in entry["features"] if f["kind"] == "sequence_parallel"]
    assert parallel["summary"]["cfg_degree"] == 2 and entry["status"] == "success"
    assert entry["summary"]["reused"] > 0
    assert torch.isfinite(cached).all()


@pytest.mark.parametrize("case_name", ["flux", "chroma", "qwen_image", "hunyuan_video", "ltxv", "flux2", "z_image",
                                       "hunyuan_video15"])
def test_each_family_with_a_plan_runs_through_the_session_with_a_worker_that_builds_it_from_its_config(env,
                                                                                                      case_name):
    case = env.tiny.build_case(case_name)
    reference = env.tiny.sample(case, steps=3)
    assert psnr_db(env.tiny.sample(case, model=env.sequence_parallel(case.patcher), steps=3), reference) >= \
        MIN_PSNR_DB


@pytest.mark.parametrize("case_name, variant", [
    ("hunyuan_video", "text_mask"), ("ltxv", "denoise_mask"), ("ltxv", "keyframes")])
def test_a_familys_extra_inputs_reach_the_worker(env, case_name, variant):
    """HunyuanVideo's text attention mask, LTX-Video's per-token timesteps and keyframe indices (passed after
    transformer_options) through the session."""
    from omnitest.sp_families import INPUT_VARIANTS

    case = env.tiny.build_case(case_name)
    INPUT_VARIANTS[variant](case)
    reference = env.tiny.sample(case, steps=3)
    assert psnr_db(env.tiny.sample(case, model=env.sequence_parallel(case.patcher), steps=3), reference) >= \
        MIN_PSNR_DB


@pytest.mark.parametrize("case_name, variant", [
    ("flux", None), ("hunyuan_video", "text_mask"),
    ("ltxv", "denoise_mask"),  # TeaCache's signal reads the per-token timesteps, split before the cache sees them
    ("flux2", None), ("z_image", None), ("hunyuan_video15", None),
])
@pytest.mark.parametrize("cache", ["teacache", "magcache"])
def test_a_cache_on_a_joint_attention_family_decides_alike_on_every_rank(env, user_dir, case_name, variant, cache):
    from omnitest.sp_families import INPUT_VARIANTS

    case = env.tiny.build_case(case_name)
    if variant is not None:
        INPUT_VARIANTS[variant](case)
    identity = f"sp-{case.family}-identity"
    save_identity_calibrations(identity, STEPS, family=case.family)

    def cached(model):
        if cache == "magcache":
            return apply_magcache(model, identity, threshold=1.0)
        return apply_teacache(model, identity, threshold=2.0)

    alone = env.tiny.sample(case, model=cached(case.patcher), steps=STEPS)
    alone_summary = last_entry(env)["summary"]
    got = env.tiny.sample(case, model=cached(env.sequence_parallel(case.patcher)), steps=STEPS)
    summary = last_entry(env)["summary"]
    assert alone_summary["reused"] > 0
    assert (summary["reused"], summary["computed"]) == (alone_summary["reused"], alone_summary["computed"])
    assert psnr_db(got, alone) >= MIN_PSNR_DB


def test_the_card_has_per_step_time_bytes_and_the_agreed_cache_decisions(env, wan):
    """Every call lands in its sampler step; the per-step bytes add up to the rank's total and the agreed decisions
    to the cache's own counts."""
    env.tiny.sample(wan, model=env.sequence_parallel(env.teacache(wan.patcher)), steps=STEPS)
    entry = last_entry(env)
    (parallel,) = [f["summary"] for f in entry["features"] if f["kind"] == "sequence_parallel"]
    steps = parallel["steps"]
    assert [s["first_step"] for s in steps] == list(range(STEPS)) and all(s["seconds"] > 0 for s in steps)
    assert sum(s["calls"] for s in steps) == parallel["calls"]
    by_exchange = sum(parallel["bytes_sent_by_exchange"].values())
    assert sum(s["bytes_sent"] for s in steps) == parallel["bytes_sent"] == by_exchange
    assert sum(s["decided"] for s in steps) == parallel["calls"]
    assert sum(s["skipped"] for s in steps) == entry["summary"]["reused"] > 0
    skipped_bytes = [s["bytes_sent"] for s in steps if s["skipped"] == s["calls"]]
    computed_bytes = [s["bytes_sent"] for s in steps if s["skipped"] == 0]
    assert skipped_bytes and max(skipped_bytes) < min(computed_bytes)  # a skipped step exchanges only the agreement
    assert parallel["calls_unsplit"] == 0 and parallel["unsplit_reason"] is None


# -- LTX-2 and Kandinsky 5 (ComfyUI 0.33) -----------------------------------------------------------------------------
# Each cache on top and CPU Offload on top give what the same nodes give without Sequence Parallel, within float32
# rounding with Ulysses and within 1e-3 relative with ring, at cfg 1 and cfg > 1, the caches skipping the same steps on
# every rank (LTX-2's deciding on video and audio together); the resolution changes between runs of one group.

ONE_HEAD = {"ltxav": {"num_attention_heads": 1, "attention_head_dim": 64, "audio_num_attention_heads": 1,
                      "audio_attention_head_dim": 32},
            "kandinsky5": {"model_dim": 32}}
LAYER_COUNTS = {"ltxav": "num_layers", "kandinsky5": "num_visual_blocks"}


def parallel(env, model, ring: bool):
    return env.sequence_parallel(model, ulysses_degree="1" if ring else "2", ring_degree="2" if ring else "1",
                                 devices="cpu,cpu", backend="gloo")


def build(env, case_name: str, ring: bool):
    case = env.tiny.build_case(case_name, unet_overrides={**(ONE_HEAD[case_name] if ring else {}),
                                                          LAYER_COUNTS[case_name]: LAYERS})
    identity = f"sp-{case.family}-identity"
    save_identity_calibrations(identity, STEPS, family=case.family)
    return case, identity


def cached(kind: str, identity: str):
    if kind == "magcache":
        return lambda model: apply_magcache(model, identity, threshold=1.0)
    return lambda model: apply_teacache(model, identity, threshold=2.0)


@pytest.mark.parametrize("cfg", [1.0, None])
@pytest.mark.parametrize("ring", [False, True], ids=["ulysses", "ring"])
@pytest.mark.parametrize("cache", ["teacache", "magcache"])
@pytest.mark.parametrize("case_name", ["ltxav", "kandinsky5"])
def test_a_cache_on_top_skips_the_same_steps_and_gives_the_same_latent(env, case_name, cache, ring, cfg):
    case, identity = build(env, case_name, ring)
    apply = cached(cache, identity)
    alone = env.tiny.sample(case, model=apply(case.patcher), steps=STEPS, cfg=cfg)
    alone_summary = last_entry(env)["summary"]
    got = env.tiny.sample(case, model=apply(parallel(env, case.patcher, ring)), steps=STEPS, cfg=cfg)
    entry = last_entry(env)
    assert entry["status"] == "success" and entry["world_size"] == 2
    assert alone_summary["reused"] > 0
    assert (entry["summary"]["reused"], entry["summary"]["computed"]) == (alone_summary["reused"],
                                                                          alone_summary["computed"])
    assert_split_close(got, alone, ring)


@pytest.mark.parametrize("cfg", [1.0, None])
@pytest.mark.parametrize("ring", [False, True], ids=["ulysses", "ring"])
@pytest.mark.parametrize("case_name", ["ltxav", "kandinsky5"])
def test_cpu_offload_on_top_gives_the_same_latent(env, monkeypatch, case_name, ring, cfg):
    """Rank 0's offload runs its real path on the CPU (as if it were a GPU): its offloaded blocks hold placeholders
    during the run; with TeaCache too, a skipped step moves no weights."""
    case, identity = build(env, case_name, ring)
    monkeypatch.setattr(env.offload_module, "offload_target", lambda patcher: torch.device("cpu"))
    alone = env.tiny.sample(case, model=env.offload(case.patcher), steps=STEPS, cfg=cfg)
    got = env.tiny.sample(case, model=env.offload(parallel(env, case.patcher, ring)), steps=STEPS, cfg=cfg)
    assert_split_close(got, alone, ring)
    kinds = {f["kind"]: f["summary"] for f in last_entry(env)["features"]}
    assert set(kinds) == {"sequence_parallel", "offload"} and kinds["offload"]["bytes_moved"] > 0
    teacache = cached("teacache", identity)
    alone = env.tiny.sample(case, model=env.offload(teacache(case.patcher)), steps=STEPS, cfg=cfg)
    got = env.tiny.sample(case, model=teacache(env.offload(parallel(env, case.patcher, ring))), steps=STEPS,
                          cfg=cfg)
    assert_split_close(got, alone, ring)
    entry = last_entry(env)
    kinds = {f["kind"]: f["summary"] for f in entry["features"]}
    assert entry["summary"]["reused"] > 0 and kinds["offload"]["bytes_moved_on_skipped_calls"] == 0


@pytest.mark.parametrize("case_name, variants", [
    ("ltxav", [None, "ltx2_odd", "ltx2_video_only", "ltx2_short_audio"]),
    ("kandinsky5", [None, "kandinsky5_odd", "kandinsky5_one_frame"])])
def test_the_resolution_changes_between_runs_of_one_group(env, case_name, variants):
    """One group, one run after the other: LTX-2 with audio, 27 video tokens, video only, one audio token; Kandinsky 5
    with 32 tokens, 27, one latent frame. Each against one process (the one-audio-token run within 1e-3: see
    test_sp_ltx2_kandinsky5_host.py)."""
    built, _ = build(env, case_name, ring=False)
    model = parallel(env, built.patcher, ring=False)
    for variant in variants:
        case = dataclasses.replace(built, positive=copy.deepcopy(built.positive),
                                   negative=copy.deepcopy(built.negative))
        if variant is not None:
            INPUT_VARIANTS[variant](case)
        alone = env.tiny.sample(case, steps=3)
        got = env.tiny.sample(case, model=model, steps=3)
        assert_split_close(got, alone, ring=variant == "ltx2_short_audio")


def test_an_audio_video_latent_larger_than_a_command_reaches_the_worker(env):
    """A call's tensors over what a command carries go to the workers by broadcast. LTX-2's video and audio are views
    into ComfyUI's packed latent, not contiguous when cond and uncond are batched: they are sent from a contiguous
    copy (768 video tokens: 393 KiB a sample)."""
    from omnitest.pack import pack_module

    case, _ = build(env, "ltxav", ring=False)  # skips on a ComfyUI without LTX-2
    import comfy.nested_tensor

    protocol = pack_module("nodes.sequence_parallel.protocol")
    case.latent = comfy.nested_tensor.NestedTensor([torch.zeros(1, 128, 3, 16, 16), torch.zeros(1, 8, 40, 16)])
    assert case.latent.unbind()[0].numel() * 4 > protocol.BROADCAST_BYTES
    alone = env.tiny.sample(case, steps=2)
    got = env.tiny.sample(case, model=parallel(env, case.patcher, ring=False), steps=2)
    assert_split_close(got, alone, ring=False)


@pytest.mark.parametrize("sparse_first", [True, False], ids=["sparse_then_sp", "sp_then_sparse"])
def test_block_sparse_attention_on_the_same_model_is_refused_naming_both_before_any_exchange(env, wan, sparse_first):
    """ComfyUI 0.35's BlockSparseAttention (the stand-in of ``omnitest.newer_comfy``) sets the attention override
    Sequence Parallel splits attention through: one clear error naming both, whichever node comes first, raised before
    the run joins the group; the group runs the next sampling run as before."""
    from omnitest.newer_comfy import block_sparse_attention_035

    if sparse_first:
        model = env.sequence_parallel(block_sparse_attention_035(wan.patcher)[0])
    else:
        model = block_sparse_attention_035(env.sequence_parallel(wan.patcher))[0]
    with pytest.raises(ValueError) as refused:
        env.tiny.sample(wan, model=model, steps=2)
    message = str(refused.value)
    assert message.startswith("Sequence Parallel (node #30): ComfyUI's Model Sparse Attention node "
                              "(BlockSparseAttention")
    assert "Fix: use one of them on this model" in message
    entry = last_entry(env)
    assert (entry["kind"], entry["status"], entry["summary"]) == ("sequence_parallel", "error", None)  # never joined
    alone = env.tiny.sample(wan, steps=2)
    assert psnr_db(env.tiny.sample(wan, model=env.sequence_parallel(wan.patcher), steps=2), alone) >= MIN_PSNR_DB


@pytest.mark.parametrize("sampler, placement, correction", [
    ("uni_pc", "measured", "skip correction 0.5 (weighed by the sampler's step weights): "),
    ("euler", "tail", "skip correction 0.5: ")])
def test_a_speedups_measured_plan_places_the_same_steps_on_every_rank_as_in_one_process(env, wan, sampler, placement,
                                                                                       correction):
    """A speed-up places its steps by the calibration's sketches and the sampler's step weights (with a sampler that
    takes no Euler steps, the plan they rate best; with euler, the step profile's plan with the tail they favour):
    both reach the workers (the config as plain data, the weights with each call), so the group computes the steps
    the run alone computes, and corrects the gaps as it does."""
    from omnitest.pack import pack_module

    files = pack_module("nodes.caches.calibration_files")
    generator = torch.Generator().manual_seed(3)
    sigmas = torch.linspace(1.0, 0.1, STEPS)
    base = torch.randn(3, 16, generator=generator)
    sketches = base[0] + sigmas[:, None] * base[1] + torch.relu(0.5 - sigmas)[:, None] ** 2 * 30 * base[2]
    files.save("teacache", "sp-measured", {
        "coefficients": [0, 0, 0, 1, 0], "family": "wan", "signal": "default",
        "step_profile": {"sigmas": sigmas.tolist(), "changes": [0.0] + [0.1] * (STEPS - 1),
                         "sketches": sketches.tolist()}})

    def apply_cache(model):
        from omnitest.pack import run_node

        return run_node(pack_module("nodes.caches.teacache").ApplyTeaCache, node_id="21", model=model,
                        rel_l1_thresh=-1.0, start_percent=0.0, end_percent=1.0, cache_device="compute device",
                        model_variant="calibration: sp-measured", speedup=2.0)[0]

    alone = env.tiny.sample(wan, model=apply_cache(wan.patcher), steps=STEPS, sampler_name=sampler)
    alone_entry = last_entry(env)
    got = env.tiny.sample(wan, model=apply_cache(env.sequence_parallel(wan.patcher)), steps=STEPS,
                          sampler_name=sampler)
    entry = last_entry(env)
    assert entry["status"] == "success" and entry["world_size"] == 2
    assert alone_entry["summary"]["budget"]["placement"] == placement
    assert entry["summary"]["budget"] == alone_entry["summary"]["budget"]
    assert reasons(entry) == reasons(alone_entry)
    corrections = [[n for n in e["summary"]["notes"] if n.startswith("skip correction")] for e in (entry, alone_entry)]
    assert corrections[0] == corrections[1] and len(corrections[0]) == 1, corrections
    assert corrections[0][0].startswith(correction), corrections
    assert psnr_db(got, alone) >= MIN_PSNR_DB
