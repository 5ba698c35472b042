"""Block-level CPU offload on the CPU: residency, bit-identical outputs, exact restore, accounting, errors.

On the CPU a "device copy" is a real copy into a slot tensor, so residency, copies and bytes moved are measured by the
same code that runs on CUDA; only streams and pinned memory are left to tests/unit/offload/test_offload_cuda.py.
"""
from __future__ import annotations

import copy
import json
import math

import psutil
import pytest
import torch

from omni_hooks import HookPhase, HookRegistry, ModelHook, module_has_active_hooks
from omni_hooks.offload import (
    ALIGN_BYTES,
    HOOK_NAME,
    LayerwiseOffloadRun,
    OffloadConfig,
    apply_layerwise_offload,
    plan_pinning,
)
from omnitest.offload_toys import ToyStack, block_is_resident, resident_count, toy_inputs

TIMESTEPS = [1.0, 0.8, 0.6, 0.4]


def run_calls(model: ToyStack, x: torch.Tensor, timesteps=TIMESTEPS) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(x, torch.full((x.shape[0],), ts)) for ts in timesteps]


def snapshot(model: torch.nn.Module) -> dict:
    """Everything ``remove()`` must give back: each tensor object, its values and its exact form."""
    out = {}
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        out[name] = (tensor, tensor.detach().clone(), tensor.dtype, tensor.device, tensor.shape, tensor.stride(),
                     tensor.requires_grad)
    return out


def assert_restored(model: torch.nn.Module, before: dict, module_dicts: dict) -> None:
    after = dict(list(model.named_parameters()) + list(model.named_buffers()))
    assert after.keys() == before.keys()
    for name, (obj, values, dtype, device, shape, stride, requires_grad) in before.items():
        tensor = after[name]
        assert tensor is obj, name
        assert (tensor.dtype, tensor.device, tensor.shape, tensor.stride(), tensor.requires_grad) == \
            (dtype, device, shape, stride, requires_grad), name
        assert torch.equal(tensor.detach(), values), name
    for module in model.modules():
        assert set(module.__dict__) == module_dicts[id(module)], type(module).__name__
        assert not module_has_active_hooks(module)


def module_dict_keys(model: torch.nn.Module) -> dict:
    return {id(m): set(m.__dict__) for m in model.modules()}


# -- outputs and residency -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("prefetch", [0, 1, 2, 4, 7])
def test_outputs_are_bit_identical_to_no_offload(prefetch):
    model, x = ToyStack(), toy_inputs()
    reference = run_calls(model, x)
    handle = apply_layerwise_offload(model.blocks, "cpu", prefetch_blocks=prefetch)
    try:
        for out, ref in zip(run_calls(model, x), reference):
            assert torch.equal(out, ref)
        assert handle.stats.block_calls == len(TIMESTEPS) * len(model.blocks)
    finally:
        handle.remove()
    for out, ref in zip(run_calls(model, x), reference):
        assert torch.equal(out, ref)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_residency_never_exceeds_one_plus_prefetch_while_a_block_computes(prefetch):
    model, x = ToyStack(depth=6), toy_inputs()
    seen = []
    model.probe = lambda block: seen.append((resident_count(model), block_is_resident(block)))
    handle = apply_layerwise_offload(model.blocks, "cpu", prefetch_blocks=prefetch)
    try:
        run_calls(model, x)
        assert len(seen) == len(TIMESTEPS) * 6
        assert all(computing_is_resident for _, computing_is_resident in seen)
        assert max(count for count, _ in seen) <= 1 + prefetch
        assert handle.stats.peak_resident_blocks == 1 + prefetch
        assert handle.stats.slots == 1 + prefetch
        # between calls the stack's head is on the device for the next call
        assert handle.resident_blocks() == sorted({0, *range(max(prefetch, 1))} | ({5} if prefetch else set()))
    finally:
        handle.remove()


def test_a_block_off_the_device_holds_zero_element_placeholders_and_fails_loudly():
    model, _ = ToyStack(), toy_inputs()
    handle = apply_layerwise_offload(model.blocks, "cpu", prefetch_blocks=1)
    try:
        block = model.blocks[2]
        assert not block_is_resident(block)
        for name, tensor in list(block.named_parameters()) + list(block.named_buffers()):
            assert tensor.numel() == 0 and tensor.device.type == "cpu", name
        assert block.gate.dtype == torch.bfloat16 and block.perm.dtype == torch.int64
        assert block.scale.dtype == torch.float64
        # called from outside the hooks' sight (the original forward, no placement hook), it cannot compute
        original = block.__dict__["_omni_original_forward"]
        with pytest.raises(RuntimeError):
            original(torch.zeros(2, 6, 16), t=torch.zeros(2, 16))
    finally:
        handle.remove()


def test_bytes_moved_and_copy_counts_are_exact():
    model, x = ToyStack(depth=5), toy_inputs()
    handle = apply_layerwise_offload(model.blocks, "cpu", prefetch_blocks=1)
    try:
        stats = handle.stats
        block_bytes = stats.offloaded_bytes // 5
        assert stats.offloaded_bytes == 5 * block_bytes  # identical blocks
        assert (stats.copies, stats.bytes_moved) == (1, block_bytes)  # the head, loaded at apply
        run_calls(model, x, [1.0])
        # every block is copied exactly once per call: 1..4 ahead of their call, 0 ahead of the next call
        assert (stats.copies, stats.bytes_moved) == (6, 6 * block_bytes)
        assert (stats.hits, stats.sync_loads, stats.prefetches) == (5, 0, 5)
        run_calls(model, x, [0.5, 0.2])
        assert (stats.copies, stats.bytes_moved) == (16, 16 * block_bytes)
        assert stats.sync_loads == 0 and stats.hits == 15
        assert stats.slot_bytes == block_bytes and stats.device_bytes == 2 * block_bytes
        assert handle.device_bytes == 2 * block_bytes
        assert stats.copy_wait_seconds > 0  # CPU copies are synchronous: all of their time is waiting
    finally:
        handle.remove()
    assert handle.device_bytes == 0


def test_a_stack_that_fits_the_slots_moves_nothing_after_its_first_call():
    model, x = ToyStack(depth=3), toy_inputs()
    handle = apply_layerwise_offload(model.blocks, "cpu", prefetch_blocks=2)
    try:
        run_calls(model, x, [1.0])
        moved = handle.stats.bytes_moved
        run_calls(model, x)
        assert handle.stats.bytes_moved == moved and handle.resident_blocks() == [0, 1, 2]
    finally:
        handle.remove()


def test_the_flat_layout_aligns_every_tensor_and_one_copy_moves_a_block():
    model = ToyStack(dim=10)
    handle = apply_layerwise_offload(model.blocks, "cpu", prefetch_blocks=1)
    try:
        layout = handle.layouts[0]
        assert all(t.offset % ALIGN_BYTES == 0 for t in layout.tensors)
        names = {t.name for t in layout.tensors}
        assert names == {"lin.weight", "lin.bias", "norm.weight", "norm.bias", "mod.weight", "mod.bias", "gate",
                         "proj", "scale", "perm"}
        last = max(layout.tensors, key=lambda t: t.offset)
        assert layout.nbytes == last.offset + last.nbytes
        # bound in its slot, the transposed projection keeps its layout, so kernels see what they saw before
        assert block_is_resident(model.blocks[0]) and model.blocks[0].proj.stride() == (1, 10)
        copies = handle.stats.copies
        run_calls(model, toy_inputs(dim=10), [1.0])
        assert handle.stats.copies - copies == len(model.blocks)  # one copy per block, not one per tensor
    finally:
        handle.remove()


# -- out of order, twice, exceptions ----------------------------------------------------------------------------------

def test_blocks_run_out_of_order_or_twice_are_loaded_synchronously_and_stay_correct():
    model, x = ToyStack(depth=5), toy_inputs()
    t = torch.zeros(2, 16)
    order = [0, 3, 3, 1, 4, 2, 0]

    def run_in(order):
        h = x
        with torch.no_grad():
            for i in order:
                h = model.blocks[i](h, t=t)
        return h

    reference = run_in(order)
    handle = apply_layerwise_offload(model.blocks, "cpu", prefetch_blocks=1)
    try:
        assert torch.equal(run_in(order), reference)
        stats = handle.stats
        assert stats.block_calls == 7
        # only the second 3 and the first 0 follow what list order predicted (3 still bound, 0 loaded at apply);
        # every other call finds a block the look-ahead did not fetch, and loads it synchronously
        assert (stats.hits, stats.sync_loads) == (2, 5)
        assert torch.equal(run_in(order), reference)
    finally:
        handle.remove()


def test_an_exception_inside_a_block_leaves_the_handle_usable_and_remove_restores_exactly():
    model, x = ToyStack(depth=5), toy_inputs()
    before, dicts = snapshot(model), module_dict_keys(model)
    reference = run_calls(model, x)
    handle = apply_layerwise_offload(model.blocks, "cpu", prefetch_blocks=2)
    for failing in (2, 4):  # in the middle, and the last block (whose post_forward would load the head)
        model.blocks[failing].fail_next = True
        with pytest.raises(RuntimeError, match="toy block failure"):
            run_calls(model, x, [1.0])
        assert max(resident_count(model), len(handle.resident_blocks())) <= 3
        for out, ref in zip(run_calls(model, x), reference):
            assert torch.equal(out, ref)
    handle.remove()
    assert_restored(model, before, dicts)


def test_after_an_exception_in_the_last_block_settle_binds_the_head_for_readers_outside_a_forward():
    model, x = ToyStack(depth=4), toy_inputs()
    handle = apply_layerwise_offload(model.blocks, "cpu", prefetch_blocks=1)
    try:
        model.blocks[3].fail_next = True
        with pytest.raises(RuntimeError):
            run_calls(model, x, [1.0])
        assert not block_is_resident(model.blocks[0])  # its copy was issued, it is not bound yet
        handle.settle()
        assert block_is_resident(model.blocks[0])
        assert handle.stats.copies == 5  # settle moved nothing more
    finally:
        handle.remove()


# -- restore --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("calls", [0, 3])
def test_remove_restores_every_tensor_exactly(calls):
    model, x = ToyStack(), toy_inputs()
    assert not model.blocks[0].proj.is_contiguous()
    before, dicts = snapshot(model), module_dict_keys(model)
    handle = apply_layerwise_offload(model.blocks, "cpu", prefetch_blocks=1)
    run_calls(model, x, TIMESTEPS[:calls])
    handle.remove()
    handle.remove()  # idempotent
    assert_restored(model, before, dicts)


def test_remove_keeps_other_hooks_on_the_blocks():
    model, x = ToyStack(), toy_inputs()
    reference = run_calls(model, x)
    seen = []

    class Counter(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            seen.append(1)
            return args, kwargs

    HookRegistry.get_or_create(model.blocks[1]).register_hook("counter", Counter())
    handle = apply_layerwise_offload(model.blocks, "cpu")
    registry = HookRegistry.get_or_create(model.blocks[1])
    assert registry.ordered_names() == ["counter", HOOK_NAME]
    assert registry.get_hook(HOOK_NAME).phase is HookPhase.PLACEMENT
    handle.remove()
    assert registry.ordered_names() == ["counter"]
    assert [torch.equal(o, r) for o, r in zip(run_calls(model, x), reference)] == [True] * 4
    assert len(seen) == 4
    registry.reset()


def test_a_failed_apply_undoes_what_it_did():
    model, _ = ToyStack(depth=4), toy_inputs()
    before, dicts = snapshot(model), module_dict_keys(model)
    handle = LayerwiseOffloadRun(model.blocks, "cpu", OffloadConfig())
    # a same-named hook appearing after validation makes registration fail on block 2, after every block was packed
    HookRegistry.get_or_create(model.blocks[2]).register_hook(HOOK_NAME, ModelHook())
    with pytest.raises(ValueError, match="already registered"):
        handle.apply()
    HookRegistry.get_or_create(model.blocks[2]).reset()
    assert_restored(model, before, dicts)


def count_packing(monkeypatch) -> list[int]:
    """The blocks packed from here on (``BlockLayout.pack_into`` calls, by layout size)."""
    from omni_hooks.offload import BlockLayout

    packed, pack_into = [], BlockLayout.pack_into
    monkeypatch.setattr(BlockLayout, "pack_into",
                        lambda self, flat: (packed.append(self.nbytes), pack_into(self, flat))[1])
    return packed


def test_kept_master_copies_are_used_by_the_next_run_of_the_same_blocks(monkeypatch):
    model, x = ToyStack(), toy_inputs()
    reference = run_calls(model, x)
    before, dicts = snapshot(model), module_dict_keys(model)
    first = LayerwiseOffloadRun(model.blocks, "cpu", OffloadConfig()).apply()
    run_calls(model, x)
    packed = first.remove(keep_packed=True)
    assert_restored(model, before, dicts)
    assert packed is first.packed and first._masters == [] and not first.stats.packed_reused
    assert packed.nbytes == first.stats.offloaded_bytes == sum(b.nbytes for b in packed.buffers)
    buffers = [b.tensor.data_ptr() for b in packed.buffers]
    packing = count_packing(monkeypatch)
    second = LayerwiseOffloadRun(model.blocks, "cpu", OffloadConfig(prefetch_blocks=2), packed=packed).apply()
    try:
        assert packing == [] and second.stats.packed_reused and second.packed_mismatch is None
        assert [m.tensor.data_ptr() for m in second._masters] == buffers and packed.released
        assert [torch.equal(o, r) for o, r in zip(run_calls(model, x), reference)] == [True] * len(TIMESTEPS)
    finally:
        assert second.remove() is None  # not kept: freed
    assert_restored(model, before, dicts)
    assert json.loads(json.dumps(second.stats.summary()))["packed_reused"] is True


@pytest.mark.parametrize("change", ["new data", "new parameter", "another dtype"])
def test_kept_master_copies_that_no_longer_match_the_blocks_are_freed_and_the_blocks_packed_anew(monkeypatch,
                                                                                                change):
    import weakref

    model, x = ToyStack(depth=4), toy_inputs()
    first = LayerwiseOffloadRun(model.blocks, "cpu", OffloadConfig()).apply()
    packed = first.remove(keep_packed=True)
    kept = [weakref.ref(b.tensor) for b in packed.buffers]
    lin = model.blocks[2].lin
    if change == "new data":  # e.g. ComfyUI's unload and reload, or a patch that replaces the weight's data
        lin.weight.data = lin.weight.data.clone()
    elif change == "new parameter":  # ComfyUI's set_attr_param (a LoRA patched or unpatched)
        lin.weight = torch.nn.Parameter(lin.weight.detach().clone(), requires_grad=False)
    else:
        model.blocks[2].to(torch.float64)
    reference = run_calls(model, x) if change != "another dtype" else None  # a float64 block cannot run here
    before = snapshot(model)
    packing = count_packing(monkeypatch)
    second = LayerwiseOffloadRun(model.blocks, "cpu", OffloadConfig(), packed=packed).apply()
    try:
        expected = ("other objects or have another dtype" if change != "new data"
                    else "block 2's weights were moved or replaced")
        assert expected in second.packed_mismatch and not second.stats.packed_reused
        assert len(packing) == 4 and packed.released
        assert all(ref() is None for ref in kept)  # the stale copies are gone before the new ones are made
        if reference is not None:
            assert [torch.equal(o, r) for o, r in zip(run_calls(model, x), reference)] == [True] * len(TIMESTEPS)
    finally:
        second.remove()
    assert_restored(model, before, module_dict_keys(model))


# -- memory -----------------------------------------------------------------------------------------------------------

def test_the_slots_are_allocated_only_after_every_block_left_the_device(monkeypatch):
    """So that apply, like remove, never holds a block's weights and the slots on the device at once."""
    import omni_hooks.offload.hooks as offload_hooks

    model = ToyStack(dim=32, depth=4)
    resident_at_slot = []
    slot = offload_hooks._Slot
    monkeypatch.setattr(offload_hooks, "_Slot",
                        lambda *a: (resident_at_slot.append(resident_count(model)), slot(*a))[1])
    handle = apply_layerwise_offload(model.blocks, "cpu", prefetch_blocks=1)
    handle.remove()
    assert resident_at_slot == [0, 0]


def test_repeated_runs_reuse_the_same_slots_and_do_not_grow_memory():
    model = ToyStack(dim=256, depth=6)
    x = toy_inputs(batch=1, tokens=4, dim=256)
    handle = apply_layerwise_offload(model.blocks, "cpu", prefetch_blocks=1)
    process = psutil.Process()
    try:
        slots = [(s.buffer.data_ptr(), s.buffer.numel()) for s in handle._slots]
        masters = [m.tensor.data_ptr() for m in handle._masters]
        inside_a_slot = []
        model.probe = lambda block: inside_a_slot.append(all(
            any(start <= p.data_ptr() < start + size for start, size in slots) for p in block.parameters()))
        run_calls(model, x, [1.0] * 10)
        rss_after_first_run = process.memory_info().rss
        for _ in range(5):
            run_calls(model, x, [1.0] * 10)
        growth = process.memory_info().rss - rss_after_first_run
        assert all(inside_a_slot) and len(inside_a_slot) == 6 * 60
        assert [(s.buffer.data_ptr(), s.buffer.numel()) for s in handle._slots] == slots
        assert [m.tensor.data_ptr() for m in handle._masters] == masters
        block_bytes = handle.stats.slot_bytes
        assert growth < block_bytes, f"RSS grew by {growth} bytes over 5 runs (a block is {block_bytes} bytes)"
    finally:
        handle.remove()


def test_the_original_block_storage_is_released_when_offloaded():
    model = ToyStack(dim=64)
    weight = model.blocks[3].lin.weight
    storage_before = weight.untyped_storage()
    handle = apply_layerwise_offload(model.blocks, "cpu")
    try:
        assert weight.untyped_storage().data_ptr() != storage_before.data_ptr()
        assert weight.numel() == 0
    finally:
        handle.remove()


# -- options -----------------------------------------------------------------------------------------------------------

def test_keep_resident_leaves_chosen_tensors_in_place_and_counts_them():
    model, x = ToyStack(), toy_inputs()
    reference = run_calls(model, x)
    mod_weights = [b.mod.weight for b in model.blocks]
    pointers = [w.data_ptr() for w in mod_weights]
    handle = apply_layerwise_offload(model.blocks, "cpu", keep_resident=lambda name, tensor: name.startswith("mod."))
    try:
        assert [w.data_ptr() for w in mod_weights] == pointers
        assert all(block.mod.weight.numel() > 0 for block in model.blocks)
        per_block = sum(t.numel() * t.element_size() for t in model.blocks[0].mod.parameters())
        assert handle.stats.kept_resident_bytes == 5 * per_block
        assert [torch.equal(o, r) for o, r in zip(run_calls(model, x), reference)] == [True] * 4
    finally:
        handle.remove()


def test_offload_buffers_false_leaves_buffers_in_place():
    model, x = ToyStack(), toy_inputs()
    reference = run_calls(model, x)
    handle = apply_layerwise_offload(model.blocks, "cpu", offload_buffers=False)
    try:
        assert all(b.scale.numel() > 0 and b.perm.numel() > 0 for b in model.blocks)
        assert not block_is_resident(model.blocks[3])
        assert [torch.equal(o, r) for o, r in zip(run_calls(model, x), reference)] == [True] * 4
    finally:
        handle.remove()


def test_applied_and_run_under_inference_mode_either_way():
    model, x = ToyStack(), toy_inputs()
    reference = run_calls(model, x)
    with torch.inference_mode():
        handle = apply_layerwise_offload(model.blocks, "cpu")
    try:
        outside = run_calls(model, x)
        with torch.inference_mode():
            inside = run_calls(model, x)
        assert all(torch.equal(o, r) for o, r in zip(outside + inside, reference + reference))
    finally:
        with torch.inference_mode():
            handle.remove()
    assert not any(p.is_inference() for p in model.parameters())
    loss = model(x, torch.ones(2)).sum()  # restored weights are ordinary tensors: autograd works
    loss.backward()
    assert model.blocks[0].lin.weight.grad is not None


def test_parameters_created_under_inference_mode_are_bound_and_restored_as_inference_tensors():
    """Hosts create parameters under inference mode (ComfyUI bakes a LoRA into a new Parameter while it loads a model
    for sampling). Such a parameter only works with inference data: given a normal tensor, every op on it fails."""
    model, x = ToyStack(), toy_inputs()
    reference = run_calls(model, x)
    with torch.inference_mode():
        for block in model.blocks[1:]:
            block.lin.weight = torch.nn.Parameter(block.lin.weight.detach().clone(), requires_grad=False)
    inference_made = [block.lin.weight for block in model.blocks[1:]]
    values = [p.detach().clone() for p in inference_made]
    handle = apply_layerwise_offload(model.blocks, "cpu", prefetch_blocks=1)
    try:
        with torch.inference_mode():
            inside = run_calls(model, x)
        outside = run_calls(model, x)
        assert all(torch.equal(o, r) for o, r in zip(inside + outside, reference + reference))
    finally:
        handle.remove()
    assert all(p.is_inference() for p in inference_made)
    assert all(torch.equal(p, v) for p, v in zip(inference_made, values))
    assert not model.blocks[0].lin.weight.is_inference()
    with torch.inference_mode():
        assert all(torch.equal(o, r) for o, r in zip(run_calls(model, x), reference))


def test_compiled_model_with_offload_matches_eager():
    model, x = ToyStack(depth=3), toy_inputs()
    reference = run_calls(model, x)
    handle = apply_layerwise_offload(model.blocks, "cpu")
    try:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="eager")
        with torch.no_grad():
            outs = [compiled(x, torch.full((2,), ts)) for ts in TIMESTEPS]
        assert all(torch.equal(o, r) for o, r in zip(outs, reference))
        assert handle.stats.block_calls == 3 * len(TIMESTEPS) and handle.stats.sync_loads == 0
    finally:
        handle.remove()
        torch._dynamo.reset()


# -- stats -------------------------------------------------------------------------------------------------------------

def test_stats_summary_is_json_safe_numbers():
    model, x = ToyStack(), toy_inputs()
    handle = apply_layerwise_offload(model.blocks, "cpu", prefetch_blocks=2)
    try:
        run_calls(model, x)
        summary = handle.stats.summary()
        assert json.loads(json.dumps(summary)) == summary
        assert summary["kind"] == "offload" and summary["device"] == "cpu"
        assert (summary["blocks"], summary["prefetch_blocks"], summary["slots"]) == (5, 2, 3)
        assert summary["pinned_bytes"] == 0 and summary["uses_streams"] is False
        for key in ("bytes_moved", "copies", "hits", "sync_loads", "prefetches", "peak_resident_blocks",
                    "copy_wait_seconds", "device_bytes", "offloaded_bytes"):
            assert isinstance(summary[key], (int, float)) and math.isfinite(summary[key]), key
        assert "prefetch 2" in handle.stats.log_line()
    finally:
        handle.remove()


def test_plan_pinning_spends_the_budget_in_list_order():
    assert plan_pinning([4, 4, 4], 8) == [True, True, False]
    assert plan_pinning([4, 8, 2], 7) == [True, False, True]
    assert plan_pinning([4], 0) == [False]


# -- errors ------------------------------------------------------------------------------------------------------------

def test_bad_arguments_raise_clear_errors_and_change_nothing():
    model = ToyStack()
    before, dicts = snapshot(model), module_dict_keys(model)
    blocks = list(model.blocks)
    with pytest.raises(ValueError, match="at least one block"):
        apply_layerwise_offload([], "cpu")
    with pytest.raises(ValueError, match="twice"):
        apply_layerwise_offload([blocks[0], blocks[0]], "cpu")
    with pytest.raises(ValueError, match="prefetch_blocks"):
        apply_layerwise_offload(blocks, "cpu", prefetch_blocks=-1)
    with pytest.raises(ValueError, match="pin_memory=True needs a CUDA device"):
        apply_layerwise_offload(blocks, "cpu", pin_memory=True)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            apply_layerwise_offload(blocks, "cuda")
    shared = copy.deepcopy(blocks[1])
    shared.lin.weight = blocks[4].lin.weight
    with pytest.raises(ValueError, match="shared with block"):
        apply_layerwise_offload(blocks + [shared], "cpu")
    assert_restored(model, before, dicts)
    handle = apply_layerwise_offload(blocks, "cpu")
    with pytest.raises(ValueError, match="already offloaded"):
        apply_layerwise_offload(blocks[3:], "cpu")
    handle.remove()
    assert_restored(model, before, dicts)


def test_a_tensor_subclass_is_refused_by_name_unless_kept_resident():
    class Marked(torch.Tensor):
        pass

    model = ToyStack()
    model.blocks[2].gate = torch.nn.Parameter(model.blocks[2].gate.detach().as_subclass(Marked))
    with pytest.raises(ValueError, match=r"block 2 \(ToyBlock\) tensor 'gate' is a Marked"):
        apply_layerwise_offload(model.blocks, "cpu")
    assert all(block_is_resident(b) for b in model.blocks)
    handle = apply_layerwise_offload(model.blocks, "cpu", keep_resident=lambda name, t: name == "gate")
    handle.remove()
