"""CPU Offload never breaks the run: pinning that fails, weights ComfyUI page-locked, and a failure at any step of the
placement, each followed by ComfyUI's own unload and a second sample (in-process ComfyUI, on the CPU).

A GPU is emulated as in test_offload_host.py: the offload target is "cpu:0", a device that compares unequal to ComfyUI's
offload device, so every block weight counts as ComfyUI's to place, the kept blocks are completed on the "device" and
the offloaded ones really packed, released and copied. CUDA's registry of page-locked memory is a stand-in
(``omnitest.host_memory``) that ComfyUI's own pinning (0.3.75 and newer pin the weights a partial load leaves in RAM)
and the pack's both go through, with ComfyUI's pinned-memory limit switched on.
"""
from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from omnitest.comfy_path import requires_comfy_class
from omnitest.host_memory import ALREADY_REGISTERED, MEMORY_ALLOCATION, FakeHostRegistry
from omnitest.offload_probe import Probe, assert_same_state, assert_unhooked, block_bytes, weights_state

pytestmark = pytest.mark.host

STEPS = 3
LAYERS = 4
OFFLOADED = 2


@pytest.fixture(scope="module")
def env(user_dir):
    from omnitest import tiny_models
    from omnitest.pack import pack_module, run_node

    node = pack_module("nodes.offload.node")

    class Env:
        tiny = tiny_models
        lifecycle = pack_module("nodes.features")

        @staticmethod
        def offload(model, blocks=OFFLOADED, prefetch=1, pin="auto"):
            return run_node(node.CPUOffload, node_id="40", model=model, blocks_to_offload=blocks,
                            prefetch_blocks=prefetch, pin_memory=pin, vram_budget_gb=0.0)[0]

    Env.node = node
    Env.session = pack_module("nodes.offload.session")
    Env.host = pack_module("nodes.offload.host")
    Env.placement = pack_module("nodes.offload.placement")
    Env.library = pack_module("omni_hooks.offload")  # the pack's own copy of the library
    yield Env


@pytest.fixture
def wan(env):
    return env.tiny.build_case("wan21_t2v", unet_overrides={"num_layers": LAYERS})


@pytest.fixture
def gpu(env, wan, monkeypatch):
    """The offload target is "cpu:0", with VRAM for the slots and every kept block: the kept blocks are completed
    there (promoted) and the offloaded ones streamed. ComfyUI pins as it does with a GPU; CUDA's registry of
    page-locked memory is the stand-in, which the pack's pinning uses too (on every block). Every model is unloaded
    before the stand-in comes and before it goes, so that ComfyUI unpins with the registry it pinned with."""
    import comfy.model_management as mm

    mm.unload_all_models()
    monkeypatch.setattr(env.host, "offload_target", lambda patcher: torch.device("cpu", 0))
    per_block = block_bytes(wan.diffusion_model.blocks[0])
    free = int(mm.minimum_inference_memory()) + (LAYERS + 2) * per_block
    monkeypatch.setattr(mm, "get_free_memory", lambda dev=None, torch_free_too=False: (free, free)
                        if torch_free_too else free)
    registry = FakeHostRegistry().install(monkeypatch, env.library)
    registry.watch_comfyui_pins(monkeypatch)
    if hasattr(mm, "MAX_PINNED_MEMORY"):  # ComfyUI 0.3.75 and newer: pinning on, as with an NVIDIA GPU
        monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", 1 << 40)
    monkeypatch.setattr(env.library.hooks, "_pinning_policy", lambda device, config: (True, 1 << 40, []))
    yield registry
    mm.unload_all_models()


def partial_load_bytes(wan) -> int:
    """Enough for ComfyUI's partial load to leave most layers of every block in RAM (pinned, where it pins)."""
    return sum(block_bytes(b) for b in wan.diffusion_model.blocks)


def comfyui_pins(patcher) -> set[str]:
    return set(getattr(patcher, "pinned", ()))


@pytest.fixture
def pin_moves(env, monkeypatch):
    """The keys the run unpinned through ComfyUI's ``unpin_weight`` (from ``ComfyPins.release``) and pinned again
    through its ``pin_weight_to_device`` (from ``ComfyPins.restore``), each list per call of those."""
    import comfy.model_patcher

    moves = {"released": [], "restored": []}
    inside: list[list[str]] = []

    def spying(method, into: str):
        def spied(self, *args, **kwargs):
            moves[into].append([])
            inside.append(moves[into][-1])
            try:
                return method(self, *args, **kwargs)
            finally:
                inside.pop()
        return spied

    def recorded(method):
        def record(self, key, *args, **kwargs):
            if inside:
                inside[-1].append(key)
            return method(self, key, *args, **kwargs)
        return record

    patcher = comfy.model_patcher.ModelPatcher
    for name in ("unpin_weight", "pin_weight_to_device"):
        if hasattr(patcher, name):
            monkeypatch.setattr(patcher, name, recorded(getattr(patcher, name)))
    monkeypatch.setattr(env.host.ComfyPins, "release", spying(env.host.ComfyPins.release, "released"))
    monkeypatch.setattr(env.host.ComfyPins, "restore", spying(env.host.ComfyPins.restore, "restored"))
    return moves


def assert_comfyuis_pins_are_registered(patcher, gpu) -> None:
    """ComfyUI's view agrees with CUDA's: every weight ComfyUI lists as pinned has its memory registered. (Which keys
    are listed can change at any time on ComfyUI 0.33: a collected clone's finaliser unpins every weight.)"""
    import comfy.utils

    for key in comfyui_pins(patcher):
        assert comfy.utils.get_attr(patcher.model, key).data_ptr() in gpu.ranges, key


@contextlib.contextmanager
def collection_paused():
    """No garbage collection while a run places its blocks: on ComfyUI 0.33 a collected clone of the MODEL unpins
    every weight of the model (``ModelPatcher.__del__``), which would leave the run nothing of ComfyUI's to unpin."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def assert_comfyui_can_unload_and_sample_again(env, wan, baseline, lowvram) -> None:
    """ComfyUI's own unload of every model works, and the next sample, with the node, is bit-identical."""
    import comfy.model_management

    comfy.model_management.unload_all_models()
    probe = Probe(env, env.offload(wan.patcher), lowvram_bytes=lowvram)
    assert torch.equal(env.tiny.sample(wan, model=probe.model, steps=STEPS), baseline)
    assert probe.session(env).summary()["blocks_offloaded"] == OFFLOADED


def test_weights_comfyui_pinned_are_unpinned_through_it_for_the_run_and_pinned_again(env, wan, gpu, pin_moves):
    """ComfyUI's partial load page-locks the weights it leaves in RAM, each tensor's own memory. The run releases those
    tensors: without unpinning them first their memory would be freed while registered (the pack's next buffer in
    that range is refused with error 712, and copies from it read stale pages)."""
    import comfy.model_management as mm

    lowvram = partial_load_bytes(wan)
    baseline = env.tiny.sample(wan, model=Probe(env, wan.patcher, lowvram_bytes=lowvram).model, steps=STEPS)
    probe = Probe(env, env.offload(wan.patcher), lowvram_bytes=lowvram)
    with collection_paused():
        out = env.tiny.sample(wan, model=probe.model, steps=STEPS)
    assert torch.equal(out, baseline)
    summary = probe.session(env).summary()
    assert summary["blocks_offloaded"] == OFFLOADED and summary["pin_failed_blocks"] == 0
    assert summary["pinned_blocks"] == OFFLOADED and summary["locked_host_bytes"] == 0
    assert gpu.freed_while_locked() == []
    (released,) = pin_moves["released"]
    if hasattr(mm, "MAX_PINNED_MEMORY"):  # ComfyUI pins: its partial load pinned the offloaded blocks' weights
        offloaded = tuple(f"diffusion_model.blocks.{i}." for i in range(LAYERS - OFFLOADED, LAYERS))
        assert released and all(key.startswith(offloaded) for key in released), released
        assert summary["comfy_unpinned_bytes"] > 0
        assert any("unpinned through ComfyUI" in n for n in summary["notes"]), summary["notes"]
    assert pin_moves["restored"] == [released]  # pinned again, through ComfyUI
    assert_comfyuis_pins_are_registered(wan.patcher, gpu)
    assert_comfyui_can_unload_and_sample_again(env, wan, baseline, lowvram)
    assert gpu.freed_while_locked() == []


@requires_comfy_class("comfy.model_management", "pin_memory")  # 0.3.64 pins nothing
def test_weights_comfyui_could_not_unpin_are_kept_until_the_run_ends(env, wan, gpu):
    """ComfyUI's unpin fails (its unregister is refused): the memory stays registered, so the run keeps those tensors'
    data instead of freeing it, and gives that very data back."""
    lowvram = partial_load_bytes(wan)
    baseline = env.tiny.sample(wan, model=Probe(env, wan.patcher, lowvram_bytes=lowvram).model, steps=STEPS)
    gpu.refuse_unregister.update(gpu.ranges)  # every range ComfyUI holds now
    probe = Probe(env, env.offload(wan.patcher), lowvram_bytes=lowvram)
    assert torch.equal(env.tiny.sample(wan, model=probe.model, steps=STEPS), baseline)
    summary = probe.session(env).summary()
    assert summary["locked_host_bytes"] > 0 and gpu.freed_while_locked() == []
    assert any("another owner page-locked" in n for n in summary["notes"]), summary["notes"]
    gpu.refuse_unregister.clear()
    assert_comfyui_can_unload_and_sample_again(env, wan, baseline, lowvram)


@pytest.mark.parametrize("error", [ALREADY_REGISTERED, MEMORY_ALLOCATION])
def test_a_block_whose_pinning_fails_runs_from_pageable_memory_and_the_card_says_so(env, wan, gpu, error):
    lowvram = partial_load_bytes(wan)
    baseline = env.tiny.sample(wan, model=Probe(env, wan.patcher, lowvram_bytes=lowvram).model, steps=STEPS)
    before = weights_state(wan.diffusion_model)
    gpu.refuse[gpu.registers + 1] = error  # ComfyUI's partial load of the next run pins first, then the pack:
    gpu.refuse[gpu.registers + 2] = error  # refuse the first two registrations of the run, whoever asks
    probe = Probe(env, env.offload(wan.patcher), lowvram_bytes=lowvram)
    assert torch.equal(env.tiny.sample(wan, model=probe.model, steps=STEPS), baseline)
    summary = probe.session(env).summary()
    assert summary["status"] == "success" and summary["blocks_offloaded"] == OFFLOADED
    failed = summary["pin_failed_blocks"]
    assert failed >= 1 or comfyui_pins(wan.patcher), summary  # a refusal hit the pack's buffers, or ComfyUI's
    if failed:
        assert summary["pinned_blocks"] == OFFLOADED - failed
        (note,) = [n for n in summary["notes"] if "page-locking failed" in n]
        assert f"CUDA error {error}" in note and "pageable" in note, note
    assert_same_state(before, weights_state(wan.diffusion_model))
    assert_comfyui_can_unload_and_sample_again(env, wan, baseline, lowvram)


def _raise_on(calls: int):
    """A wrapper factory: the wrapped callable raises on its ``calls``-th call (earlier calls run)."""
    def wrap(original):
        count = [0]

        def failing(*args, **kwargs):
            count[0] += 1
            if count[0] == calls:
                raise RuntimeError("injected failure")
            return original(*args, **kwargs)
        return failing
    return wrap


# (what fails, where it is patched, the call that fails): every step of the placement, in the order it runs
PLACEMENT_STEPS = [
    ("unpinning ComfyUI's pins", "host.ComfyPins.release", 1),
    ("laying out the blocks", "library.LayerwiseOffloadRun.__init__", 1),
    ("a master copy's buffer", "library.HostBuffer.__init__", 2),
    ("packing a block", "flat.BlockLayout.pack_into", 2),
    ("releasing a block", "flat.BlockLayout.release", 2),
    ("the device slots", "library._Slot.__init__", 1),
    ("the copy engine", "library.copies_for", 1),
    ("a block's hook", "library.LayerwiseOffloadHook.__init__", 2),
    ("loading the stack's head", "library.LayerwiseOffloadRun._load_head", 1),
    ("ComfyUI's offload streams", "session.OffloadSession._order_host_streams", 1),
    ("completing a kept block", "placement.Promotion.promote", 2),
    ("ComfyUI's accounting", "session.OffloadSession._account", 1),
]


def _patch(env, monkeypatch, where: str, wrap) -> None:
    modules = {"host": env.host, "library": env.library.hooks, "flat": env.library.flat_buffer, "session": env.session,
               "placement": env.placement}
    module_name, *path = where.split(".")
    owner = modules[module_name]
    for name in path[:-1]:
        owner = getattr(owner, name)
    monkeypatch.setattr(owner, path[-1], wrap(getattr(owner, path[-1])))


@pytest.mark.parametrize("what,where,call", PLACEMENT_STEPS, ids=[step[0] for step in PLACEMENT_STEPS])
def test_a_failure_at_any_step_of_the_placement_restores_everything_and_the_run_goes_on(env, wan, gpu, monkeypatch,
                                                                                       pin_moves, what, where, call):
    lowvram = partial_load_bytes(wan)
    baseline = env.tiny.sample(wan, model=Probe(env, wan.patcher, lowvram_bytes=lowvram).model, steps=STEPS)
    before = weights_state(wan.diffusion_model)
    own_count = wan.patcher.model.model_loaded_weight_memory
    with monkeypatch.context() as injected:
        _patch(env, injected, where, _raise_on(call))
        probe = Probe(env, env.offload(wan.patcher), lowvram_bytes=lowvram)
        out = env.tiny.sample(wan, model=probe.model, steps=STEPS)
    assert torch.equal(out, baseline)  # the run went on as ComfyUI loaded the model
    summary = probe.session(env).summary()
    assert summary["status"] == "success" and not summary["active"], summary
    assert summary["unchanged_reason"].startswith("placing the blocks failed (RuntimeError: injected failure)")
    assert summary["blocks_offloaded"] == 0 and summary["device_bytes"] == 0
    assert_same_state(before, weights_state(wan.diffusion_model))
    assert_unhooked(wan.diffusion_model)
    released = [key for keys in pin_moves["released"] for key in keys]
    assert [key for keys in pin_moves["restored"] for key in keys] == released  # unpinned, then pinned again
    assert_comfyuis_pins_are_registered(wan.patcher, gpu)
    assert gpu.freed_while_locked() == []
    assert wan.patcher.model.model_loaded_weight_memory == own_count
    assert_comfyui_can_unload_and_sample_again(env, wan, baseline, lowvram)


@pytest.mark.parametrize("where", ["library.LayerwiseOffloadRun.__init__", "flat.BlockLayout.release"])
def test_a_failure_while_placing_with_the_last_runs_blocks_frees_them(env, wan, gpu, monkeypatch, where):
    """A run given the blocks the last run kept fails before its run exists (laying out the blocks) or once it owns
    them (releasing a block): either way the kept blocks are freed at once, none of their page-locked memory is left
    registered, and the run goes on as ComfyUI loaded the model."""
    import weakref

    lowvram = partial_load_bytes(wan)
    baseline = env.tiny.sample(wan, model=Probe(env, wan.patcher, lowvram_bytes=lowvram).model, steps=STEPS)
    model = env.offload(wan.patcher)
    first = Probe(env, model, lowvram_bytes=lowvram)
    assert torch.equal(env.tiny.sample(wan, model=first.model, steps=STEPS), baseline)
    kept = env.session.kept.kept()
    assert kept is not None and kept.packed.pinned_bytes > 0
    held = [(weakref.ref(b.tensor), b.tensor.data_ptr()) for b in kept.packed.buffers]
    assert all(pointer in gpu.ranges for _, pointer in held)
    del kept
    with monkeypatch.context() as injected:
        _patch(env, injected, where, _raise_on(1))
        probe = Probe(env, model, lowvram_bytes=lowvram)
        assert torch.equal(env.tiny.sample(wan, model=probe.model, steps=STEPS), baseline)
        assert all(ref() is None for ref, _ in held), "the kept blocks outlived the failed placement"
    summary = probe.session(env).summary()
    assert summary["unchanged_reason"].startswith("placing the blocks failed (RuntimeError: injected failure)")
    assert env.session.kept.kept() is None and summary["kept_placement_bytes"] == 0
    assert not any(pointer in gpu.ranges for _, pointer in held)
    assert gpu.freed_while_locked() == []
    assert_unhooked(wan.diffusion_model)
    assert_comfyui_can_unload_and_sample_again(env, wan, baseline, lowvram)


def test_an_interrupt_while_placing_is_undone_and_reaches_comfyui(env, wan, gpu, monkeypatch):
    import comfy.model_management

    lowvram = partial_load_bytes(wan)
    baseline = env.tiny.sample(wan, model=Probe(env, wan.patcher, lowvram_bytes=lowvram).model, steps=STEPS)
    before = weights_state(wan.diffusion_model)

    def interrupt(original):
        def interrupted(*args, **kwargs):
            raise comfy.model_management.InterruptProcessingException()
        return interrupted

    with monkeypatch.context() as injected:
        _patch(env, injected, "placement.Promotion.promote", interrupt)
        probe = Probe(env, env.offload(wan.patcher), lowvram_bytes=lowvram)
        with pytest.raises(comfy.model_management.InterruptProcessingException):
            env.tiny.sample(wan, model=probe.model, steps=STEPS)
    assert probe.session(env).summary()["status"] == "interrupted"
    assert_same_state(before, weights_state(wan.diffusion_model))
    assert_unhooked(wan.diffusion_model)
    assert gpu.freed_while_locked() == []
    assert_comfyui_can_unload_and_sample_again(env, wan, baseline, lowvram)
