"""CPU Offload's sampling run as a feature of the lifecycle (``nodes.features``): ``OffloadSession``.

ComfyUI loads the model as it always does (fully, or in part with its lowvram mode when it does not fit). Then, for
the run only (``OffloadSession.after_load``, undone by ``close``):
  * the last N blocks of the block stack are offloaded with ``omni_hooks.offload.LayerwiseOffloadRun``: one CPU
    master copy per block (pinned within a budget on CUDA), ``1 + prefetch_blocks`` device slots, a look-ahead on a
    copy stream. The master copies are kept after the run for the next run of the same model and used again while
    nothing changed its weights (``kept.py``). Layers ComfyUI runs in its cast mode (``comfy_cast_weights``, LoRA
    as ``LowVramPatch`` weight functions) keep running that way: the weight they cast is the slot view, already on
    the device, so ComfyUI's ``cast_to`` copies nothing across the bus and its weight functions still apply the LoRA;
  * the kept blocks that ComfyUI loaded only in part are completed on the device while VRAM allows (``Promotion``);
  * ComfyUI's accounting (``model_loaded_weight_memory``) is told the weight bytes the model holds on the device
    during the run, and given back its own number at the end.
Nothing changes where there is nothing to offload to (ComfyUI on the CPU, ``--highvram``), where newer ComfyUI's
dynamic VRAM places the weights itself and the take-over decision (``takeover.py``) stands aside (the card then shows
what ComfyUI kept resident and streamed, and the decision's figures), where ComfyUI
weight hooks patch weights during the run, or where placing the blocks failed (undone; the run goes on as ComfyUI
loaded the model): the run says why in its log line and its statistics (``OffloadSession.summary()``, which a cache
run on the same MODEL publishes in its run-history entry). What ComfyUI itself offers and does (its pinned weights,
its limits, its dynamic VRAM) is read in ``host.py``; which blocks go where, in ``placement.py``.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

import comfy.model_management
import torch

from ...omni_hooks.base import HookRegistry, remove_hook_and_restore
from ...omni_hooks.context import CallContext
from ...omni_hooks.offload import LayerwiseOffloadRun, OffloadConfig, OffloadStats, unpackable_reason
from .. import families
from ..features import AppliedFeature, Category, FeatureSession, FeatureSpec
from ..stats_store import FeatureReport, StepTotals
from . import host, kept, takeover
from .host import ComfyPins, HostStreaming, HostStreamsHook, activation_reserve, dynamic_vram_reason, \
    no_target_reason, pinned_memory_budget
from .placement import BlockFootprint, OffloadPlan, Promotion, block_tensors, gib, plan_offload

log = logging.getLogger("OmniHooks")

KIND = "offload"
HOST_STREAMS_HOOK = "offload_host_streams"  # sorts after the library's "layerwise_offload" within the placement phase


def _unmovable(name: str, tensor: torch.Tensor) -> bool:
    """Tensors offload cannot pack as bytes (e.g. GGUF's tensor subclass) stay where ComfyUI placed them."""
    return unpackable_reason(tensor) is not None


class OffloadSession(FeatureSession):
    """One sampling run of CPU Offload on one MODEL. Everything ``after_load`` does, ``close`` undoes."""

    def __init__(self, patcher, feature: AppliedFeature, detected: families.DetectedModel):
        super().__init__(patcher, feature, detected)
        self.config: OffloadConfig = feature.config  # the node's own object: the run reads it unchanged
        self.notes: list[str] = []
        self.status: str | None = None
        self.target: torch.device | None = None
        self.plan: OffloadPlan | None = None
        self.run: LayerwiseOffloadRun | None = None
        self.promotion = Promotion()
        self.promoted_bytes = 0  # kept for the statistics after ``close`` undid the promotion
        self.freed_device_bytes = 0
        self.accounted: tuple[Any, int, int] | None = None  # (BaseModel, ComfyUI's own number, the one we set)
        self.hooked: list[torch.nn.Module] = []
        self.calls_computed = 0
        self.calls_skipped = 0
        self.bytes_moved_on_skipped_calls = 0
        self._moved_at_call_start = 0
        self._waited_at_call_start = 0.0
        self.before_sampling: tuple[int, float] | None = None  # (bytes moved, copy wait) placing the blocks
        self.steps = StepTotals()  # per sampler step: calls, skipped calls, bytes moved, copy wait
        self.unchanged_reason: str | None = None  # why the run changed nothing (None: it offloaded or promoted)
        self.device_weight_bytes = 0  # this model's weights on the device during the run (ComfyUI's count, as set)
        self.comfy_pins = ComfyPins()  # the offloaded weights ComfyUI had page-locked, unpinned for the run
        self.host_streaming: HostStreaming | None = None  # what ComfyUI's dynamic VRAM kept resident, when it streams
        self._not_resident_at_call_start = 0
        self._loaded = False
        # the packed blocks: "kept" (a kept placement's, from an earlier run) or "new", why, and the RAM they hold
        # for the next run once this one ended (``kept.py``)
        self.placement: str | None = None
        self.placement_reason: str | None = None
        self.kept_bytes = 0
        self._placement_key: kept.PlacementKey | None = None
        self.takeover: takeover.TakeoverDecision | None = None  # under ComfyUI's dynamic VRAM: take over or not

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def after_load(self, patcher) -> None:
        """Place the blocks for the run. A failure while placing them undoes everything placed so far and the run
        goes on as ComfyUI loaded the model, the card and log saying why; an interrupt is undone and re-raised."""
        if self._loaded:  # one placement per run
            return
        self._loaded = True
        target = host.offload_target(patcher)  # read through the module: a test forces it onto the CPU there
        reason = self._reason_to_change_nothing(patcher, target)
        if reason is not None:
            self.notes.append(reason)  # logged with the run's line at close
            self.unchanged_reason = reason
            if dynamic_vram_reason(patcher) is not None:
                self.host_streaming = HostStreaming(patcher)
            return
        self.target = target
        if self.takeover is not None:
            self.notes.append(self.takeover.reason)
        if target.type != "cuda":
            self.notes.append(f"copies to {target} are synchronous: look-ahead copies need CUDA streams")
        try:
            self._place(patcher, target)
        except comfy.model_management.InterruptProcessingException:
            self._undo(keep_placement=False)
            raise
        except Exception as error:
            self._undo(keep_placement=False)
            self._changed_nothing_after(error)
        except BaseException:
            self._undo(keep_placement=False)
            raise

    def _place(self, patcher, target: torch.device) -> None:
        blocks = list(self.detected.build_stack(patcher.model.diffusion_model).blocks)
        footprints = [BlockFootprint.of(block, target) for block in blocks]
        available = self._available_for_blocks(patcher, target, footprints)
        self.plan = plan = plan_offload(footprints, self.config.blocks_to_offload, self.config.prefetch_blocks,
                                        available)
        self.notes.extend(plan.notes)
        if not plan.offloaded and not plan.promoted:
            self.unchanged_reason = plan.notes[-1] if plan.notes else "the plan offloads no block"
        # the offloaded blocks leave the device before the kept ones are completed on it (and come back after those
        # are undone, ``_undo``), so that the device never holds both
        if plan.offloaded:
            offloaded = [blocks[i] for i in plan.offloaded]
            self.comfy_pins.release(patcher, offloaded)
            if self.comfy_pins.keys:
                self.notes.append(f"ComfyUI had page-locked {gib(self.comfy_pins.nbytes)} of the offloaded blocks' "
                                  "weights in RAM: unpinned through ComfyUI for the run, pinned again after it")
            config = self._config_for(target)
            self._placement_key = kept.PlacementKey.of(patcher, offloaded, target, config)
            packed, why = kept.take(patcher, self._placement_key)
            try:
                self.run = LayerwiseOffloadRun(offloaded, target, config, keep_resident=_unmovable,
                                               packed=packed).apply()
            except BaseException:
                if packed is not None:  # freed already where the run took it; else (no run made) freed here
                    packed.release()
                raise
            self.placement = "kept" if self.run.stats.packed_reused else "new"
            mismatch = self.run.packed_mismatch
            self.placement_reason = why if mismatch is None else f"the kept blocks no longer match: {mismatch}"
            self.freed_device_bytes = sum(footprints[i].device_bytes for i in plan.offloaded)
            self._order_host_streams(offloaded, target)
        for index in plan.promoted:
            self.promoted_bytes += self.promotion.promote(blocks[index], target)
        self._account(patcher)
        if target.type == "cuda":  # promotions and the head's copies are done before any stream reads them
            torch.cuda.synchronize(target)

    def _changed_nothing_after(self, error: Exception) -> None:
        """The placement failed with ``error`` and was undone: the run goes on as ComfyUI loaded the model."""
        log.warning("OmniHooks %s: placing the blocks failed, so it changes nothing", self.feature.describe(),
                    exc_info=True)
        self.run, self.plan = None, None
        self.promoted_bytes = self.freed_device_bytes = 0
        self.unchanged_reason = (f"placing the blocks failed ({type(error).__name__}: {error}), so CPU Offload changed "
                                 "nothing: every block is back as ComfyUI loaded it and the run uses ComfyUI's own "
                                 "loading")
        self.notes.append(self.unchanged_reason)

    def begin_call(self, context: CallContext) -> None:
        if self.host_streaming is not None:
            self._not_resident_at_call_start = self.host_streaming.at_call_start()
        self._moved_at_call_start = self._bytes_moved()
        self._waited_at_call_start = self._copy_wait()
        if self.before_sampling is None:
            self.before_sampling = (self._moved_at_call_start, self._waited_at_call_start)

    def end_call(self, context: CallContext) -> None:
        moved = self._bytes_moved() - self._moved_at_call_start
        skipped = context.blocks_run is False
        if skipped:
            self.calls_skipped += 1
            self.bytes_moved_on_skipped_calls += moved
        else:
            self.calls_computed += 1
        streamed = {} if self.host_streaming is None else \
            {"not_resident_bytes": 0 if skipped else self._not_resident_at_call_start}
        self.steps.add(context.step, skipped=int(skipped), bytes_moved=moved,
                       copy_wait_seconds=self._copy_wait() - self._waited_at_call_start, **streamed)

    def close(self, status: str) -> None:
        self.status = status
        try:
            self._undo(keep_placement=True)
        finally:
            log.info("OmniHooks %s", self.log_line())

    # -- statistics -----------------------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """JSON-safe: the offload run's ``OffloadStats.summary()`` (zeros when nothing was offloaded) plus what
        the run decided and saw: ``active``, ``status``, block counts, promoted and freed bytes, computed and skipped
        calls and the bytes moved during skipped calls (0 by design), the bytes moved and the copy wait when the
        blocks were placed (before the first call), the device's weight bytes during the run, ``unchanged_reason``
        (why nothing was offloaded, else None), ``steps`` (``StepTotals``: per sampler step its calls, skipped calls,
        bytes moved and copy wait; under ComfyUI's dynamic VRAM also the bytes not resident at each computed call),
        ``comfy_unpinned_bytes`` (offloaded weights ComfyUI had page-locked, unpinned for the run),
        ``host_streaming`` (under ComfyUI's dynamic VRAM: the model's weight bytes and those ComfyUI held resident at
        the first and last call; else None) and ``notes`` (the library's and the run's)."""
        stats = self.run.stats if self.run is not None else self._idle_stats()
        summary = stats.summary()
        plan = self.plan
        summary.update({
            "model": self.detected.variant,
            "status": self.status,
            "active": self.run is not None or self.promoted_bytes > 0,
            "blocks_total": len(self.detected.build_stack(self.patcher.model.diffusion_model).blocks),
            "blocks_offloaded": len(plan.offloaded) if plan else 0,
            "blocks_promoted": len(plan.promoted) if plan else 0,
            "blocks_partly_streamed": len(plan.partly_streamed) if plan else 0,
            "promoted_bytes": self.promoted_bytes,
            "freed_device_bytes": self.freed_device_bytes,
            "calls_computed": self.calls_computed,
            "calls_skipped": self.calls_skipped,
            "bytes_moved_on_skipped_calls": self.bytes_moved_on_skipped_calls,
            "bytes_moved_before_sampling": self.before_sampling[0] if self.before_sampling else 0,
            "copy_wait_before_sampling_seconds": self.before_sampling[1] if self.before_sampling else 0.0,
            "device_weight_bytes": self.device_weight_bytes,
            "unchanged_reason": self.unchanged_reason,
            "comfy_unpinned_bytes": self.comfy_pins.nbytes,
            "placement": self.placement,
            "placement_reason": self.placement_reason,
            "kept_placement_bytes": self.kept_bytes,
            "takeover": None if self.takeover is None else self.takeover.summary(),
            "host_streaming": None if self.host_streaming is None else self.host_streaming.summary(),
            "steps": self.steps.to_list(),
            "notes": [*summary["notes"], *self.notes],
        })
        return summary

    def report(self) -> FeatureReport:
        """Its summary as the run's card, headed by the blocks offloaded and the bytes moved."""
        summary = self.summary()
        headline = (f"{summary['blocks_offloaded']}/{summary['blocks_total']} blocks offloaded, "
                    f"{gib(summary['bytes_moved'])} moved" if summary["active"] else "nothing offloaded")
        return FeatureReport.of(self.feature, card=summary, headline=headline)

    def log_line(self) -> str:
        node = f"node #{self.feature.node_id}, " if self.feature.node_id else ""
        head = f"{self.feature.node_title} ({node}{self.detected.variant}, {self.status or 'running'})"
        if self.run is None and not self.promoted_bytes:
            return f"{head}: " + ("; ".join(self.notes) or "nothing offloaded")
        parts = [self.run.stats.log_line() if self.run is not None else "no block offloaded"]
        if self.placement is not None:
            parts.append(f"placement {'reused' if self.placement == 'kept' else 'made anew'} "
                         f"({self.placement_reason})")
        if self.kept_bytes:
            parts.append(f"{gib(self.kept_bytes)} of packed blocks kept in RAM for the next run of this model")
        if self.promoted_bytes:
            parts.append(f"{len(self.plan.promoted)} resident blocks completed on the device "
                         f"({gib(self.promoted_bytes)})")
        parts.append(f"{self.calls_computed} computed and {self.calls_skipped} skipped model calls, "
                     f"{self.bytes_moved_on_skipped_calls} bytes moved during skipped ones")
        parts.extend(self.notes)
        return f"{head}: " + "; ".join(parts)

    # -- helpers --------------------------------------------------------------------------------------------------

    def _reason_to_change_nothing(self, patcher, target: torch.device | None) -> str | None:
        dynamic = dynamic_vram_reason(patcher)
        if dynamic is not None:
            self.takeover = self._decide_takeover(patcher, target)
            if not self.takeover.take_over:
                return (f"{dynamic}: ComfyUI streams this model's weights to the GPU itself, each layer's when it "
                        "runs, so CPU Offload leaves them to it and changes nothing; a step a cache skips runs no "
                        f"block, so ComfyUI loads none of their weights; {self.takeover.reason}")
        if target is None:
            on_cpu = torch.device(patcher.load_device).type == "cpu"
            fix = ("it frees VRAM where ComfyUI runs the model on a GPU" if on_cpu
                   else "start ComfyUI without --highvram / --gpu-only to let it offload blocks")
            return f"nothing to offload to: {no_target_reason(patcher)}, so CPU Offload changes nothing; {fix}"
        if getattr(patcher, "hook_patches", None) or getattr(patcher, "forced_hooks", None) is not None:
            return ("this MODEL has ComfyUI weight hooks (Create Hook LoRA and the like), which patch weights in the "
                    "middle of sampling; CPU Offload does not move weights ComfyUI may patch during the run, so it "
                    "changes nothing")
        if self.config.blocks_to_offload == 0:
            return ("blocks_to_offload is 0: nothing offloaded; set it to -1 (auto) or to the number of blocks to keep "
                    "in RAM")
        return None

    def _decide_takeover(self, patcher, target: torch.device | None) -> takeover.TakeoverDecision:
        """Under ComfyUI's dynamic VRAM: take this run over or stand aside (``takeover.decide``), from the figures
        measured for this GPU and model, the run's steps and whether a placement of this model is kept."""
        held = kept.kept()
        placement_kept = held is not None and held.model() is patcher.model
        regime = takeover.measured_regime(target, self.detected.variant) if target is not None else None
        steps = self.load_request.steps if self.load_request is not None else None
        return takeover.decide(regime, steps, placement_kept)

    def _available_for_blocks(self, patcher, target: torch.device, footprints: list[BlockFootprint]) -> int:
        """Device bytes the blocks may hold during the run, and a note saying how that was decided."""
        reserve, how = activation_reserve(patcher, self.load_request)
        free = int(comfy.model_management.get_free_memory(target))
        on_device = sum(f.device_bytes for f in footprints)
        available = free + on_device - reserve
        why = (f"{gib(free)} free after ComfyUI loaded the model, {gib(on_device)} held by its blocks, "
               f"{gib(reserve)} kept free for activations ({how})")
        budget = self.config.vram_budget_bytes
        if budget is not None:
            other = sum(t.numel() * t.element_size() for t in block_tensors(patcher.model.diffusion_model)
                        if t.device == target) - on_device
            if budget - other < available:
                available = budget - other
                why = f"vram_budget_gb {gib(budget)} less {gib(other)} of weights outside the blocks"
        self.notes.append(f"VRAM for the blocks: {gib(available)} ({why})")
        return available

    def _config_for(self, target: torch.device) -> OffloadConfig:
        """The node's config for the run on ``target``, with the run's notes saying what was decided. It is the
        node's object except in two cases, which get a copy: pinning asked on a device that cannot use pinned memory
        (pinning off), and pinning on CUDA under a ComfyUI with a pinned-memory limit (the budget that limit leaves;
        pinning off under auto where ComfyUI pins nothing)."""
        config = self.config
        if target.type != "cuda":
            if config.pin_memory:
                self.notes.append(f"pin_memory is on, but pinned memory needs a CUDA device, not {target.type}: "
                                  "nothing pinned")
                return dataclasses.replace(config, pin_memory=False)
            return config
        if config.pin_memory is False or config.pinned_budget_bytes is not None:
            return config
        budget, why = pinned_memory_budget()
        if budget is None:
            return config
        if budget == 0 and config.pin_memory is None:
            self.notes.append(f"{why} (pin_memory auto)")
            return dataclasses.replace(config, pin_memory=False)
        if budget == 0:
            self.notes.append(f"pin_memory is on although {why.split(':')[0]}: pinning within half the machine's RAM")
            return config
        self.notes.append(why)
        return dataclasses.replace(config, pinned_budget_bytes=budget)

    def _order_host_streams(self, blocks: list[torch.nn.Module], target: torch.device) -> None:
        if target.type != "cuda" or getattr(comfy.model_management, "NUM_STREAMS", 1) <= 1:
            return
        comfy.model_management.get_offload_stream(target)  # creates ComfyUI's streams now, not inside a block
        for block in blocks:
            hook = HostStreamsHook(target)
            self.hooked.append(block)  # first: undoing restores a block whose registry was made but not filled
            HookRegistry.get_or_create(block).register_hook(HOST_STREAMS_HOOK, hook)

    def _account(self, patcher) -> None:
        """Tell ComfyUI's model management the weight bytes this model holds on the device during the run."""
        model = patcher.model
        delta = (self.run.device_bytes if self.run is not None else 0) + self.promotion.nbytes \
            - self.freed_device_bytes
        own = model.model_loaded_weight_memory
        model.model_loaded_weight_memory = max(0, own + delta)
        self.accounted = (model, own, model.model_loaded_weight_memory)
        self.device_weight_bytes = model.model_loaded_weight_memory

    def _bytes_moved(self) -> int:
        return self.run.stats.bytes_moved if self.run is not None else 0

    def _copy_wait(self) -> float:
        """The copy waits measured so far (on CUDA, a wait still being timed counts at a later call)."""
        return self.run.stats.copy_wait_seconds if self.run is not None else 0.0

    def _idle_stats(self) -> OffloadStats:
        device = str(self.target if self.target is not None else self.patcher.load_device)
        return OffloadStats(device=device, blocks=0, config=self.config, slots=0,
                            slot_bytes=0, device_bytes=0, offloaded_bytes=0, pinned_bytes=0, pinned_blocks=0,
                            kept_resident_bytes=0, uses_streams=False)

    def _undo(self, keep_placement: bool) -> None:
        """Undo everything ``after_load`` did, each part whatever the others did; re-raise the first failure. With
        ``keep_placement`` the packed blocks are kept for the next run of this model (``kept.keep``)."""
        failure: BaseException | None = None
        for step in (self._unhook_host_streams, self.promotion.undo, lambda: self._remove_run(keep_placement),
                     self.comfy_pins.restore, self._undo_account):
            try:
                step()
            except Exception as e:
                log.exception("OmniHooks %s: undoing the offload failed", self.feature.describe())
                failure = failure or e
        if failure is not None:
            raise failure

    def _unhook_host_streams(self) -> None:
        hooked, self.hooked = self.hooked, []
        for block in hooked:
            remove_hook_and_restore(block, HOST_STREAMS_HOOK)

    def _remove_run(self, keep_placement: bool) -> None:
        if self.run is None:
            return
        packed = self.run.remove(keep_packed=keep_placement)  # keeps the run: its stats are final now
        if packed is not None and not packed.released and self._placement_key is not None:
            kept.keep(self.patcher, self._placement_key, packed)
            self.kept_bytes = packed.nbytes

    def _undo_account(self) -> None:
        accounted, self.accounted = self.accounted, None
        if accounted is None:
            return
        model, own, ours = accounted
        if model.model_loaded_weight_memory != ours:
            log.warning("OmniHooks %s: ComfyUI changed this model's loaded-weight count during the run (%d, set to "
                        "%d); restoring its own number %d", self.feature.describe(),
                        model.model_loaded_weight_memory, ours, own)
        model.model_loaded_weight_memory = own


FEATURE = FeatureSpec(kind=KIND, category=Category.OFFLOAD, session_factory=OffloadSession)  # in FEATURE_MODULES
