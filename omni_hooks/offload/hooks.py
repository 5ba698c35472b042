"""Block-level CPU offload: one CPU master copy per block, ``1 + P`` device slots, a look-ahead of P blocks.

After vllm-omni's ``LayerwiseOffloadHook``, re-implemented with its limits designed out:
  * every block, the first included, has one CPU master copy in a flat buffer (pinned within a budget); weights are
    immutable at inference, so nothing is ever copied back: a block leaves the device by having its tensors
    released to 0-element placeholders;
  * the device holds ``1 + P`` fixed slots, allocated once, each sized for the largest block; a block keeps its slot
    until the slot is needed, so a stack of at most ``1 + P`` blocks moves nothing after its first call;
  * hooks are of the placement phase and only use pre/post_forward, so a cache that passes the stack through runs no
    offload hook and moves no weights (``omni_hooks.base``);
  * blocks may run out of order or twice: a block found off the device is loaded synchronously (``sync_loads``).

Per block call i (blocks in execution order, P = ``prefetch_blocks``):
  pre_forward:  bind block i (loading it first if it is not on the device), then start copying the next P blocks
                (i+1 .. i+P, wrapping around to the head of the stack) into the slots no block of that window holds;
  post_forward: after the last block, bind the head blocks (0 .. max(P, 1) - 1) for the next call, so a cache that
                reads the head block's weights before it runs finds them ready, and a skipped call finds the stack
                exactly as the last computed call left it.
A block being copied keeps its placeholders until it is bound (its copy is waited for on the current stream), so
no code can read a half-copied weight: it reads a 0-element tensor and fails loudly instead. ``settle()`` binds
every block being copied (e.g. before reading weights outside a forward after an exception interrupted a call).
Streams: the blocks of one call run on the stream current at their calls; a later call may use another stream.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..base import REGISTRY_ATTR, HookPhase, HookRegistry, ModelHook, remove_hook_and_restore
from .config import KeepResidentFn, OffloadConfig
from .flat_buffer import BlockLayout, Placeholders, plan_pinning
from .packed import PackedStack
from .platform import HostBuffer, copies_for, physical_memory_bytes, pinned_size
from .stats import GIB, OffloadStats

HOOK_NAME = "layerwise_offload"


@dataclass
class _Slot:
    """One fixed device buffer and the block it holds (``bound``: that block's tensors are views into it)."""

    buffer: torch.Tensor
    block: int | None = None
    bound: bool = False
    last_used: int = 0


class LayerwiseOffloadHook(ModelHook):
    """On block ``index``: bind it before its real forward, keep the stack's head ready after the last block."""

    phase = HookPhase.PLACEMENT

    def __init__(self, run: "LayerwiseOffloadRun", index: int):
        self.run = run
        self.index = index

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        self.run.before_block(self.index)
        return args, kwargs

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        self.run.after_block(self.index)
        return output


class LayerwiseOffloadRun:
    """Block-level offload of one block stack (``apply_layerwise_offload`` makes and applies one).

    While applied, a block's offloaded tensors are views into a device slot or 0-element placeholders; every other
    tensor of the model is left where it is (the caller puts non-block modules and ``keep_resident`` tensors on the
    device, and must not move or replace block tensors itself). ``remove()`` restores every tensor exactly (same
    object, original device, dtype, shape, strides and values) and unregisters the hooks; ``remove(keep_packed=True)``
    hands the master copies over as a ``PackedStack`` instead of freeing them, and a later run of the same blocks
    given that stack (``packed``) uses them instead of packing the blocks anew, where they still hold the blocks'
    values (``PackedStack.mismatch``; else it frees them and packs anew, ``packed_mismatch`` saying why). The run owns
    a stack it is given from then on.
    """

    def __init__(self, blocks: Sequence[torch.nn.Module], device: torch.device | str, config: OffloadConfig,
                 keep_resident: KeepResidentFn | None = None, packed: PackedStack | None = None):
        self.blocks = list(blocks)
        self.config = config  # the caller's frozen config, read unchanged
        self.device = _resolve_device(device)
        self.layouts = _layouts(self.blocks, keep_resident, config.offload_buffers)
        slot_count = min(len(self.blocks), 1 + config.prefetch_blocks)
        slot_bytes = max(layout.nbytes for layout in self.layouts)
        pin, budget, notes = _pinning_policy(self.device, config)
        sizes = [pinned_size(layout.nbytes) for layout in self.layouts]
        self._pin_plan = plan_pinning(sizes, budget) if pin else [False] * len(self.layouts)
        if pin and not all(self._pin_plan):
            notes.append(f"{self._pin_plan.count(False)} of {len(self.blocks)} blocks stay pageable (pinned-memory "
                         f"budget {budget} bytes)")
        self._stats = OffloadStats(
            device=str(self.device), blocks=len(self.blocks), config=config,
            slots=slot_count, slot_bytes=slot_bytes, device_bytes=slot_count * slot_bytes,
            offloaded_bytes=sum(layout.nbytes for layout in self.layouts), pinned_bytes=0, pinned_blocks=0,
            kept_resident_bytes=sum(layout.kept_bytes for layout in self.layouts),
            uses_streams=self.device.type == "cuda", notes=notes)
        self._pinned_sizes = sizes
        self._given = packed
        self.packed_mismatch: str | None = None  # why a given stack was not used (None: used, or none given)
        self.packed: PackedStack | None = None   # the master copies ``remove(keep_packed=True)`` kept
        self._slot_count = slot_count
        self._slots: list[_Slot] = []
        self._slot_of: list[int | None] = [None] * len(self.blocks)
        self._masters: list[HostBuffer] = []
        # per block, the data of tensors whose host memory another owner page-locked: kept alive until ``remove``
        # gives it back, so that memory is never freed while it is registered
        self._locked_data: list[list[torch.Tensor | None]] = []
        self._views: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._placeholders = Placeholders(self.device)
        self._copies = None
        self._hooked: list[torch.nn.Module] = []
        self._tick = 0
        self._applied = False
        self._removed = False
        # What the hooks call, kept out of torch.compile graphs: they rebind tensors and touch streams.
        self.before_block = torch.compiler.disable(self._before_block)
        self.after_block = torch.compiler.disable(self._after_block)

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def apply(self) -> "LayerwiseOffloadRun":
        """Pack every block into its master copy, release it from wherever it was, register the hooks and load the
        stack's head. On any error everything done so far is undone and the error propagates."""
        if self._applied:
            raise RuntimeError("LayerwiseOffloadRun: this run is already applied")
        self._applied = True
        started = time.perf_counter()
        reused = self._take_given()
        try:
            for index, (layout, pin) in enumerate(zip(self.layouts, self._pin_plan)):
                master = reused.pop(0) if reused else HostBuffer(layout.nbytes, pin)
                try:
                    if not self._stats.packed_reused:
                        layout.pack_into(master.tensor)
                    locked = layout.page_locked_data()
                except BaseException:
                    master.release()
                    raise
                self._count_pinning(index, master)
                self._masters.append(master)  # from here on, teardown restores this block from its master
                self._locked_data.append(locked)
                layout.release(self._placeholders)
            self._note_pinning()
            # the slots only once the blocks have left the device, so that it never holds both (as in teardown)
            with torch.inference_mode(False):
                self._slots = [_Slot(torch.empty(self._stats.slot_bytes, dtype=torch.uint8, device=self.device))
                               for _ in range(self._slot_count)]
            self._copies = copies_for(self.device, self._slot_count, self.config.measure_waits)
            for index, block in enumerate(self.blocks):
                hook = LayerwiseOffloadHook(self, index)
                self._hooked.append(block)  # first: teardown restores a block whose registry was made but not filled
                HookRegistry.get_or_create(block).register_hook(HOOK_NAME, hook)
            self._load_head()
        except BaseException:
            for rest in reused:  # a given stack's buffers of blocks not reached
                rest.release()
            self._teardown()
            raise
        self._stats.place_seconds = time.perf_counter() - started
        return self

    def remove(self, keep_packed: bool = False) -> PackedStack | None:
        """Unregister the hooks and restore every offloaded tensor exactly; frees the slots and the master copies, or
        with ``keep_packed`` returns the master copies as a ``PackedStack`` (also ``self.packed``) for the next run of
        these blocks. Idempotent; the run cannot be applied again."""
        if self._removed or not self._applied:
            self._removed = True
            return self.packed
        self._teardown(keep_packed)
        return self.packed

    def _take_given(self) -> list[HostBuffer]:
        """The given stack's buffers when they stand for this run's blocks (the stack is then empty); else the stack
        is freed, before any new buffer is allocated, and ``packed_mismatch`` says why."""
        given, self._given = self._given, None
        if given is None:
            return []
        self.packed_mismatch = given.mismatch(self.layouts, self._pin_plan)
        if self.packed_mismatch is not None:
            given.release()
            return []
        buffers, given.buffers = given.buffers, []
        self._stats.packed_reused = True
        return buffers

    def _teardown(self, keep_packed: bool = False) -> None:
        self._removed = True
        if self._copies is not None:
            self._copies.drain()
            self._stats.copy_wait_seconds = self._copies.collect(block=True)
        for block in reversed(self._hooked):
            remove_hook_and_restore(block, HOOK_NAME)
        self._hooked.clear()
        # let go of the slots before the blocks come back, so the device never holds both
        for slot in self._slots:
            if slot.bound:
                self.layouts[slot.block].release(self._placeholders)
        self._views.clear()
        self._slots.clear()
        self._slot_of = [None] * len(self.blocks)
        started = time.perf_counter()
        for layout, master, locked in zip(self.layouts, self._masters, self._locked_data):
            layout.restore(master.tensor, locked)
        self._stats.restore_seconds = time.perf_counter() - started
        if keep_packed and len(self._masters) == len(self.layouts):
            self.packed = PackedStack(self.layouts, self._masters, self._pin_plan)
        else:
            for master in self._masters:
                master.release()
        self._masters = []
        self._locked_data.clear()

    def __enter__(self) -> "LayerwiseOffloadRun":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.remove()

    def _count_pinning(self, index: int, master: HostBuffer) -> None:
        if master.pinned:
            self._stats.pinned_blocks += 1
            self._stats.pinned_bytes += self._pinned_sizes[index]
        if master.pin_failure is not None:
            self._stats.pin_failures.append((index, master.pin_failure, master.pinned))

    def _note_pinning(self) -> None:
        """One note for the blocks whose page-locking failed, and one for memory kept because another owner
        page-locked it."""
        failures = self._stats.pin_failures
        if failures:
            errors = sorted({error for _, error, _ in failures})
            locked = sum(pinned for *_, pinned in failures)
            how = (f"{locked} of them were page-locked already (another owner's lock, used as is), "
                   f"{len(failures) - locked} copy from pageable memory" if locked else "they copy from pageable "
                   "memory (each copy holds up the host while it runs)")
            self._stats.notes.append(f"page-locking failed for {len(failures)} of {len(self.blocks)} blocks "
                                     f"({'; '.join(errors)}): {how}")
        kept = sum(t.numel() * t.element_size() for data in self._locked_data for t in data if t is not None)
        if kept:
            self._stats.locked_host_bytes = kept
            self._stats.notes.append(f"{kept / GIB:.2f} GiB of the blocks' weights were in host memory that another "
                                     "owner page-locked: kept as they are until the run ends (never freed while "
                                     "locked)")

    # -- what a host can ask ----------------------------------------------------------------------------------------

    @property
    def device_bytes(self) -> int:
        """Bytes the blocks hold on the device (all slots; fixed while applied, 0 once removed)."""
        return 0 if self._removed or not self._applied else self._stats.device_bytes

    def resident_blocks(self) -> list[int]:
        """Indices of the blocks whose tensors are bound to a device slot now."""
        return sorted(slot.block for slot in self._slots if slot.bound)

    @property
    def stats(self) -> OffloadStats:
        """The live stats, with the copy waits measured so far (reading them never waits for the device)."""
        return self.collect_stats(wait=False)

    def collect_stats(self, wait: bool = False) -> OffloadStats:
        """The stats; ``wait`` also waits for the copy waits still being timed (on CUDA that synchronises with the
        device, so a host publishing stats during a run should not ask for it). Final after ``remove()``."""
        if self._copies is not None and not self._removed:
            self._stats.copy_wait_seconds = self._copies.collect(block=wait)
        return self._stats

    def settle(self) -> None:
        """Bind every block whose copy is in flight (the current stream waits for those copies)."""
        for index, slot in enumerate(self._slots):
            if slot.block is not None and not slot.bound:
                self._bind(slot.block)

    # -- the hooks --------------------------------------------------------------------------------------------------

    def _before_block(self, index: int) -> None:
        stats = self._stats
        stats.block_calls += 1
        window = self._window(index)
        if self._slot_of[index] is None:
            stats.sync_loads += 1
            self._load(index, protect={index, *window})
        else:
            stats.hits += 1
        self._bind(index)
        for ahead in window:
            if self._slot_of[ahead] is None:
                stats.prefetches += 1
                self._load(ahead, protect={index, *window})

    def _after_block(self, index: int) -> None:
        if index == len(self.blocks) - 1:
            self._load_head()

    # -- residency --------------------------------------------------------------------------------------------------

    def _window(self, index: int) -> list[int]:
        """The blocks prefetched while ``index`` computes: the next P in list order, wrapping around."""
        count = len(self.blocks)
        ahead = []
        for step in range(1, self.config.prefetch_blocks + 1):
            nxt = (index + step) % count
            if nxt == index or nxt in ahead:
                break
            ahead.append(nxt)
        return ahead

    def _load_head(self) -> None:
        """Make the head blocks (0 .. max(P, 1) - 1) bound, copying those that are not on the device."""
        head = list(range(min(max(self.config.prefetch_blocks, 1), len(self.blocks))))
        for index in head:
            if self._slot_of[index] is None:
                self._load(index, protect=set(head))
        self.settle()

    def _load(self, index: int, protect: set[int]) -> None:
        """Start copying block ``index`` into a slot holding no block of ``protect`` (an empty one, else the least
        recently used); the previous holder is released first."""
        candidates = [s for s, slot in enumerate(self._slots) if slot.block not in protect]
        if not candidates:  # cannot happen: |protect| <= number of slots and block ``index`` is in none of them
            raise RuntimeError(f"layerwise offload: no free slot for block {index} (protected {sorted(protect)})")
        target = min(candidates, key=lambda s: (self._slots[s].block is not None, self._slots[s].last_used))
        slot = self._slots[target]
        if slot.block is not None:
            if slot.bound:
                self.layouts[slot.block].release(self._placeholders)
            self._slot_of[slot.block] = None
            slot.block, slot.bound = None, False
        nbytes = self.layouts[index].nbytes
        self._copies.copy(target, slot.buffer.narrow(0, 0, nbytes), self._masters[index].tensor)
        slot.block = index
        self._slot_of[index] = target
        self._stats.copies += 1
        self._stats.bytes_moved += nbytes
        occupied = sum(s.block is not None for s in self._slots)
        self._stats.peak_resident_blocks = max(self._stats.peak_resident_blocks, occupied)

    def _bind(self, index: int) -> None:
        target = self._slot_of[index]
        slot = self._slots[target]
        self._tick += 1
        slot.last_used = self._tick
        # every time, not only when binding: a host may run this call on another stream than the one that waited
        self._copies.wait_ready(target)
        if slot.bound:
            return
        views = self._views.get((index, target))
        if views is None:
            views = self._views[(index, target)] = self.layouts[index].views(slot.buffer)
        self.layouts[index].bind(views)
        slot.bound = True


def apply_layerwise_offload(blocks: Sequence[torch.nn.Module], device: torch.device | str, *,
                            keep_resident: KeepResidentFn | None = None, **options: Any) -> LayerwiseOffloadRun:
    """Offload ``blocks`` (a block stack, in execution order) to the CPU and stream them to ``device`` block by block.

    ``options`` are ``OffloadConfig``'s fields (its defaults for the others). ``keep_resident``: tensors for which it
    returns True are not offloaded and are left where they are (the host places them, e.g. a block's small modulation
    table that a cache reads before the block runs). Returns the applied run: ``remove()`` undoes everything,
    ``stats`` / ``collect_stats()`` report it. Raises ValueError (changing nothing) for a bad option, an empty or
    repeated block list, a block that is already offloaded, a tensor shared between blocks or one that cannot be packed
    as plain bytes.
    """
    return LayerwiseOffloadRun(blocks, device, OffloadConfig(**options), keep_resident).apply()


def _resolve_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"block offload: device {device} was asked for, but CUDA is not available")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def _layouts(blocks: list[torch.nn.Module], keep_resident: KeepResidentFn | None,
             offload_buffers: bool) -> list[BlockLayout]:
    if not blocks:
        raise ValueError("block offload: needs at least one block")
    if len({id(b) for b in blocks}) != len(blocks):
        raise ValueError("block offload: a block appears twice in the block list")
    owner: dict[int, int] = {}
    layouts = []
    for index, block in enumerate(blocks):
        where = f"block {index} ({type(block).__name__})"
        registry = block.__dict__.get(REGISTRY_ATTR)
        if registry is not None and registry.get_hook(HOOK_NAME) is not None:
            raise ValueError(f"block offload: {where} is already offloaded; remove the other run first")
        layout = BlockLayout.of(block, keep_resident, offload_buffers, where)
        for packed in layout.tensors:
            first = owner.setdefault(id(packed.tensor), index)
            if first != index:
                raise ValueError(f"block offload: {where} tensor {packed.name!r} is shared with block "
                                 f"{first}; shared tensors cannot be offloaded per block (keep_resident them)")
        layouts.append(layout)
    return layouts


def _pinning_policy(device: torch.device, config: OffloadConfig) -> tuple[bool, int, list[str]]:
    """(pin?, budget in bytes, notes) for ``device`` under ``config``."""
    notes: list[str] = []
    if config.pin_memory is False:
        return False, 0, notes
    if device.type != "cuda":
        if config.pin_memory:
            raise ValueError(f"block offload: pin_memory=True needs a CUDA device, got {device}")
        return False, 0, notes
    budget = config.pinned_budget_bytes
    if budget is None:
        physical = physical_memory_bytes()
        if physical is None:
            notes.append("physical memory unknown, nothing pinned: pass pinned_budget_bytes to pin")
            budget = 0
        else:
            budget = physical // 2
    return True, budget, notes
