"""CPU Offload inside a real ComfyUI (in-process).

This ComfyUI runs on the CPU, so the node has nothing to offload to and must change nothing (first test). Every other
test forces the offload target to the CPU (``offload_target`` monkeypatched), so that the real path runs with
ComfyUI's loaded, patched weights: CPU master copies, 0-element placeholders, slots the blocks run from, ComfyUI's
lowvram cast path reading slot views, LoRA patches, ComfyUI's loaded-weight accounting. Outputs are compared bit for
bit with the same run without the node.
"""
from __future__ import annotations

import gc
import logging

import pytest
import torch

from omnitest.cache_nodes import apply_magcache, apply_teacache, save_identity_calibrations, tiny_lora
from omnitest.comfy_path import requires_comfy_class
from omnitest.offload_probe import Probe, assert_same_state, assert_unhooked, block_bytes, weights_state

pytestmark = pytest.mark.host

STEPS = 6
LAYERS = 4
IDENTITY = "offload-identity"


@pytest.fixture(scope="module")
def env(user_dir):
    from omnitest import tiny_models
    from omnitest.pack import pack_module, run_node

    offload_module = pack_module("nodes.offload.node")
    features = pack_module("nodes.features")
    save_identity_calibrations(IDENTITY, STEPS)

    class Env:
        tiny = tiny_models
        node = offload_module
        session = pack_module("nodes.offload.session")
        takeover = pack_module("nodes.offload.takeover")
        host = pack_module("nodes.offload.host")
        placement = pack_module("nodes.offload.placement")
        lifecycle = features
        stats = pack_module("nodes.stats_store")

        @staticmethod
        def offload(model, blocks=-1, prefetch=1, pin="auto", budget_gb=0.0, node_id="20"):
            return run_node(offload_module.CPUOffload, node_id=node_id, model=model, blocks_to_offload=blocks,
                            prefetch_blocks=prefetch, pin_memory=pin, vram_budget_gb=budget_gb)[0]

        @staticmethod
        def teacache(model, threshold=5.0, forecast=None):
            # forecasting needs two computed steps before a skip: a threshold that computes more often
            return apply_teacache(model, IDENTITY, 1.5 if forecast else threshold, forecast=forecast)

        @staticmethod
        def magcache(model, threshold=1.0, forecast=None):
            return apply_magcache(model, IDENTITY, 0.3 if forecast else threshold, forecast=forecast)

    yield Env


@pytest.fixture(scope="module")
def wan(env):
    return env.tiny.build_case("wan21_t2v", unet_overrides={"num_layers": LAYERS})


@pytest.fixture
def forced(env, monkeypatch):
    """Offload to the CPU as if it were a GPU: the real path, every byte really copied."""
    monkeypatch.setattr(env.host, "offload_target", lambda patcher: torch.device("cpu"))


def with_lora(model, lora: dict, strength: float):
    import comfy.sd

    patched, _ = comfy.sd.load_lora_for_models(model, None, lora, strength, 0.0)
    return patched


# -- CPU-only ComfyUI --------------------------------------------------------------------------------------------------

def test_on_a_cpu_only_comfyui_the_node_says_so_and_changes_nothing(env, wan, caplog):
    baseline = env.tiny.sample(wan, steps=STEPS)
    before = weights_state(wan.diffusion_model)
    probe = Probe(env, env.offload(wan.patcher, blocks=LAYERS))
    with caplog.at_level(logging.INFO, logger="OmniHooks"):
        out = env.tiny.sample(wan, model=probe.model, steps=STEPS)
    assert torch.equal(out, baseline)
    summary = probe.session(env).summary()
    assert summary["active"] is False and summary["status"] == "success"
    assert summary["blocks_offloaded"] == 0 and summary["bytes_moved"] == 0
    assert any("nothing to offload to" in note for note in summary["notes"]), summary["notes"]
    lines = [r.getMessage() for r in caplog.records if "CPU Offload" in r.getMessage()]
    assert any("nothing to offload to" in line for line in lines), lines
    assert_same_state(before, weights_state(wan.diffusion_model))
    assert_unhooked(wan.diffusion_model)


# -- the real path, forced onto the CPU --------------------------------------------------------------------------------

@pytest.mark.parametrize("blocks,prefetch", [(1, 1), (2, 0), (2, 1), (LAYERS, 1), (LAYERS, 2)])
def test_offload_is_bit_identical_and_everything_is_restored(env, wan, forced, blocks, prefetch):
    baseline = env.tiny.sample(wan, steps=STEPS)
    model = wan.patcher.model
    own_count = model.model_loaded_weight_memory
    before = weights_state(wan.diffusion_model)
    probe = Probe(env, env.offload(wan.patcher, blocks=blocks, prefetch=prefetch))
    out = env.tiny.sample(wan, model=probe.model, steps=STEPS)
    assert torch.equal(out, baseline)

    summary = probe.session(env).summary()
    offloaded = list(wan.diffusion_model.blocks)[LAYERS - blocks:]
    per_block = block_bytes(offloaded[0])
    assert summary["active"] and summary["status"] == "success"
    assert summary["blocks_offloaded"] == blocks and summary["blocks"] == blocks
    assert summary["peak_resident_blocks"] <= 1 + prefetch
    assert summary["calls_computed"] == probe.calls and summary["calls_skipped"] == 0
    assert summary["block_calls"] == probe.calls * blocks
    assert summary["bytes_moved"] >= per_block * summary["copies"] > 0
    if prefetch >= 1:
        assert summary["sync_loads"] == 0  # every computed call found its blocks on the device or in flight
    assert summary["freed_device_bytes"] == blocks * per_block

    # ComfyUI's accounting saw the blocks leave and the slots arrive, and got its own number back
    expected = own_count - blocks * per_block + summary["device_bytes"]
    assert set(probe.loaded_weight_memory) == {expected}
    assert model.model_loaded_weight_memory == own_count

    assert_same_state(before, weights_state(wan.diffusion_model))
    assert_unhooked(wan.diffusion_model)
    assert torch.equal(env.tiny.sample(wan, steps=STEPS), baseline)  # the input MODEL is untouched


@pytest.mark.parametrize("case_name", ["flux2", "z_image", "hunyuan_video15", "hunyuan_video15_sr", "ltxav",
                                       "kandinsky5", "minimax_h3", "hidream_o1"])
def test_offload_on_comfyui_0_3_75_families_is_bit_identical(env, forced, case_name):
    """Flux 2 (block modulation computed outside the blocks), Z-Image, HunyuanVideo 1.5 and its SR model, LTX-2
    (ComfyUI 0.33; video and audio streams), Kandinsky 5, MiniMax-H3 and HiDream-O1 (ComfyUI 0.33; its kept prompt
    keys and values): every block offloaded, same output; skips in one line on a ComfyUI without the class."""
    case = env.tiny.build_case(case_name)
    baseline = env.tiny.sample(case, steps=3)
    before = weights_state(case.diffusion_model)
    probe = Probe(env, env.offload(case.patcher, blocks=99))  # more than the model has: all of them
    out = env.tiny.sample(case, model=probe.model, steps=3)
    assert torch.equal(out, baseline)
    summary = probe.session(env).summary()
    assert summary["status"] == "success" and summary["blocks_offloaded"] == summary["blocks"] > 1
    assert_same_state(before, weights_state(case.diffusion_model))
    assert_unhooked(case.diffusion_model)


@pytest.mark.parametrize("room_for_kept", [2, 1])
def test_kept_blocks_that_comfyui_left_off_the_device_are_completed_while_they_fit(env, wan, monkeypatch,
                                                                                   room_for_kept):
    """Target "cpu:0": a device that compares unequal to "cpu", so every weight counts as left off the device by
    ComfyUI's partial load, and completing (promoting) the kept blocks really copies them."""
    import comfy.model_management as mm

    monkeypatch.setattr(env.host, "offload_target", lambda patcher: torch.device("cpu", 0))
    per_block = block_bytes(wan.diffusion_model.blocks[0])
    reserve = int(mm.minimum_inference_memory())
    # the blocks hold nothing "on the device": available = free - reserve = 2 slots (prefetch 1) + room_for_kept blocks
    free = reserve + (2 + room_for_kept) * per_block + per_block // 2
    monkeypatch.setattr(mm, "get_free_memory", lambda dev=None, torch_free_too=False: (free, free)
                        if torch_free_too else free)
    baseline = env.tiny.sample(wan, steps=STEPS)
    own_count = wan.patcher.model.model_loaded_weight_memory
    before = weights_state(wan.diffusion_model)
    events = []
    for cls, name in ((env.session.LayerwiseOffloadRun, "apply"), (env.session.LayerwiseOffloadRun, "remove"),
                      (env.placement.Promotion, "promote"), (env.placement.Promotion, "undo")):
        monkeypatch.setattr(cls, name, lambda self, *a, _call=getattr(cls, name), _name=name, **k:
                            (events.append(_name), _call(self, *a, **k))[1])
    probe = Probe(env, env.offload(wan.patcher, blocks=2, prefetch=1))
    out = env.tiny.sample(wan, model=probe.model, steps=STEPS)
    assert torch.equal(out, baseline)
    # the offloaded blocks leave the device before the kept ones are completed there, and come back only after
    # those are undone: the device never holds both
    assert events.index("apply") < events.index("promote") and events.index("undo") < events.index("remove")
    summary = probe.session(env).summary()
    assert summary["blocks_offloaded"] == 2 and summary["freed_device_bytes"] == 0
    assert summary["blocks_promoted"] == room_for_kept and summary["promoted_bytes"] == room_for_kept * per_block
    assert summary["blocks_partly_streamed"] == 2 - room_for_kept
    assert set(probe.loaded_weight_memory) == {own_count + summary["device_bytes"] + summary["promoted_bytes"]}
    if room_for_kept < 2:
        assert any("stay partly on the offload device" in n for n in summary["notes"]), summary["notes"]
    after = weights_state(wan.diffusion_model)
    assert_same_state(before, after)
    kept = [name for name in before if name.startswith(("blocks.0.", "blocks.1."))]
    assert all(after[n][5] == before[n][5] for n in kept)  # completed blocks got their very storage back
    assert wan.patcher.model.model_loaded_weight_memory == own_count
    assert_unhooked(wan.diffusion_model)


def test_summary_is_json_safe_and_logged_once(env, wan, forced, caplog):
    import json

    probe = Probe(env, env.offload(wan.patcher, blocks=2))
    with caplog.at_level(logging.INFO, logger="OmniHooks"):
        env.tiny.sample(wan, model=probe.model, steps=STEPS)
    summary = probe.session(env).summary()
    assert json.loads(json.dumps(summary)) == summary
    for key in ("bytes_moved", "peak_resident_blocks", "copy_wait_seconds", "notes", "blocks_total"):
        assert key in summary
    assert summary["blocks_total"] == LAYERS
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("OmniHooks CPU Offload")]
    assert len(lines) == 1 and "node #20" in lines[0] and "moved" in lines[0], lines


@pytest.mark.parametrize("forecast", [None, "2nd order"])
@pytest.mark.parametrize("cache", ["teacache", "magcache"])
@pytest.mark.parametrize("order", ["offload first", "cache first"])
def test_with_a_cache_a_skipped_step_moves_nothing_and_outputs_match_the_cache_alone(env, wan, forced, cache, order,
                                                                                     forecast):
    """A forecast step, like a reused one, runs no block, so it moves no weights."""
    def apply_cache(model):
        return getattr(env, cache)(model, forecast=forecast)

    cached_alone = env.tiny.sample(wan, model=apply_cache(wan.patcher), steps=STEPS)
    reasons = [b["reason"] for e in env.stats.recent_runs(1)[0]["evaluations"] for b in e["branches"]]
    assert ("forecast" in reasons) == (forecast is not None), reasons
    before = weights_state(wan.diffusion_model)
    if order == "offload first":
        both = apply_cache(env.offload(wan.patcher, blocks=LAYERS))
    else:
        both = env.offload(apply_cache(wan.patcher), blocks=LAYERS)
    probe = Probe(env, both)
    out = env.tiny.sample(wan, model=probe.model, steps=STEPS)
    assert torch.equal(out, cached_alone)
    summary = probe.session(env).summary()
    assert summary["calls_skipped"] > 0 and summary["calls_computed"] > 0, summary
    assert summary["calls_skipped"] + summary["calls_computed"] == probe.calls
    assert summary["bytes_moved_on_skipped_calls"] == 0
    assert summary["block_calls"] == summary["calls_computed"] * LAYERS  # skipped calls ran no offloaded block
    assert summary["sync_loads"] == 0  # computed calls found their blocks resident or prefetched
    assert_same_state(before, weights_state(wan.diffusion_model))
    assert_unhooked(wan.diffusion_model)


def test_the_cache_runs_history_entry_carries_the_offload_summary(env, wan, forced):
    from omnitest.pack import pack_module

    probe = Probe(env, env.teacache(env.offload(wan.patcher, blocks=LAYERS)))
    env.tiny.sample(wan, model=probe.model, steps=STEPS)
    entry = pack_module("nodes.stats_store").recent_runs(1)[0]
    (feature,) = entry["features"]
    assert {k: feature[k] for k in ("kind", "node_id", "node_title")} == \
        {"kind": "offload", "node_id": "20", "node_title": "CPU Offload"}
    offload = feature["summary"]
    assert offload == probe.session(env).summary() and offload["status"] == "success"
    assert offload["bytes_moved"] > 0 and offload["bytes_moved_on_skipped_calls"] == 0
    assert offload["calls_skipped"] == entry["summary"]["reused"] > 0


def test_lora_is_bit_identical_and_a_strength_change_needs_no_reload(env, wan, forced):
    lora = tiny_lora(wan.diffusion_model)
    base_model = wan.patcher.model
    for strength in (1.0, 0.5, -0.7):
        lora_model = with_lora(wan.patcher, lora, strength)
        reference = env.tiny.sample(wan, model=lora_model, steps=STEPS)
        before = weights_state(wan.diffusion_model)   # ComfyUI's LoRA-patched weights, as it loaded them
        probe = Probe(env, env.offload(lora_model, blocks=LAYERS - 1))
        out = env.tiny.sample(wan, model=probe.model, steps=STEPS)
        assert torch.equal(out, reference), strength
        assert probe.session(env).summary()["blocks_offloaded"] == LAYERS - 1
        assert_same_state(before, weights_state(wan.diffusion_model))
        assert wan.patcher.model is base_model  # the same loaded model throughout: nothing reloaded
    assert not torch.equal(reference, env.tiny.sample(wan, steps=STEPS))  # the LoRA does change the output


def test_layers_in_comfyuis_lowvram_cast_mode_read_the_slot_and_keep_their_lora(env, wan, forced):
    """ComfyUI loads a model that does not fit in part: the rest runs in its cast mode with LoRA as weight functions.
    Emulated on the CPU with ComfyUI's own ``partially_unload``; the offloaded blocks' cast layers read the slot."""
    lora = tiny_lora(wan.diffusion_model, seed=5)
    lora_model = with_lora(wan.patcher, lora, 0.8)
    lowvram = sum(block_bytes(b) for b in wan.diffusion_model.blocks)  # most layers of every block go to cast mode
    plain = Probe(env, lora_model, lowvram_bytes=lowvram)
    reference = env.tiny.sample(wan, model=plain.model, steps=STEPS)
    assert all(plain.cast_mode_in_offloaded)
    probe = Probe(env, env.offload(lora_model, blocks=2), lowvram_bytes=lowvram)
    out = env.tiny.sample(wan, model=probe.model, steps=STEPS)
    assert all(probe.cast_mode_in_offloaded), "the emulated partial load did not reach the offloaded blocks"
    assert torch.equal(out, reference)
    assert probe.session(env).summary()["blocks_offloaded"] == 2
    assert_unhooked(wan.diffusion_model)


@pytest.mark.parametrize("with_cache", [False, True])
def test_an_interrupt_mid_run_restores_everything(env, wan, forced, with_cache):
    import comfy.model_management

    baseline = env.tiny.sample(wan, steps=STEPS)
    own_count = wan.patcher.model.model_loaded_weight_memory
    before = weights_state(wan.diffusion_model)
    model = env.offload(wan.patcher, blocks=LAYERS)
    probe = Probe(env, env.teacache(model) if with_cache else model, interrupt_at_call=3)
    with pytest.raises(comfy.model_management.InterruptProcessingException):
        env.tiny.sample(wan, model=probe.model, steps=STEPS)
    summary = probe.session(env).summary()
    assert summary["status"] == "interrupted" and summary["block_calls"] > 0
    assert_same_state(before, weights_state(wan.diffusion_model))
    assert_unhooked(wan.diffusion_model)
    assert wan.patcher.model.model_loaded_weight_memory == own_count
    assert torch.equal(env.tiny.sample(wan, steps=STEPS), baseline)


def reachable_tensor_bytes() -> int:
    """The bytes of every tensor storage Python can still reach (each storage once)."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):  # type(), not isinstance(): some objects warn on __class__
            try:
                storage = obj.untyped_storage()
                storages[(storage.device, storage.data_ptr())] = storage.nbytes()
            except (RuntimeError, NotImplementedError):
                continue  # fake/functional tensors an earlier torch.compile test left behind: they own no memory
    return sum(storages.values())


def test_repeated_runs_do_not_grow_memory(env, forced):
    """No run keeps its master copies or slots. Exact: the tensor memory Python can reach is the same after 12 runs
    (even one kept block would show). Coarse, for memory Python cannot see (e.g. page-locked buffers): the process
    grows by less than three runs' allocations (glibc's malloc makes RSS drift by about one run's worth)."""
    import statistics

    import psutil

    big = env.tiny.build_case("wan21_t2v", unet_overrides={"num_layers": 3, "dim": 256, "ffn_dim": 1024,
                                                            "num_heads": 4})
    per_block = block_bytes(big.diffusion_model.blocks[0])
    model = env.offload(big.patcher, blocks=3)
    process = psutil.Process()
    for _ in range(3):
        env.tiny.sample(big, model=model, steps=2)
    tensors_before = reachable_tensor_bytes()
    rss, sessions = [], []
    for _ in range(12):
        probe = Probe(env, model)
        env.tiny.sample(big, model=probe.model, steps=2)
        sessions.append(probe.session(env))
        gc.collect()
        rss.append(process.memory_info().rss)
    kept = reachable_tensor_bytes() - tensors_before
    assert kept < per_block, f"12 runs left {kept} bytes of tensors reachable (a block is {per_block})"
    summary = sessions[-1].summary()
    one_run = summary["offloaded_bytes"] + summary["device_bytes"]
    growth = statistics.median(rss[-4:]) - statistics.median(rss[:4])
    assert growth < 3 * one_run, f"RSS grew by {growth} bytes over 12 runs (one run allocates {one_run}): {rss}"
    for session in sessions:  # every run let go of its master copies and slots
        assert session.run._masters == [] and session.run._slots == []


def test_the_placement_is_kept_for_the_next_run_and_made_anew_for_a_lora_and_after_comfyuis_unload(env, wan, forced,
                                                                                                  monkeypatch):
    """The same model twice, then with a LoRA, then unloaded by ComfyUI and sampled again: the second run uses the
    first run's packed blocks (nothing packed), the LoRA run packs anew and says why, ComfyUI's unload frees the kept
    blocks (no tensor of them left), the next run places anew, and ComfyUI's detach of the model frees them again.
    Every latent is bit-identical to the same run without the node."""
    import weakref

    import comfy.model_management

    kept = env.session.kept
    kept.release_all()  # whatever an earlier test kept
    from omnitest.pack import pack_module

    packing = []  # the blocks the library packs into master copies
    layout = pack_module("omni_hooks.offload").BlockLayout
    pack_into = layout.pack_into
    monkeypatch.setattr(layout, "pack_into", lambda self, flat: (packing.append(1), pack_into(self, flat))[1])
    baseline = env.tiny.sample(wan, steps=STEPS)
    before = weights_state(wan.diffusion_model)
    offloaded = env.offload(wan.patcher, blocks=2)

    probes = []  # kept alive: ComfyUI's list of loaded models holds a patcher only weakly

    def run(model, reference):
        packing.clear()
        probe = Probe(env, model)
        probes.append(probe)
        assert torch.equal(env.tiny.sample(wan, model=probe.model, steps=STEPS), reference)
        summary = probe.session(env).summary()
        assert summary["kept_placement_bytes"] == summary["offloaded_bytes"] > 0
        assert kept.kept() is not None and kept.kept().packed.nbytes == summary["offloaded_bytes"]
        return summary

    first = run(offloaded, baseline)
    assert (first["placement"], first["placement_reason"]) == ("new", "first placement of this model")
    assert len(packing) == 2 and not first["packed_reused"]
    held = [weakref.ref(b.tensor) for b in kept.kept().packed.buffers]
    second = run(offloaded, baseline)
    assert (second["placement"], second["placement_reason"]) == ("kept", "kept from the last run of this model")
    assert packing == [] and second["packed_reused"] and all(ref() is not None for ref in held)

    lora_model = with_lora(offloaded, tiny_lora(wan.diffusion_model, seed=3), 0.9)
    lora_reference = env.tiny.sample(wan, model=with_lora(wan.patcher, tiny_lora(wan.diffusion_model, seed=3), 0.9),
                                     steps=STEPS)
    assert not torch.equal(lora_reference, baseline)
    third = run(lora_model, lora_reference)
    assert third["placement"] == "new" and "other weight patches on the MODEL" in third["placement_reason"]
    assert len(packing) == 2 and all(ref() is None for ref in held)  # the stale copies were freed
    held = [weakref.ref(b.tensor) for b in kept.kept().packed.buffers]

    comfy.model_management.unload_all_models()
    gc.collect()
    assert kept.kept() is None and all(ref() is None for ref in held), "ComfyUI's unload left the kept blocks"
    after_unload = run(offloaded, baseline)
    assert after_unload["placement"] == "new" and len(packing) == 2
    assert after_unload["placement_reason"] == "ComfyUI unloaded the model"
    held = [weakref.ref(b.tensor) for b in kept.kept().packed.buffers]
    loaded = [m.model for m in comfy.model_management.current_loaded_models if m.model is probes[-1].model]
    assert loaded, "the model is not among ComfyUI's loaded models"
    loaded[0].detach()  # what ComfyUI's unload calls: ON_DETACH with unpatch_all
    gc.collect()
    assert kept.kept() is None and all(ref() is None for ref in held)
    after = weights_state(wan.diffusion_model)  # ComfyUI's LoRA unpatch made new parameter objects: values only
    assert all(torch.equal(after[name][6], values[6]) for name, values in before.items())
    assert_unhooked(wan.diffusion_model)
    assert torch.equal(env.tiny.sample(wan, steps=STEPS), baseline)  # the input MODEL is untouched


def test_auto_offloads_as_few_blocks_as_the_free_memory_needs(env, wan, forced, monkeypatch):
    import comfy.model_management as mm

    per_block = block_bytes(wan.diffusion_model.blocks[0])
    reserve = int(mm.minimum_inference_memory())
    baseline = env.tiny.sample(wan, steps=STEPS)
    # prefetch 0 = one slot: n blocks offloaded need (LAYERS - n) whole blocks + 1 slot (n > 0)
    for room, expected in [(LAYERS * per_block, 0), (3.5 * per_block, 2), (2.5 * per_block, 3), (1.5 * per_block, 4)]:
        # available for the blocks = free + the blocks' bytes on the device - the activation reserve
        free = int(room) + reserve - LAYERS * per_block
        monkeypatch.setattr(mm, "get_free_memory", lambda dev=None, torch_free_too=False, free=free:
                            (free, free) if torch_free_too else free)
        probe = Probe(env, env.offload(wan.patcher, blocks=-1, prefetch=0))
        out = env.tiny.sample(wan, model=probe.model, steps=STEPS)
        summary = probe.session(env).summary()
        assert summary["blocks_offloaded"] == expected, (room / per_block, summary["notes"])
        assert torch.equal(out, baseline)
        assert any(n.startswith("auto:") for n in summary["notes"]), summary["notes"]
        assert any(n.startswith("VRAM for the blocks") for n in summary["notes"]), summary["notes"]


def test_reserve_vram_is_kept_free_and_the_note_says_so(env, wan, forced, monkeypatch):
    import comfy.model_management as mm

    per_block = block_bytes(wan.diffusion_model.blocks[0])
    free = int(mm.minimum_inference_memory())  # with the blocks' own bytes: room for all of them, whole
    monkeypatch.setattr(mm, "get_free_memory", lambda dev=None, torch_free_too=False: (free, free)
                        if torch_free_too else free)
    probe = Probe(env, env.offload(wan.patcher, blocks=-1, prefetch=0))
    env.tiny.sample(wan, model=probe.model, steps=STEPS)
    assert probe.session(env).summary()["blocks_offloaded"] == 0
    monkeypatch.setattr(mm, "EXTRA_RESERVED_VRAM", mm.EXTRA_RESERVED_VRAM + int(2.5 * per_block))  # --reserve-vram
    probe = Probe(env, env.offload(wan.patcher, blocks=-1, prefetch=0))
    env.tiny.sample(wan, model=probe.model, steps=STEPS)
    summary = probe.session(env).summary()
    # room for 1.5 blocks: one slot, no block whole (prefetch 0)
    assert summary["blocks_offloaded"] == LAYERS, summary["notes"]
    assert any("(--reserve-vram)" in n for n in summary["notes"]), summary["notes"]


def test_vram_budget_caps_what_auto_keeps_resident(env, wan, forced):
    per_block = block_bytes(wan.diffusion_model.blocks[0])
    dm = wan.diffusion_model
    outside = sum(t.numel() * t.element_size() for t in [*dm.parameters(), *dm.buffers()]) - LAYERS * per_block
    budget_gb = (outside + 2.5 * per_block) / 1024 ** 3  # 2.5 blocks: 1 slot + 1 kept block fit, with prefetch 0
    probe = Probe(env, env.offload(wan.patcher, blocks=-1, prefetch=0, budget_gb=budget_gb))
    env.tiny.sample(wan, model=probe.model, steps=STEPS)
    summary = probe.session(env).summary()
    assert summary["blocks_offloaded"] == LAYERS - 1, summary["notes"]
    assert any("vram_budget_gb" in n for n in summary["notes"]), summary["notes"]


def test_more_blocks_than_the_model_has_offloads_all_with_a_note(env, wan, forced):
    baseline = env.tiny.sample(wan, steps=STEPS)
    probe = Probe(env, env.offload(wan.patcher, blocks=40))
    assert torch.equal(env.tiny.sample(wan, model=probe.model, steps=STEPS), baseline)
    summary = probe.session(env).summary()
    assert summary["blocks_offloaded"] == LAYERS
    assert any(f"blocks_to_offload is 40 but the model has {LAYERS} blocks" in n for n in summary["notes"])


def test_zero_blocks_offloads_nothing(env, wan, forced):
    before = weights_state(wan.diffusion_model)
    probe = Probe(env, env.offload(wan.patcher, blocks=0))
    env.tiny.sample(wan, model=probe.model, steps=2)
    summary = probe.session(env).summary()
    assert summary["blocks_offloaded"] == 0 and not summary["active"] and summary["bytes_moved"] == 0
    assert summary["unchanged_reason"].startswith("blocks_to_offload is 0: nothing offloaded; set it to -1 (auto)")
    assert summary["unchanged_reason"] in summary["notes"]
    assert_same_state(before, weights_state(wan.diffusion_model))


def test_weight_hooks_that_patch_during_sampling_make_it_stand_down(env, wan, forced):
    """A hook LoRA on the conditioning (ComfyUI's Create Hook LoRA) patches weights in the middle of sampling."""
    import dataclasses

    import comfy.hooks

    hooks = comfy.hooks.create_hook_lora(tiny_lora(wan.diffusion_model, seed=7), 1.0, 0.0)
    hooked = dataclasses.replace(wan, positive=comfy.hooks.set_hooks_for_conditioning(wan.positive, hooks))
    reference = env.tiny.sample(hooked, steps=STEPS)
    assert not torch.equal(reference, env.tiny.sample(wan, steps=STEPS))  # the hook does change the output
    probe = Probe(env, env.offload(wan.patcher, blocks=LAYERS))
    assert torch.equal(env.tiny.sample(hooked, model=probe.model, steps=STEPS), reference)
    summary = probe.session(env).summary()
    assert not summary["active"] and any("weight hooks" in n for n in summary["notes"]), summary["notes"]
    assert_unhooked(wan.diffusion_model)


def test_pin_memory_on_without_cuda_is_a_note_not_a_failure(env, wan, forced):
    baseline = env.tiny.sample(wan, steps=STEPS)
    probe = Probe(env, env.offload(wan.patcher, blocks=2, pin="on"))
    assert torch.equal(env.tiny.sample(wan, model=probe.model, steps=STEPS), baseline)
    summary = probe.session(env).summary()
    assert summary["pinned_bytes"] == 0
    assert any("pinned memory needs a CUDA device" in n for n in summary["notes"]), summary["notes"]


def test_dynamic_vram_is_detected_and_left_to_comfyui(env, wan, forced, monkeypatch):
    import comfy.model_patcher

    monkeypatch.setattr(comfy.model_patcher, "ModelPatcherDynamic", comfy.model_patcher.ModelPatcher, raising=False)
    baseline = env.tiny.sample(wan, steps=STEPS)
    before = weights_state(wan.diffusion_model)
    probe = Probe(env, env.offload(wan.patcher, blocks=LAYERS))
    assert torch.equal(env.tiny.sample(wan, model=probe.model, steps=STEPS), baseline)
    summary = probe.session(env).summary()
    assert not summary["active"] and summary["bytes_moved"] == 0
    assert any("dynamic VRAM" in n and "changes nothing" in n for n in summary["notes"]), summary["notes"]
    decision = summary["takeover"]  # no figure is measured for this regime: today's outcome
    assert decision["decision"] == "stand aside" and decision["node_seconds"] is None
    assert decision["reason"].startswith("no whole-run figures are measured for this GPU and model")
    assert_same_state(before, weights_state(wan.diffusion_model))


def test_the_node_is_registered_namespaced_with_a_tooltip_on_every_input(env):
    import asyncio

    from omnitest.pack import pack_module

    schema = env.node.CPUOffload.define_schema()
    assert schema.node_id == "OmniHooks.CPUOffload"  # never core's NOP'ed "wanBlockSwap" (ComfyUI PR #10783)
    assert [i.id for i in schema.inputs] == ["model", "blocks_to_offload", "prefetch_blocks", "pin_memory",
                                              "vram_budget_gb"]
    assert all(i.tooltip for i in schema.inputs), [i.id for i in schema.inputs if not i.tooltip]
    nodes = asyncio.run(pack_module("nodes.extension").OmniHooksExtension().get_node_list())
    assert env.node.CPUOffload in nodes


def test_bad_inputs_are_clear_errors_naming_the_node(env, wan):
    with pytest.raises(ValueError, match=r"^CPU Offload: unknown pin_memory 'maybe'"):
        env.offload(wan.patcher, pin="maybe")
    with pytest.raises(ValueError, match=r"^CPU Offload: prefetch_blocks must be an integer >= 0, got -1$"):
        env.offload(wan.patcher, prefetch=-1)
    with pytest.raises(ValueError, match=r"^CPU Offload: blocks_to_offload must be an integer >= 0 or -1 \(auto\)"):
        env.offload(wan.patcher, blocks=-2)
    for budget in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match=rf"^CPU Offload: vram_budget_gb must be a finite number >= 0 or 0.0 "
                                             rf"\(auto\), got {budget}$"):
            env.offload(wan.patcher, budget_gb=budget)


def test_inputs_wrong_for_this_machine_are_clear_errors_before_anything_moves(env, wan, forced):
    import math

    import comfy.model_management

    before = weights_state(wan.diffusion_model)
    with pytest.raises(ValueError, match=rf"^CPU Offload: prefetch_blocks is {LAYERS} but this model has {LAYERS} "
                                         rf"blocks, so at most {LAYERS - 1} can be copied ahead of the one computing: "
                                         rf"set prefetch_blocks to {LAYERS - 1} or less$"):
        env.offload(wan.patcher, prefetch=LAYERS)
    elsewhere = wan.patcher.clone()
    elsewhere.load_device = torch.device("cuda", 7)  # e.g. a MODEL whose device was chosen on another machine
    with pytest.raises(ValueError, match=r"^CPU Offload: the MODEL input runs on cuda:7, which this machine does not "
                                         r"have \(CUDA devices: .*\): load the model on a device that exists$"):
        env.offload(elsewhere)
    total = comfy.model_management.get_total_memory(torch.device("cpu"))  # the forced target's memory
    beyond = math.ceil(total / 1024 ** 3) + 1
    assert beyond <= 1024, "this machine has more memory than the widget allows: nothing to check"
    with pytest.raises(ValueError, match=rf"^CPU Offload: vram_budget_gb is {beyond} but cpu has [0-9.]+ GiB in all: "
                                         rf"set at most [0-9.]+, or 0 for the VRAM ComfyUI reports free$"):
        env.offload(wan.patcher, budget_gb=float(beyond))
    assert_same_state(before, weights_state(wan.diffusion_model))
    env.offload(wan.patcher, prefetch=LAYERS - 1, budget_gb=float(beyond - 2))  # within both: accepted


def test_a_budget_is_not_checked_where_there_is_nothing_to_offload_to(env, wan):
    env.offload(wan.patcher, budget_gb=1024.0)  # ComfyUI on the CPU: the run changes nothing and says why


def test_two_cpu_offload_nodes_on_one_model_are_refused_naming_both(env, wan):
    once = env.offload(wan.patcher, node_id="30")
    with pytest.raises(env.lifecycle.FeatureConflictError, match=r"CPU Offload \(node #31\).*CPU Offload \(node #30\)"):
        env.offload(once, node_id="31")


def test_comfyuis_own_offload_streams_wait_for_the_copy_before_an_offloaded_block_runs(env, monkeypatch):
    """With --async-offload ComfyUI casts layers on its own streams, ordered after the compute stream one layer late;
    the host-streams hook orders them after the compute stream once the block is bound (it runs after the offload
    hook). Checked with stand-in streams (no CUDA here)."""
    import comfy.model_management as mm

    session = env.session
    cpu = torch.device("cpu")
    blocks = [torch.nn.Linear(4, 4) for _ in range(3)]
    seen = []

    class Stream:
        def wait_stream(self, other):
            seen.append((other, [b.weight.numel() > 0 for b in blocks]))

    monkeypatch.setitem(mm.STREAMS, cpu, [Stream(), Stream()])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "compute stream")
    from omnitest.pack import pack_module

    handle = pack_module("omni_hooks.offload").apply_layerwise_offload(blocks, cpu, prefetch_blocks=0)
    try:
        for block in blocks:
            session.HookRegistry.get_or_create(block).register_hook(session.HOST_STREAMS_HOOK,
                                                                    session.HostStreamsHook(cpu))
        blocks[2](torch.ones(1, 4))
    finally:
        for block in blocks:
            session.remove_hook_and_restore(block, session.HOST_STREAMS_HOOK)
        handle.remove()
    assert [other for other, _ in seen] == ["compute stream"] * 2
    assert all(bound[2] for _, bound in seen), "ComfyUI's streams were ordered before block 2 was bound"
    assert_unhooked(torch.nn.ModuleList(blocks))


# -- the plan, with numbers --------------------------------------------------------------------------------------------

def test_plan_offloads_the_last_blocks_and_completes_partly_loaded_ones_that_fit(env):
    F = env.placement.BlockFootprint
    plan = env.placement.plan_offload
    blocks = [F(100, 100), F(100, 40), F(100, 40), F(100, 100), F(100, 0)]
    # auto, prefetch 1: n=0 needs 500; n=1 400 + 100 = 500; n=2 300 + 200 = 500; n=3 200 + 200 = 400
    assert plan(blocks, None, 1, 450).offloaded == (2, 3, 4)
    assert plan(blocks, None, 1, 500).offloaded == ()
    full = plan(blocks, None, 1, 100)
    assert full.offloaded == (0, 1, 2, 3, 4) and any("may run out of memory" in n for n in full.notes)
    # a count: the kept blocks that were loaded in part are completed while room is left
    two = plan(blocks, 2, 1, 200 + 100 + 40 + 40 + 60)   # slots 200, kept on device 180, 60 room: one block
    assert two.offloaded == (3, 4) and two.promoted == (1,) and two.partly_streamed == (2,)
    assert two.device_bytes == 200 + 180 + 60
    assert any("stay partly on the offload device" in n for n in two.notes)
    clamped = plan(blocks, 9, 0, 10 ** 9)
    assert clamped.offloaded == (0, 1, 2, 3, 4) and clamped.slot_bytes == 100
    assert any("blocks_to_offload is 9" in n for n in clamped.notes)


def test_promotion_copies_and_undo_gives_back_the_same_storage(env):
    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    tensors = list(block.parameters())
    storages = [t.data_ptr() for t in tensors]
    values = [t.detach().clone() for t in tensors]
    promotion = env.placement.Promotion()
    # "cpu:0" is not "cpu" for a device comparison, so every tensor counts as off the device and is really copied
    moved = promotion.promote(block, torch.device("cpu", 0))
    assert moved == sum(t.numel() * 4 for t in values) == promotion.nbytes
    assert all(t.data_ptr() != ptr for t, ptr in zip(tensors, storages))
    assert all(torch.equal(t, v) for t, v in zip(tensors, values))
    promotion.undo()
    promotion.undo()  # idempotent
    assert [t.data_ptr() for t in tensors] == storages and promotion.nbytes == 0
    assert all(torch.equal(t, v) for t, v in zip(tensors, values))


@pytest.mark.parametrize("node_step", [0.5, 1.2])
def test_under_dynamic_vram_the_takeover_follows_both_whole_run_figures(env, wan, forced, monkeypatch, caplog,
                                                                        node_step):
    """Each branch of the decision forced with a regime's figures: the node's whole run (its placement counted, a
    first run) shorter than ComfyUI's by more than the spread takes the model over and offloads bit-identically;
    longer, it stands aside. The card and the log line say which, why, and both figures."""
    import comfy.model_patcher

    monkeypatch.setattr(comfy.model_patcher, "ModelPatcherDynamic", comfy.model_patcher.ModelPatcher, raising=False)
    env.session.kept.release_all()  # a first run of this model: its placement is counted
    regime = env.takeover.MeasuredRegime(node_first_start_s=2.0, node_kept_start_s=0.3, node_step_s=node_step,
                                         node_end_s=0.5, comfy_start_s=0.1, comfy_step_s=1.1, comfy_end_s=0.0,
                                         spread=0.02, source="figures forced by the test")
    asked = []
    monkeypatch.setattr(env.takeover, "measured_regime",
                        lambda device, variant: (asked.append((device, variant)), regime)[1])
    baseline = env.tiny.sample(wan, steps=STEPS)
    probe = Probe(env, env.offload(wan.patcher, blocks=LAYERS))
    with caplog.at_level(logging.INFO, logger="OmniHooks"):
        assert torch.equal(env.tiny.sample(wan, model=probe.model, steps=STEPS), baseline)
    summary = probe.session(env).summary()
    node_s, comfy_s = 2.0 + STEPS * node_step + 0.5, 0.1 + STEPS * 1.1
    take_over = node_s < comfy_s * 0.98
    assert take_over == (node_step == 0.5)
    decision = summary["takeover"]
    assert asked == [(torch.device("cpu"), wan_variant(env, wan))]
    assert decision["decision"] == ("take over" if take_over else "stand aside")
    assert (decision["steps"], decision["placement_kept"], decision["spread"]) == (STEPS, False, 0.02)
    assert decision["node_seconds"] == pytest.approx(node_s) and decision["comfy_seconds"] == pytest.approx(comfy_s)
    figures = [f"{node_s:.1f} s (2.00 s start + {STEPS} x {node_step:.3f} s + 0.50 s end)",
               f"{comfy_s:.1f} s (0.10 s start + {STEPS} x 1.100 s + 0.00 s end)", "spread 2.0%",
               "figures forced by the test", "its placement counted"]
    assert all(f in decision["reason"] for f in figures), decision["reason"]
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("OmniHooks CPU Offload")]
    verdict = "CPU Offload takes the model over" if take_over else "CPU Offload stands aside"
    assert verdict in decision["reason"] and decision["reason"] in line, line
    assert decision["reason"] in summary["notes"] or decision["reason"] in summary["unchanged_reason"]
    if take_over:
        assert summary["active"] and summary["blocks_offloaded"] == LAYERS and summary["host_streaming"] is None
    else:
        assert not summary["active"] and summary["bytes_moved"] == 0 and summary["host_streaming"] is not None
    assert_unhooked(wan.diffusion_model)


def test_under_dynamic_vram_a_kept_placement_counts_only_what_is_left_of_the_start(env, wan, forced, monkeypatch):
    """Figures where the node's whole run is longer than ComfyUI's with its placement (a first run) and shorter
    without it: it stands aside on a first run, and takes over once a legacy-path run of the same model kept its
    placement, which the take-over run then uses (nothing packed)."""
    import comfy.model_patcher

    regime = env.takeover.MeasuredRegime(node_first_start_s=2.0, node_kept_start_s=0.3, node_step_s=0.9,
                                         node_end_s=0.5, comfy_start_s=0.1, comfy_step_s=1.1, comfy_end_s=0.0,
                                         spread=0.02, source="figures forced by the test")
    monkeypatch.setattr(env.takeover, "measured_regime", lambda device, variant: regime)
    baseline = env.tiny.sample(wan, steps=STEPS)
    model = env.offload(wan.patcher, blocks=LAYERS)

    def dynamic_run():
        with monkeypatch.context() as dynamic:
            dynamic.setattr(comfy.model_patcher, "ModelPatcherDynamic", comfy.model_patcher.ModelPatcher,
                            raising=False)
            probe = Probe(env, model)
            assert torch.equal(env.tiny.sample(wan, model=probe.model, steps=STEPS), baseline)
        return probe.session(env).summary()

    env.session.kept.release_all()
    first = dynamic_run()
    assert first["takeover"]["decision"] == "stand aside" and not first["takeover"]["placement_kept"]
    assert first["takeover"]["node_seconds"] == pytest.approx(2.0 + STEPS * 0.9 + 0.5) and not first["active"]
    legacy = Probe(env, model)  # not dynamic: the node places the blocks, and keeps them
    env.tiny.sample(wan, model=legacy.model, steps=STEPS)
    assert legacy.session(env).summary()["kept_placement_bytes"] > 0
    later = dynamic_run()
    decision = later["takeover"]
    assert decision["decision"] == "take over" and decision["placement_kept"]
    assert decision["node_seconds"] == pytest.approx(0.3 + STEPS * 0.9 + 0.5)
    assert "0.30 s start" in decision["reason"] and "its placement counted" not in decision["reason"]
    assert later["active"] and later["placement"] == "kept" and later["packed_reused"]
    assert_unhooked(wan.diffusion_model)


def wan_variant(env, case) -> str:
    return env.lifecycle.detect(case.patcher).variant


@requires_comfy_class("comfy.model_patcher", "ModelPatcherDynamic")
@pytest.mark.parametrize("cache", ["teacache", "magcache"])
def test_on_dynamic_vram_offload_stands_aside_and_a_skipped_step_loads_no_weight(env, wan, forced, monkeypatch,
                                                                                 cache):
    """ComfyUI's dynamic VRAM (``ModelPatcherDynamic``) leaves every layer in its cast mode with a VRAM placeholder
    (``_v``, comfy-aimdo's reservation) and reads the layer's weight in ``comfy.ops.cast_bias_weight`` when the layer
    runs. Here the MODEL is loaded that way (the placeholders set after ComfyUI's load, as its dynamic ``load`` sets
    them; on the CPU core reads the weight on the same branch), every weight read is counted per model call: CPU
    Offload stands aside and says why, and a step the cache skips runs no block and reads none of their weights."""
    import comfy.model_patcher
    import comfy.ops
    import comfy.patcher_extension as pe

    dm = wan.diffusion_model
    apply = env.teacache if cache == "teacache" else env.magcache
    reference = env.tiny.sample(wan, model=apply(wan.patcher), steps=STEPS, cfg=1.0)
    before = weights_state(dm)
    monkeypatch.setattr(comfy.model_patcher, "ModelPatcherDynamic", comfy.model_patcher.ModelPatcher)
    block_layers = {id(m) for block in dm.blocks for m in block.modules()
                    if hasattr(m, "comfy_cast_weights") and getattr(m, "weight", None) is not None}
    calls: list[dict] = []  # per model call: weights read in the blocks and elsewhere, block layers run
    current: dict | None = None
    dynamic: list[tuple[torch.nn.Module, bool]] = []  # the layers given a placeholder, with their own cast flag
    placeholder = object()
    cast_bias_weight = comfy.ops.cast_bias_weight

    def counted_cast(s, *args, **kwargs):
        if current is not None and getattr(s, "_v", None) is placeholder:  # core's dynamic branch: read it now
            current["block reads" if id(s) in block_layers else "other reads"] += 1
        return cast_bias_weight(s, *args, **kwargs)

    def load_dynamically(executor, patcher, *args, **kwargs):
        loaded = executor(patcher, *args, **kwargs)
        for m in patcher.model.diffusion_model.modules():
            if hasattr(m, "comfy_cast_weights"):
                dynamic.append((m, m.comfy_cast_weights))
                m.comfy_cast_weights, m._v = True, placeholder
        return loaded

    def count_call(executor, *args, **kwargs):
        nonlocal current
        current = {"block reads": 0, "other reads": 0, "layers run": 0}
        try:
            return executor(*args, **kwargs)
        finally:
            calls.append(current)
            current = None

    def layer_runs(module, args):
        current["layers run"] += 1

    monkeypatch.setattr(comfy.ops, "cast_bias_weight", counted_cast)
    probe = Probe(env, env.offload(apply(wan.patcher), blocks=LAYERS))
    probe.model.add_wrapper_with_key(pe.WrappersMP.PREPARE_SAMPLING, "test.dynamic", load_dynamically)
    probe.model.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "test.count", count_call)
    # a skipped block is still called (its hook answers for it), but nothing inside it runs
    inside = [m for block in dm.blocks for m in list(block.modules())[1:]]
    handles = [m.register_forward_pre_hook(layer_runs) for m in inside]
    try:
        got = env.tiny.sample(wan, model=probe.model, steps=STEPS, cfg=1.0)
    finally:
        for handle in handles:
            handle.remove()
        for m, flag in dynamic:
            m.comfy_cast_weights = flag
            del m._v
    assert torch.equal(got, reference)
    summary = probe.session(env).summary()
    assert not summary["active"] and summary["bytes_moved"] == 0
    (note,) = [n for n in summary["notes"] if "dynamic VRAM" in n]
    assert "changes nothing" in note and "a step a cache skips runs no block" in note
    assert dynamic and len(calls) == STEPS
    skipped = [c for c in calls if c["layers run"] == 0]
    computed = [c for c in calls if c["layers run"] > 0]
    assert len(skipped) == env.stats.recent_runs(1)[0]["summary"]["reused"] > 0 and computed
    assert all(c["block reads"] == 0 for c in skipped), calls                    # no block weight read
    assert all(c["block reads"] == len(block_layers) for c in computed), calls  # each block weight once
    assert all(c["other reads"] > 0 for c in calls), calls  # core still reads the embeddings and the head
    assert_same_state(before, weights_state(dm))
    assert not any(hasattr(m, "_v") for m in dm.modules())


@requires_comfy_class("comfy.model_patcher", "ModelPatcherDynamic")
def test_on_dynamic_vram_the_card_shows_what_comfyui_kept_resident_and_streamed(env, wan, forced, monkeypatch):
    """Standing aside, the card still answers "did it help": the model's bytes, what ComfyUI's dynamic VRAM held
    resident at the first and last call (its ``loaded_size()``), and per computed step the bytes it streamed (not
    resident when the step began); a skipped step streamed no block."""
    import comfy.model_patcher

    monkeypatch.setattr(comfy.model_patcher, "ModelPatcherDynamic", comfy.model_patcher.ModelPatcher)
    model_bytes = wan.patcher.model_size()
    resident = model_bytes // 4
    monkeypatch.setattr(comfy.model_patcher.ModelPatcher, "loaded_size", lambda self: resident)
    probe = Probe(env, env.offload(env.teacache(wan.patcher), blocks=LAYERS))
    env.tiny.sample(wan, model=probe.model, steps=STEPS, cfg=1.0)
    summary = probe.session(env).summary()
    assert not summary["active"] and "dynamic VRAM" in summary["unchanged_reason"]
    host = summary.pop("host_streaming")
    assert host.pop("free_bytes_first_call") > 0  # ComfyUI's own number, whatever it is on this machine
    assert host == {"model_bytes": model_bytes, "resident_bytes_first_call": resident,
                    "resident_bytes_last_call": resident}
    steps = summary["steps"]
    assert [s["first_step"] for s in steps] == list(range(STEPS))
    skipped = [s for s in steps if s["skipped"]]
    assert skipped and all(s["not_resident_bytes"] == 0 for s in skipped)
    assert all(s["not_resident_bytes"] == model_bytes - resident for s in steps if not s["skipped"])


def test_the_card_has_per_step_bytes_and_waits_that_add_up_to_the_runs(env, wan, forced):
    """Per sampler step: the calls, the skipped ones, the bytes moved and the copy wait; with the placement's bytes
    they add up to the handle's totals, a skipped step moved nothing, and the device's weight bytes are ComfyUI's."""
    probe = Probe(env, env.teacache(env.offload(wan.patcher, blocks=LAYERS)))
    env.tiny.sample(wan, model=probe.model, steps=STEPS)
    summary = probe.session(env).summary()
    steps = summary["steps"]
    assert [s["first_step"] for s in steps] == list(range(STEPS)) == [s["last_step"] for s in steps]
    assert sum(s["calls"] for s in steps) == probe.calls
    assert sum(s["skipped"] for s in steps) == summary["calls_skipped"] > 0
    assert summary["bytes_moved_before_sampling"] + sum(s["bytes_moved"] for s in steps) == summary["bytes_moved"]
    assert summary["copy_wait_before_sampling_seconds"] + sum(s["copy_wait_seconds"] for s in steps) == \
        pytest.approx(summary["copy_wait_seconds"], abs=1e-6)
    assert all(s["bytes_moved"] == 0 for s in steps if s["skipped"] == s["calls"])
    assert all(s["bytes_moved"] > 0 and s["copy_wait_seconds"] > 0 for s in steps if s["skipped"] == 0)
    assert summary["unchanged_reason"] is None and summary["device_weight_bytes"] > 0
    assert summary["device_weight_bytes"] in probe.loaded_weight_memory  # what ComfyUI saw inside the calls


def test_a_run_that_changed_nothing_says_why(env, wan):
    probe = Probe(env, env.offload(wan.patcher))  # this ComfyUI runs on the CPU: nothing to offload to
    env.tiny.sample(wan, model=probe.model, steps=2)
    summary = probe.session(env).summary()
    assert summary["unchanged_reason"].startswith("nothing to offload to") and not summary["active"]
    assert summary["unchanged_reason"].endswith("changes nothing; it frees VRAM where ComfyUI runs the model on a GPU")
    assert summary["bytes_moved"] == 0 and [s["bytes_moved"] for s in summary["steps"]] == [0, 0]
