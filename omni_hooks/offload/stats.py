"""What one offload run did: placement, copies, residency and waiting. ``summary()`` is JSON-safe numbers."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .config import OffloadConfig

GIB = 1024 ** 3


@dataclass
class OffloadStats:
    """Counters of one ``LayerwiseOffloadRun``, updated as blocks run.

    ``config`` is the run's config, read as it is (``prefetch_blocks``). Placement (fixed when the run is applied):
      ``blocks``, ``slots`` (= min(blocks, 1 + prefetch_blocks)), ``slot_bytes`` (one slot,
      sized for the largest block), ``device_bytes`` (all slots: what the blocks hold on the device),
      ``offloaded_bytes`` (the CPU master copies), ``pinned_bytes`` / ``pinned_blocks`` (of those, page-locked),
      ``pin_failures`` (per block whose page-locking failed: its index, the error, whether its memory was
      page-locked anyway), ``locked_host_bytes`` (block weights in host memory another owner page-locked, kept as
      they are during the run), ``kept_resident_bytes`` (block tensors ``keep_resident`` left in place),
      ``uses_streams``, ``packed_reused`` (the master copies were a kept ``PackedStack``'s, not packed anew),
      ``place_seconds`` / ``restore_seconds`` (host time of ``apply()`` and of giving the tensors back in
      ``remove()``).
    Activity:
      ``block_calls`` (block forwards that ran), ``hits`` (of those, the block was on the device or being copied
      there), ``sync_loads`` (the block was not on the device and was loaded on the critical path), ``prefetches``
      (copies issued ahead of a block's call), ``copies`` (all host-to-device block copies: prefetches, sync loads and
      the loads of the stack's head), ``bytes_moved`` (their bytes; nothing is ever copied back to the CPU),
      ``peak_resident_blocks`` (most blocks on the device at once, in a slot bound or being filled),
      ``copy_wait_seconds`` (time the computation waited for copies: on CUDA measured on the compute stream,
      elsewhere every copy's host time, since copies there are synchronous).
    """

    device: str
    blocks: int
    config: OffloadConfig
    slots: int
    slot_bytes: int
    device_bytes: int
    offloaded_bytes: int
    pinned_bytes: int
    pinned_blocks: int
    kept_resident_bytes: int
    uses_streams: bool
    block_calls: int = 0
    hits: int = 0
    sync_loads: int = 0
    prefetches: int = 0
    copies: int = 0
    bytes_moved: int = 0
    peak_resident_blocks: int = 0
    copy_wait_seconds: float = 0.0
    pin_failures: list[tuple[int, str, bool]] = field(default_factory=list)
    locked_host_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    packed_reused: bool = False
    place_seconds: float = 0.0
    restore_seconds: float = 0.0

    @property
    def prefetch_blocks(self) -> int:
        return self.config.prefetch_blocks

    def summary(self) -> dict[str, Any]:
        return {
            "kind": "offload",
            "device": self.device,
            "blocks": self.blocks,
            "prefetch_blocks": self.prefetch_blocks,
            "slots": self.slots,
            "slot_bytes": self.slot_bytes,
            "device_bytes": self.device_bytes,
            "offloaded_bytes": self.offloaded_bytes,
            "pinned_bytes": self.pinned_bytes,
            "pinned_blocks": self.pinned_blocks,
            "pin_failed_blocks": len(self.pin_failures),
            "locked_host_bytes": self.locked_host_bytes,
            "kept_resident_bytes": self.kept_resident_bytes,
            "uses_streams": self.uses_streams,
            "packed_reused": self.packed_reused,
            "place_seconds": self.place_seconds,
            "restore_seconds": self.restore_seconds,
            "block_calls": self.block_calls,
            "hits": self.hits,
            "sync_loads": self.sync_loads,
            "prefetches": self.prefetches,
            "copies": self.copies,
            "bytes_moved": self.bytes_moved,
            "peak_resident_blocks": self.peak_resident_blocks,
            "copy_wait_seconds": self.copy_wait_seconds,
            "notes": list(self.notes),
        }

    def log_line(self) -> str:
        packed = "kept from the last run" if self.packed_reused else "packed"
        line = (f"offload ({self.device}, prefetch {self.prefetch_blocks}): {self.blocks} blocks in {self.slots} "
                f"slots ({self.device_bytes / GIB:.2f} GiB on the device), {self.offloaded_bytes / GIB:.2f} GiB "
                f"offloaded ({self.pinned_bytes / GIB:.2f} GiB pinned, {packed} in {self.place_seconds:.2f} s, "
                f"restored in {self.restore_seconds:.2f} s); moved {self.bytes_moved / GIB:.2f} GiB in "
                f"{self.copies} copies, {self.sync_loads} of {self.block_calls} block calls loaded on the critical "
                f"path, waited {self.copy_wait_seconds:.3f} s for copies")
        if self.notes:
            line += "; " + "; ".join(self.notes)
        return line
