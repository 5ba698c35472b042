"""Configuration of block-level (layer-wise) CPU offload."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

# (name of the tensor inside its block, e.g. "attn.q.weight"; the tensor) -> True to leave it where it is
KeepResidentFn = Callable[[str, torch.Tensor], bool]


@dataclass(frozen=True)
class OffloadConfig:
    """How block-level offload places a block stack (``LayerwiseOffloadRun``), and how many blocks it takes.

    * ``prefetch_blocks`` (P >= 0): while block i computes, the next P blocks (in list order, wrapping around to the
      head of the stack for the next call) are copied ahead into device slots. The device holds ``1 + P`` block slots,
      allocated once; a block's weights stay in its slot until the slot is needed for another block. P = 0 loads each
      block when it is called (no overlap).
    * ``pin_memory``: None = pin the CPU master copies when the device is CUDA, within ``pinned_budget_bytes``;
      True = the same, but refuse a device that cannot use pinned memory; False = never pin.
    * ``pinned_budget_bytes``: the most bytes of master copies to pin (blocks in list order until it is spent; the
      rest stay pageable, and a copy from pageable memory holds up the host while it runs). None = half the machine's
      physical memory where the standard library can tell it, else nothing is pinned (a note says so).
    * ``offload_buffers``: offload the blocks' buffers too (False: buffers are left where they are).
    * ``measure_waits``: on a device with streams, time how long the computation waits for copies (CUDA timing events,
      read without blocking); without streams every copy is synchronous and timed on the host.
    * ``blocks_to_offload`` (None: as many as the device's memory needs) and ``vram_budget_bytes`` (None: the memory
      the host reports free): the caller's planner reads them to choose the blocks it gives the run (the last
      ``blocks_to_offload`` of the stack; in this pack ``nodes/offload/placement.py``).

    Frozen: built once by the caller and read unchanged by the run (``LayerwiseOffloadRun.config``) and its planner.
    What tensors stay in place (``keep_resident``) is a function of the caller's, passed to the run beside the
    config. Raises ValueError naming the field for a value no run can use; a budget in bytes is kept whole.
    """

    prefetch_blocks: int = 1
    pin_memory: bool | None = None
    pinned_budget_bytes: int | None = None
    offload_buffers: bool = True
    measure_waits: bool = True
    blocks_to_offload: int | None = None
    vram_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("prefetch_blocks", "blocks_to_offload"):
            value = getattr(self, name)
            if value is None and name == "blocks_to_offload":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                auto = " or None (auto)" if name == "blocks_to_offload" else ""
                raise ValueError(f"{name} must be an integer >= 0{auto}, got {value!r}")
        if self.pin_memory not in (None, True, False):
            raise ValueError(f"pin_memory must be None (auto), True or False, got {self.pin_memory!r}")
        for name in ("pinned_budget_bytes", "vram_budget_bytes"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0 or None (auto), got {value!r}")
            object.__setattr__(self, name, int(value))  # whole bytes
