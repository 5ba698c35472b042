"""Page-locking that fails never fails the run, and memory another owner page-locked is never freed while locked.

CUDA's registry of page-locked memory is ``omnitest.host_memory.FakeHostRegistry``; the offload runs on the CPU, so
every byte is really packed, copied and restored.
"""
from __future__ import annotations

import pytest
import torch

from omni_hooks.offload import HostBuffer, LayerwiseOffloadRun, OffloadConfig, hooks, platform
from omnitest.host_memory import ALREADY_REGISTERED, MEMORY_ALLOCATION, FakeHostRegistry
from omnitest.offload_toys import ToyStack, toy_inputs

@pytest.fixture
def registry(monkeypatch):
    fake = FakeHostRegistry().install(monkeypatch)
    # pin on the CPU as a run pins for CUDA: within a budget, here without limit
    monkeypatch.setattr(hooks, "_pinning_policy", lambda device, config: (True, 1 << 40, []))
    return fake


def run_calls(model: ToyStack, x: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(x, torch.full((x.shape[0],), t)) for t in (1.0, 0.6, 0.2)]


def test_a_buffer_whose_locking_fails_is_pageable_and_says_why(registry):
    registry.refuse[1] = MEMORY_ALLOCATION
    buffer = HostBuffer(10_000, pin=True)
    assert not buffer.pinned and buffer.pin_failure == f"CUDA error {MEMORY_ALLOCATION}"
    buffer.tensor.fill_(3)  # usable memory
    buffer.release()
    assert registry.unregistered == []  # nothing of ours to unlock


def test_a_buffer_in_memory_locked_already_is_used_as_locked_and_never_unlocked_by_us(registry, monkeypatch):
    monkeypatch.setattr(platform, "is_page_locked", lambda tensor: True)
    registry.refuse[1] = ALREADY_REGISTERED
    buffer = HostBuffer(10_000, pin=True)
    assert buffer.pinned and buffer.pin_failure == f"CUDA error {ALREADY_REGISTERED}"
    buffer.release()
    assert registry.unregistered == []


def test_a_locked_buffer_is_unlocked_once_on_release(registry):
    buffer = HostBuffer(10_000, pin=True)
    assert buffer.pinned and buffer.pin_failure is None and len(registry.ranges) == 1
    buffer.release()
    buffer.release()
    assert registry.ranges == {} and len(registry.unregistered) == 1


@pytest.mark.parametrize("refused_block", [0, 2, 4])
def test_a_block_whose_locking_fails_runs_from_pageable_memory_bit_identically(registry, refused_block):
    model, x = ToyStack(), toy_inputs()
    reference = run_calls(model, x)
    registry.refuse[refused_block + 1] = MEMORY_ALLOCATION  # page_lock is called once per block, in order
    run = LayerwiseOffloadRun(model.blocks, "cpu", OffloadConfig(prefetch_blocks=1)).apply()
    try:
        assert all(torch.equal(a, b) for a, b in zip(run_calls(model, x), reference))
        stats = run.stats.summary()
        assert stats["pinned_blocks"] == len(model.blocks) - 1 and stats["pin_failed_blocks"] == 1
        assert run.stats.pin_failures == [(refused_block, f"CUDA error {MEMORY_ALLOCATION}", False)]
        (note,) = [n for n in stats["notes"] if "page-locking failed" in n]
        assert f"for 1 of {len(model.blocks)} blocks" in note and "pageable" in note, note
    finally:
        run.remove()
    assert registry.ranges == {}  # every buffer we locked was unlocked
    assert all(torch.equal(a, b) for a, b in zip(run_calls(model, x), reference))


def test_weights_in_memory_another_owner_locked_are_kept_and_given_back_not_freed(registry):
    """A host (ComfyUI) page-locked the RAM copies of some weights. Releasing them to placeholders must not free that
    memory while it is registered (a later allocation in that range fails with error 712, and copies from it read
    stale pages): the run keeps their data and gives that very data back."""
    model, x = ToyStack(), toy_inputs()
    reference = run_calls(model, x)
    locked = [model.blocks[3].lin.weight, model.blocks[4].norm.bias]
    for weight in locked:
        registry.lock_as_another_owner(weight.data)
    pointers = [w.data_ptr() for w in locked]
    locked_bytes = sum(w.numel() * w.element_size() for w in locked)
    run = LayerwiseOffloadRun(model.blocks, "cpu", OffloadConfig(prefetch_blocks=1)).apply()
    try:
        assert registry.freed_while_locked() == []
        assert all(torch.equal(a, b) for a, b in zip(run_calls(model, x), reference))
        stats = run.stats.summary()
        assert stats["locked_host_bytes"] == locked_bytes
        assert stats["pin_failed_blocks"] == 0  # our own buffers were fresh memory
        assert any("another owner page-locked" in n for n in stats["notes"]), stats["notes"]
    finally:
        run.remove()
    assert [w.data_ptr() for w in locked] == pointers  # the very memory back, still registered by its owner
    assert registry.freed_while_locked() == [] and set(registry.ranges) == set(pointers)
    assert all(torch.equal(a, b) for a, b in zip(run_calls(model, x), reference))
