"""The device-specific part of offload, kept small: host buffers (pinned or not) and how a copy reaches the device.

Only CUDA (and ROCm, which torch exposes as ``cuda``) gets a copy stream, events and pinned memory. Every other
device (the CPU included, which is how the tests measure residency and bytes moved) copies synchronously, with the
same bookkeeping. Nothing here calls ``torch.cuda`` unless the target device is CUDA, so a CPU-only
torch never initializes CUDA through this module.
"""
from __future__ import annotations

import collections
import mmap
import os
import time
import weakref

import torch

PAGE_BYTES = mmap.PAGESIZE
# Timing events not yet read back; past this many the oldest is waited for, so the list stays bounded.
MAX_PENDING_TIMINGS = 1024


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def physical_memory_bytes() -> int | None:
    """The machine's physical memory where the standard library can tell it (POSIX), else None."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def pinned_size(nbytes: int) -> int:
    """The bytes page-locked for a pinned buffer of ``nbytes`` (whole pages)."""
    return round_up(max(nbytes, 1), PAGE_BYTES)


def page_lock(pointer: int, nbytes: int) -> int:
    """Page-lock ``nbytes`` of host memory at ``pointer`` for the CUDA device (``cudaHostRegister``); the CUDA error
    code, 0 on success. A failure leaves no error behind for a later CUDA call to report."""
    error = int(torch.cuda.cudart().cudaHostRegister(pointer, nbytes, 0))
    if error:
        discard_cuda_error()
    return error


def page_unlock(pointer: int) -> int:
    """Undo ``page_lock`` (``cudaHostUnregister``); the CUDA error code, 0 on success."""
    error = int(torch.cuda.cudart().cudaHostUnregister(pointer))
    if error:
        discard_cuda_error()
    return error


def is_page_locked(tensor: torch.Tensor) -> bool:
    """True when ``tensor``'s memory is host memory that someone page-locked for CUDA (its owner unlocks it, and
    must not see it freed first). Asks CUDA only where a CUDA device exists."""
    return tensor.device.type == "cpu" and torch.cuda.is_available() and tensor.is_pinned()


def discard_cuda_error() -> None:
    """Consume the error a failed CUDA runtime call left behind, which the next kernel launch would otherwise
    report as its own (a small kernel and a synchronise, whose error is dropped)."""
    if not torch.cuda.is_available():
        return
    try:
        torch.zeros(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    except RuntimeError:
        pass


def cuda_error_text(error: int) -> str:
    """``error`` as CUDA names it, e.g. "CUDA error 712 (part or all of the requested memory range is already
    mapped)"."""
    try:
        cudart = torch.cuda.cudart()
        return f"CUDA error {error} ({cudart.cudaGetErrorString(cudart.cudaError(error))})"
    except Exception:  # an unknown code, or a torch without the binding
        return f"CUDA error {error}"


class HostBuffer:
    """One flat ``uint8`` CPU buffer holding a block's master copy.

    With ``pin``, the buffer is page-locked with ``page_lock`` over whole pages that belong to it alone: exactly the
    size asked for, where torch's caching host allocator (``pin_memory=True``) rounds every allocation up to a power
    of two. Page-locking never fails the buffer: when it fails (memory already registered, a locked-memory limit, a
    driver refusal), ``pin_failure`` says why and the buffer is used as it is: page-locked when its memory already
    was (another owner's lock, never undone here), else pageable. ``pinned``: copies from it can run in the
    background. ``release()`` (or garbage collection) unlocks what this buffer locked before the memory goes.
    """

    def __init__(self, nbytes: int, pin: bool):
        self.nbytes = nbytes
        self.pinned = False
        self.pin_failure: str | None = None
        self._finalizer: weakref.finalize | None = None
        with torch.inference_mode(False):
            if not pin:
                self.tensor = torch.empty(nbytes, dtype=torch.uint8)
                return
            raw = torch.empty(nbytes + 2 * PAGE_BYTES, dtype=torch.uint8)
        start = -raw.data_ptr() % PAGE_BYTES
        pointer = raw.data_ptr() + start
        self.tensor = raw[start:start + nbytes]
        error = page_lock(pointer, pinned_size(nbytes))
        if error:
            self.pin_failure = cuda_error_text(error)
            self.pinned = is_page_locked(self.tensor)
            return
        self.pinned = True
        self._finalizer = weakref.finalize(self, _unlock, pointer, raw)
        self._finalizer.atexit = False  # at exit the process lets go of its memory anyway; CUDA may be gone by then

    def release(self) -> None:
        """Unlock (if this buffer locked it) and drop the buffer. The caller makes sure no copy from it is still in
        flight."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self.tensor = None
        self.pinned = False


def _unlock(pointer: int, keep_alive: torch.Tensor) -> None:
    error = page_unlock(pointer)
    if error:
        raise RuntimeError(f"unlocking host memory failed: {cuda_error_text(error)}")


class SyncCopies:
    """Copies for devices without streams: each runs to completion when issued, and all of its host time is time the
    computation waits (nothing overlaps it)."""

    uses_streams = False

    def __init__(self, device: torch.device, slots: int, measure_waits: bool):
        self.device = device
        self.wait_seconds = 0.0

    def copy(self, slot: int, destination: torch.Tensor, source: torch.Tensor) -> None:
        start = time.perf_counter()
        destination.copy_(source)
        self.wait_seconds += time.perf_counter() - start

    def wait_ready(self, slot: int) -> None:
        """Order the current stream after the last copy into ``slot`` (already done here)."""

    def collect(self, block: bool = False) -> float:
        return self.wait_seconds

    def drain(self) -> None:
        """Wait until no copy is in flight and the device is idle (nothing to wait for here)."""


class CudaStreamCopies:
    """Copies on one side stream per run.

    A copy into a slot first waits for the work queued on the current (compute) stream and on the stream that last
    used the slot (the same one unless the host switched streams), so the block the slot held is done with it; it
    then runs on the side stream and records the slot's ready event. Before a block runs, the current stream waits
    on its slot's event (a no-op once the copy is done). Waits are timed with timing events around the compute
    stream's wait (read back without blocking, or all at once by ``collect(block=True)``).
    """

    uses_streams = True

    def __init__(self, device: torch.device, slots: int, measure_waits: bool):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.ready = [torch.cuda.Event() for _ in range(slots)]
        self.last_user: list[torch.cuda.Stream | None] = [None] * slots
        self.measure_waits = measure_waits
        self.wait_seconds = 0.0
        self._pending: collections.deque[tuple[torch.cuda.Event, torch.cuda.Event]] = collections.deque()

    def copy(self, slot: int, destination: torch.Tensor, source: torch.Tensor) -> None:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        user = self.last_user[slot]
        if user is not None and user != current:
            self.stream.wait_stream(user)
        with torch.cuda.stream(self.stream):
            destination.copy_(source, non_blocking=True)
        self.ready[slot].record(self.stream)

    def wait_ready(self, slot: int) -> None:
        """Order the current stream after the last copy into ``slot`` and remember it as the slot's user."""
        compute = torch.cuda.current_stream(self.device)
        self.last_user[slot] = compute
        event = self.ready[slot]
        if event.query():  # the copy is done: every stream is ordered after it
            return
        if not self.measure_waits:
            compute.wait_event(event)
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(compute)
        compute.wait_event(event)
        end.record(compute)
        self._pending.append((start, end))
        self.collect()

    def collect(self, block: bool = False) -> float:
        """Add the waits whose timing events completed (all of them, waiting, with ``block``); the total so far."""
        pending = self._pending
        while pending and (block or len(pending) > MAX_PENDING_TIMINGS or pending[0][1].query()):
            start, end = pending.popleft()
            end.synchronize()
            self.wait_seconds += start.elapsed_time(end) / 1000.0
        return self.wait_seconds

    def drain(self) -> None:
        torch.cuda.synchronize(self.device)


def copies_for(device: torch.device, slots: int, measure_waits: bool) -> SyncCopies | CudaStreamCopies:
    if device.type == "cuda":
        return CudaStreamCopies(device, slots, measure_waits)
    return SyncCopies(device, slots, measure_waits)
