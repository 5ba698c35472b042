"""A stand-in for CUDA's registry of page-locked host memory, so pinning and its failures run on the CPU.

``FakeHostRegistry`` replaces ``torch.cuda.cudart()`` (what ComfyUI and ``omni_hooks.offload`` page-lock with) and the
library's ``is_page_locked``, and behaves as ``cudaHostRegister`` does where it matters: a range that overlaps a
registered one is refused with error 712, chosen registrations can be refused with another error, and only a
registered range can be unregistered. ``watch_comfyui_pins`` remembers the storage behind every tensor ComfyUI pins, so
``freed_while_locked`` finds memory freed while it was still registered (the defect behind error 712 on a later
registration, and behind copies that read stale pages).
"""
from __future__ import annotations

import types

import torch
from torch.multiprocessing.reductions import StorageWeakRef

ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
MEMORY_ALLOCATION = 2     # cudaErrorMemoryAllocation: what a locked-memory limit gives
INVALID_VALUE = 1


class FakeHostRegistry:
    """Registered host ranges, keyed by start pointer, as CUDA keeps them."""

    def __init__(self):
        self.ranges: dict[int, int] = {}
        self.refuse: dict[int, int] = {}  # the n-th register call (1-based) -> the error it returns
        self.refuse_unregister: set[int] = set()  # pointers whose unregistering fails
        self.registers = 0
        self.unregistered: list[int] = []
        self.storages: dict[int, StorageWeakRef] = {}  # ranges ComfyUI registered: the storage that owns each

    # -- what cudart offers -------------------------------------------------------------------------------------------

    def cudaHostRegister(self, pointer: int, nbytes: int, flags: int) -> int:  # noqa: N802 (CUDA's name)
        self.registers += 1
        if self.registers in self.refuse:
            return self.refuse[self.registers]
        if any(pointer < start + size and start < pointer + nbytes for start, size in self.ranges.items()):
            return ALREADY_REGISTERED
        self.ranges[pointer] = nbytes
        return 0

    def cudaHostUnregister(self, pointer: int) -> int:  # noqa: N802
        if pointer in self.refuse_unregister or pointer not in self.ranges:
            return INVALID_VALUE
        del self.ranges[pointer]
        self.unregistered.append(pointer)
        return 0

    # -- for the tests -------------------------------------------------------------------------------------------------

    def is_page_locked(self, tensor: torch.Tensor) -> bool:
        pointer = tensor.data_ptr()
        return tensor.device.type == "cpu" and any(start <= pointer < start + size
                                                   for start, size in self.ranges.items())

    def install(self, monkeypatch, offload=None) -> "FakeHostRegistry":
        """Stand in for CUDA's registry in ``torch.cuda.cudart()`` and in ``offload``'s ``is_page_locked`` (the
        ``omni_hooks.offload`` package: the pack's own copy in host tests; default the importable one)."""
        if offload is None:
            import omni_hooks.offload as offload
        flat_buffer, platform = offload.flat_buffer, offload.platform
        cudart = types.SimpleNamespace(cudaHostRegister=self.cudaHostRegister,
                                       cudaHostUnregister=self.cudaHostUnregister)
        monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
        monkeypatch.setattr(platform, "is_page_locked", self.is_page_locked)
        monkeypatch.setattr(flat_buffer, "is_page_locked", self.is_page_locked)
        return self

    def lock_as_another_owner(self, tensor: torch.Tensor) -> None:
        """What ComfyUI does to a weight its partial load leaves in RAM: register the tensor's own memory."""
        assert self.cudaHostRegister(tensor.data_ptr(), tensor.untyped_storage().nbytes(), 1) == 0
        self.storages[tensor.data_ptr()] = StorageWeakRef(tensor.untyped_storage())

    def watch_comfyui_pins(self, monkeypatch) -> None:
        """Remember the storage of every tensor ComfyUI's ``pin_memory`` registers."""
        import comfy.model_management as mm

        pin_memory = getattr(mm, "pin_memory", None)
        if pin_memory is None:  # ComfyUI 0.3.64 pins nothing
            return

        def watched(tensor, *args, **kwargs):
            pinned = pin_memory(tensor, *args, **kwargs)
            if pinned:
                self.storages[tensor.data_ptr()] = StorageWeakRef(tensor.untyped_storage())
            return pinned

        monkeypatch.setattr(mm, "pin_memory", watched)

    def freed_while_locked(self) -> list[int]:
        """Pointers of ranges ComfyUI (or ``lock_as_another_owner``) registered whose memory was freed while they are
        still registered."""
        return [p for p, ref in self.storages.items() if p in self.ranges and ref.expired()]
