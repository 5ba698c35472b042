"""Block-level offload on a real CUDA device: side stream, pinned master copies, device memory.

Skipped without CUDA (marker ``cuda``). Memory is asserted from the allocator's own counters; no timing is asserted
(speed is benchmarks/bench_offload.py's job).
"""
from __future__ import annotations

import pytest
import torch

from omni_hooks.context import CallContext
from omni_hooks.offload import apply_layerwise_offload
from omni_hooks.blockstack import StackSignal
from omni_hooks.teacache import TeaCacheConfig, apply_teacache_hook
from omnitest.offload_toys import ToyStack, block_is_resident, resident_count, toy_block_stack, toy_inputs

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")
TIMESTEPS = [1.0, 0.8, 0.6, 0.4]


def non_blocks_to(model: ToyStack, device: torch.device) -> None:
    for module in (model.embed, model.time_proj, model.tail):
        module.to(device)


def run_calls(model, x, timesteps=TIMESTEPS):
    with torch.no_grad():
        return [model(x, torch.full((x.shape[0],), ts, device=x.device)) for ts in timesteps]


def reference_outputs(dim: int, depth: int, x: torch.Tensor) -> list[torch.Tensor]:
    model = ToyStack(dim=dim, depth=depth).to(CUDA)
    return [o.cpu() for o in run_calls(model, x)]


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_outputs_match_the_resident_model_bit_for_bit_with_real_streams(prefetch):
    x = toy_inputs(dim=256, tokens=64).to(CUDA)
    reference = reference_outputs(256, 6, x)
    model = ToyStack(dim=256, depth=6)
    non_blocks_to(model, CUDA)
    seen = []
    model.probe = lambda block: seen.append((resident_count(model), block_is_resident(block)))
    handle = apply_layerwise_offload(model.blocks, CUDA, prefetch_blocks=prefetch)
    try:
        assert handle.stats.uses_streams and handle.stats.pinned_blocks == 6
        outputs = [o.cpu() for o in run_calls(model, x)]
        assert all(torch.equal(o, r) for o, r in zip(outputs, reference))
        assert all(ok for _, ok in seen) and max(count for count, _ in seen) <= 1 + prefetch
        stats = handle.collect_stats(wait=True)
        if prefetch:
            assert stats.sync_loads == 0
        assert stats.copy_wait_seconds >= 0.0
        assert all(b.lin.weight.device.type == "cuda" for b in model.blocks)  # placeholders live on the device
    finally:
        handle.remove()


def test_a_busy_non_default_compute_stream_still_sees_complete_weights():
    """Heavy blocks on a side compute stream: any missing wait between copy and compute would corrupt outputs."""
    x = toy_inputs(batch=4, dim=512, tokens=512).to(CUDA)
    reference = reference_outputs(512, 8, x)
    model = ToyStack(dim=512, depth=8)
    non_blocks_to(model, CUDA)
    handle = apply_layerwise_offload(model.blocks, CUDA, prefetch_blocks=2)
    try:
        compute = torch.cuda.Stream()
        with torch.cuda.stream(compute):
            outputs = run_calls(model, x)
        compute.synchronize()
        assert all(torch.equal(o.cpu(), r) for o, r in zip(outputs, reference))
        assert handle._copies.stream != compute and handle._copies.stream != torch.cuda.current_stream()
    finally:
        handle.remove()


def page_locked(tensor: torch.Tensor) -> bool:
    """Whether CUDA has ``tensor``'s first byte page-locked (``cudaPointerGetAttributes``: host-registered memory).
    ``Tensor.is_pinned()`` cannot tell for a master copy: it asks about the storage's first byte, and a master copy is
    the page-aligned middle of its storage, registered alone. The CUDA runtime is torch's own (the same library)."""
    import ctypes
    from pathlib import Path

    maps = Path("/proc/self/maps")
    loaded = sorted({line.split()[-1] for line in maps.read_text().splitlines()
                     if "libcudart.so" in line.split()[-1]}) if maps.exists() else []
    if len(loaded) != 1:
        pytest.skip(f"cannot name the one CUDA runtime library this process uses (found {loaded})")
    runtime = ctypes.CDLL(loaded[0])  # already loaded: the same library, the same runtime state
    attributes = (ctypes.c_int * 64)()  # cudaPointerAttributes (room to spare): its first field is the memory type
    error = runtime.cudaPointerGetAttributes(ctypes.byref(attributes), ctypes.c_void_p(tensor.data_ptr()))
    assert error == 0, error
    return attributes[0] == 1  # cudaMemoryTypeHost; 0 is unregistered (pageable) memory


def test_master_copies_are_pinned_within_the_budget():
    model = ToyStack(dim=128, depth=5)
    handle = apply_layerwise_offload(model.blocks, CUDA, prefetch_blocks=1)
    block_pinned = handle.stats.pinned_bytes // 5
    handle.remove()
    model = ToyStack(dim=128, depth=5)
    x = toy_inputs(dim=128).to(CUDA)
    reference = reference_outputs(128, 5, x)
    non_blocks_to(model, CUDA)
    handle = apply_layerwise_offload(model.blocks, CUDA, prefetch_blocks=1, pinned_budget_bytes=2 * block_pinned)
    try:
        assert [m.pinned for m in handle._masters] == [True, True, False, False, False]
        assert [page_locked(m.tensor) for m in handle._masters] == [True, True, False, False, False]
        assert handle.stats.pinned_bytes == 2 * block_pinned and handle.stats.pinned_blocks == 2
        assert any("stay pageable" in note for note in handle.stats.notes)
        assert all(torch.equal(o.cpu(), r) for o, r in zip(run_calls(model, x), reference))
    finally:
        handle.remove()
    no_pin = apply_layerwise_offload(ToyStack(dim=128, depth=5).blocks, CUDA, pin_memory=False)
    assert no_pin.stats.pinned_bytes == 0 and not any(m.pinned for m in no_pin._masters)
    no_pin.remove()


def test_device_memory_holds_one_plus_prefetch_blocks_and_remove_gives_it_back():
    model = ToyStack(dim=1024, depth=8)  # ~12.6 MB per block
    non_blocks_to(model, CUDA)
    x = toy_inputs(batch=1, tokens=16, dim=1024).to(CUDA)
    with torch.no_grad():  # cuBLAS/cuBLASLt workspaces are allocated on first use: before the baseline, not in it
        weight = torch.randn(1024, 1024, device=CUDA)
        torch.nn.functional.linear(x, weight, weight[0])
        x @ weight
        del weight
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    handle = apply_layerwise_offload(model.blocks, CUDA, prefetch_blocks=1)
    try:
        held = torch.cuda.memory_allocated() - base
        assert handle.device_bytes == 2 * handle.stats.slot_bytes
        assert 0 <= held - handle.device_bytes < 2 * 512  # the allocator rounds each slot up to 512 bytes
        torch.cuda.reset_peak_memory_stats()
        run_calls(model, x)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        block = handle.stats.slot_bytes
        assert peak < held + block, f"peak {peak} bytes above the slots ({held}) by a block or more"
    finally:
        handle.remove()
    assert torch.cuda.memory_allocated() == base  # blocks were on the CPU before: nothing of them left on the GPU


def test_blocks_resident_on_the_gpu_are_offloaded_and_restored_there():
    model = ToyStack(dim=256, depth=4).to(CUDA)
    x = toy_inputs(dim=256).to(CUDA)
    reference = [o.cpu() for o in run_calls(model, x)]
    before = {n: (p, p.detach().clone(), p.stride()) for n, p in model.named_parameters()}
    resident = torch.cuda.memory_allocated()
    handle = apply_layerwise_offload(model.blocks, CUDA, prefetch_blocks=1)
    assert torch.cuda.memory_allocated() < resident  # the blocks' own GPU storage was released
    assert all(torch.equal(o.cpu(), r) for o, r in zip(run_calls(model, x), reference))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    handle.remove()
    # the slots are let go before the blocks come back: restoring never holds both
    assert torch.cuda.max_memory_allocated() <= resident + handle.stats.slot_bytes
    for name, param in model.named_parameters():
        obj, values, stride = before[name]
        assert param is obj and param.device.type == "cuda" and param.stride() == stride
        assert torch.equal(param.detach(), values), name


def test_teacache_skips_move_nothing_on_the_gpu():
    x = toy_inputs(dim=64).to(CUDA)
    model = ToyStack(dim=64, depth=5)
    non_blocks_to(model, CUDA)
    handle = apply_layerwise_offload(model.blocks, CUDA, prefetch_blocks=1)
    config = TeaCacheConfig(threshold=0.5, coefficients=(0.0,) * 5, end_percent=0.5)
    run = apply_teacache_hook(toy_block_stack(model), config,
                              StackSignal(compute=lambda head, args, kwargs, captured: head.mod(kwargs["t"])))
    moved = []
    try:
        for step in range(8):
            before = handle.stats.bytes_moved
            context = CallContext(branches=["c"], labels=["cond"], step=step, total_steps=8)
            run.begin_call(context)
            try:
                with torch.no_grad():
                    model(x, torch.full((x.shape[0],), 1 - step / 8, device=CUDA))
            finally:
                run.end_call()
            moved.append((context.blocks_run, handle.stats.bytes_moved - before))
        assert [computed for computed, _ in moved].count(False) == 3
        assert all(nbytes == 0 for computed, nbytes in moved if not computed)
        assert all(nbytes > 0 for computed, nbytes in moved[1:] if computed)
        assert handle.stats.sync_loads == 0
    finally:
        run.remove()
        handle.remove()


def test_an_exception_inside_a_block_on_the_gpu_leaves_the_handle_usable():
    x = toy_inputs(dim=128).to(CUDA)
    reference = reference_outputs(128, 5, x)
    model = ToyStack(dim=128, depth=5)
    non_blocks_to(model, CUDA)
    handle = apply_layerwise_offload(model.blocks, CUDA, prefetch_blocks=1)
    try:
        model.blocks[4].fail_next = True
        with pytest.raises(RuntimeError, match="toy block failure"):
            run_calls(model, x, [1.0])
        handle.settle()
        assert all(torch.equal(o.cpu(), r) for o, r in zip(run_calls(model, x), reference))
    finally:
        handle.remove()
