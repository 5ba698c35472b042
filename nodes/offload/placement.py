"""Where CPU Offload puts a model's blocks for one run: what each block holds and where, which blocks to stream, which
to keep whole on the device, and the copies that keep them there (torch only; the node supplies ComfyUI's numbers).

A block is "kept" when it is not offloaded. ComfyUI may have loaded a kept block only in part (its lowvram mode leaves
some layers on the offload device and copies them at every call); a kept block is "promoted" when those layers are
copied to the device for the run, so that the whole block is resident, and "partly streamed" when there is no room
for that and ComfyUI keeps copying those layers itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ...omni_hooks.offload import unpackable_reason

GIB = 1024 ** 3


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB"


def block_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of ``module`` (each tensor object once) that offload can move as plain bytes."""
    seen: set[int] = set()
    found = []
    for tensor in (*module.parameters(), *module.buffers()):
        if id(tensor) not in seen and unpackable_reason(tensor) is None:
            seen.add(id(tensor))
            found.append(tensor)
    return found


@dataclass(frozen=True)
class BlockFootprint:
    """The movable bytes of one block: all of them, and those on the compute device now."""

    nbytes: int
    device_bytes: int

    @property
    def off_device_bytes(self) -> int:
        return self.nbytes - self.device_bytes

    @classmethod
    def of(cls, module: torch.nn.Module, device: torch.device) -> "BlockFootprint":
        total = on_device = 0
        for tensor in block_tensors(module):
            nbytes = tensor.numel() * tensor.element_size()
            total += nbytes
            if tensor.device == device:
                on_device += nbytes
        return cls(nbytes=total, device_bytes=on_device)


@dataclass(frozen=True)
class OffloadPlan:
    """Which blocks (indices in execution order) a run streams and keeps, and the device bytes that takes."""

    offloaded: tuple[int, ...]         # streamed through 1 + prefetch slots (always the last blocks of the stack)
    promoted: tuple[int, ...]          # kept blocks whose off-device tensors are copied to the device for the run
    partly_streamed: tuple[int, ...]   # kept blocks left partly on the offload device (no room to promote them)
    slot_bytes: int                    # all slots together
    device_bytes: int                  # what the blocks hold on the device during the run (kept + slots)
    notes: tuple[str, ...] = ()


def slots_bytes(footprints: Sequence[BlockFootprint], count: int, prefetch_blocks: int) -> int:
    """The device bytes of the slots when the last ``count`` blocks are offloaded (each slot fits the largest)."""
    if count == 0:
        return 0
    largest = max(f.nbytes for f in footprints[len(footprints) - count:])
    return min(count, 1 + prefetch_blocks) * largest


def plan_offload(footprints: Sequence[BlockFootprint], requested: int | None, prefetch_blocks: int,
                 available: int) -> OffloadPlan:
    """The plan for a run.

    ``requested``: how many blocks to offload (clamped to the block count, with a note), or None for auto: as few as
    needed so that the kept blocks, whole, plus the slots fit in ``available`` (the device bytes the blocks may hold
    during the run). The last blocks are offloaded, so the head block (whose weights a cache may read before it runs)
    stays resident unless every block is offloaded. Kept blocks that ComfyUI loaded only in part are promoted, in
    order, while they fit in what is left of ``available``.
    """
    total = len(footprints)
    notes: list[str] = []
    whole = [f.nbytes for f in footprints]

    def kept_whole(count: int) -> int:
        return sum(whole[:total - count])

    if requested is None:
        count = next((n for n in range(total + 1)
                      if kept_whole(n) + slots_bytes(footprints, n, prefetch_blocks) <= available), None)
        if count is None:
            count = total
            notes.append(f"auto: even with all {total} blocks offloaded their slots need "
                         f"{gib(slots_bytes(footprints, total, prefetch_blocks))} but only {gib(max(available, 0))} "
                         f"is available for them: the run may run out of memory; lower prefetch_blocks or free VRAM")
        elif count == 0:
            notes.append(f"auto: all {total} blocks ({gib(kept_whole(0))}) fit in the {gib(available)} available: "
                         f"nothing offloaded")
        else:
            notes.append(f"auto: {gib(available)} available for the blocks; offloading the last {count} of {total} "
                         f"keeps {total - count} resident ({gib(kept_whole(count))}) plus "
                         f"{min(count, 1 + prefetch_blocks)} slots "
                         f"({gib(slots_bytes(footprints, count, prefetch_blocks))})")
    else:
        count = min(requested, total)
        if requested > total:
            notes.append(f"blocks_to_offload is {requested} but the model has {total} blocks: all {total} offloaded")
    offloaded = tuple(range(total - count, total))
    slot_bytes = slots_bytes(footprints, count, prefetch_blocks)
    left = available - slot_bytes - sum(f.device_bytes for f in footprints[:total - count])
    promoted, partly = [], []
    for index, f in enumerate(footprints[:total - count]):
        if f.off_device_bytes == 0:
            continue
        if f.off_device_bytes <= left:
            promoted.append(index)
            left -= f.off_device_bytes
        else:
            partly.append(index)
    if partly:
        notes.append(f"{len(partly)} of the {total - count} resident blocks do not fit whole in the VRAM left and stay "
                     f"partly on the offload device, copied layer by layer by ComfyUI at every call: offload more "
                     f"blocks (or use auto) to stream them with look-ahead instead")
    device_bytes = (slot_bytes + sum(footprints[i].device_bytes for i in range(total - count))
                    + sum(footprints[i].off_device_bytes for i in promoted))
    return OffloadPlan(offloaded=offloaded, promoted=tuple(promoted), partly_streamed=tuple(partly),
                       slot_bytes=slot_bytes, device_bytes=device_bytes, notes=tuple(notes))


class Promotion:
    """Device copies of kept blocks' off-device tensors for one run. ``undo()`` gives every tensor back the very data
    it had (same storage, device, dtype, strides): nothing is copied back."""

    def __init__(self) -> None:
        self._moved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.nbytes = 0

    def promote(self, module: torch.nn.Module, device: torch.device) -> int:
        """Copy every movable tensor of ``module`` that is not on ``device`` there; returns the bytes copied."""
        copied = 0
        with torch.no_grad():
            for tensor in block_tensors(module):
                if tensor.device == device:
                    continue
                original = tensor.data
                # a parameter made under inference mode only works with inference data (see omni_hooks.offload)
                with torch.inference_mode(tensor.is_inference()):
                    tensor.data = original.to(device, copy=True)
                self._moved.append((tensor, original))
                copied += tensor.numel() * tensor.element_size()
        self.nbytes += copied
        return copied

    def undo(self) -> None:
        """Idempotent."""
        moved, self._moved = self._moved, []
        for tensor, original in reversed(moved):
            tensor.data = original
        self.nbytes = 0
