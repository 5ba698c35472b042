"""Block-level CPU offload: run a block stack bigger than the device, one CPU master copy per block, ``1 + P`` device
slots and a look-ahead of P blocks on a copy stream (``apply_layerwise_offload``)."""
from .config import KeepResidentFn, OffloadConfig
from .flat_buffer import ALIGN_BYTES, BlockLayout, PackedTensor, Placeholders, plan_pinning, unpackable_reason
from .hooks import HOOK_NAME, LayerwiseOffloadRun, LayerwiseOffloadHook, apply_layerwise_offload
from .packed import PackedStack
from .platform import HostBuffer, physical_memory_bytes, pinned_size
from .stats import OffloadStats

__all__ = [
    "ALIGN_BYTES",
    "BlockLayout",
    "HOOK_NAME",
    "HostBuffer",
    "KeepResidentFn",
    "LayerwiseOffloadRun",
    "LayerwiseOffloadHook",
    "OffloadConfig",
    "OffloadStats",
    "PackedStack",
    "PackedTensor",
    "Placeholders",
    "apply_layerwise_offload",
    "physical_memory_bytes",
    "pinned_size",
    "plan_pinning",
    "unpackable_reason",
]
