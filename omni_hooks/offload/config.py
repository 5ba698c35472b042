"""Configuration of block-level (layer-wise) CPU offload."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# (name of the tensor inside its block, e.g. "attn.q.weight"; the tensor) -> True to leave it where it is
KeepResidentFn = Callable[[str, torch.Tensor], bool]


@dataclass(frozen=True)
class OffloadConfig:
    """How ``apply_layerwise_offload`` places a block stack.

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
    * ``blocks_to_offload`` / ``vram_budget_bytes`` / ``model_label`` / ``block_count``: what a host's planner reads
      to choose the blocks it hands to ``apply_layerwise_offload`` (None: as many as the free memory needs; None: the
      memory the host reports free) and what its statistics call the model; the run itself does not read them.

    Frozen: built once by the caller and read unchanged by the run (``LayerwiseOffloadRun.config``). What tensors
    stay in place (``keep_resident``) is a function of the caller's, passed to the run beside the config.
    """

    prefetch_blocks: int = 1
    pin_memory: bool | None = None
    pinned_budget_bytes: int | None = None
    offload_buffers: bool = True
    measure_waits: bool = True
    blocks_to_offload: int | None = None
    vram_budget_bytes: int | None = None
    model_label: str = ""
    block_count: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.prefetch_blocks, bool) or not isinstance(self.prefetch_blocks, int) \
                or self.prefetch_blocks < 0:
            raise ValueError(f"apply_layerwise_offload: prefetch_blocks must be an integer >= 0, "
                             f"got {self.prefetch_blocks!r}")
        if self.pin_memory not in (None, True, False):
            raise ValueError(f"apply_layerwise_offload: pin_memory must be None (auto), True or False, "
                             f"got {self.pin_memory!r}")
        if self.pinned_budget_bytes is not None and self.pinned_budget_bytes < 0:
            raise ValueError(f"apply_layerwise_offload: pinned_budget_bytes must be >= 0 or None (auto), "
                             f"got {self.pinned_budget_bytes!r}")
