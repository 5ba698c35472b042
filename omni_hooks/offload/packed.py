"""The packed CPU master copies of a block stack, kept after a run for the next run of the same blocks
(``PackedStack``): what makes a run's placement cost paid once.

A run packs every offloaded block into one host buffer (pinned within a budget) and, when it is removed, gives every
tensor back a fresh copy of those bytes. Until something writes those tensors again, the buffers still hold exactly
their values, so the next run of the same blocks can skip packing (and page-locking) them.
"""
from __future__ import annotations

from typing import Sequence

from .flat_buffer import BlockLayout
from .platform import HostBuffer


class PackedStack:
    """One packed master copy per block (``HostBuffer``), the layouts they were packed from, the pin plan, and each
    tensor's data pointer as the run that kept them gave the tensors back.

    ``mismatch(layouts, pin_plan)`` says why the buffers may no longer hold the blocks' current values: a block
    tensor replaced (another object), its data moved or reallocated (another pointer: ComfyUI's unload, a LoRA
    patch that replaces the weight), another dtype, shape, stride or device, another pin plan. What it cannot see is
    a write into the same memory (an in-place weight patch such as ``tensor.data.copy_(...)``, which does not even
    bump the tensor's version counter): the host drops the stack on those (``release``) from its own bookkeeping.
    The stack owns its buffers; ``release()`` frees them (page-locked ones unlocked first). Idempotent.
    """

    def __init__(self, layouts: Sequence[BlockLayout], buffers: Sequence[HostBuffer], pin_plan: Sequence[bool]):
        self.layouts = list(layouts)
        self.buffers = list(buffers)
        self.pin_plan = list(pin_plan)
        self._pointers = [[t.tensor.data_ptr() for t in layout.tensors] for layout in self.layouts]
        self.nbytes = sum(buffer.nbytes for buffer in self.buffers)
        self.pinned_bytes = sum(buffer.nbytes for buffer in self.buffers if buffer.pinned)

    @property
    def released(self) -> bool:
        return not self.buffers

    def mismatch(self, layouts: Sequence[BlockLayout], pin_plan: Sequence[bool]) -> str | None:
        """Why these buffers cannot stand for ``layouts`` packed anew under ``pin_plan`` (None: they can)."""
        if self.released:
            return "the kept master copies were freed"
        if len(layouts) != len(self.layouts):
            return f"{len(layouts)} blocks to place, {len(self.layouts)} kept"
        if list(pin_plan) != self.pin_plan:
            return "another pin plan (pin setting or pinned-memory budget)"
        for index, (now, kept, pointers) in enumerate(zip(layouts, self.layouts, self._pointers)):
            if [t.signature() for t in now.tensors] != [t.signature() for t in kept.tensors]:
                return f"block {index}'s tensors are other objects or have another dtype, shape or device"
            if [t.tensor.data_ptr() for t in now.tensors] != pointers:
                return f"block {index}'s weights were moved or replaced since the last run"
        return None

    def release(self) -> None:
        buffers, self.buffers = self.buffers, []
        for buffer in buffers:
            buffer.release()

