"""The placement CPU Offload keeps between sampling runs: the packed (on CUDA, pinned) master copies of one model's
offloaded blocks, so that the next run of the same model does not pack them again (``KeptPlacement``).

One placement is kept at a time, for the model of the last run that offloaded blocks. A run takes it
(``take``) and keeps its own at the end (``keep``). It is used again only where nothing that changes the weights or
their layout changed since (``PlacementKey``: the same model, blocks, device, dtype and pin plan, and the same
weight patches as ComfyUI records them); the library checks the tensors themselves (``PackedStack.mismatch``). It
is freed, and its RAM given back, when ComfyUI unloads the model (``on_detach``, a keyed ``ON_DETACH`` callback on the
node's MODEL), when a run finds it stale or for another model, when the model is garbage collected, and at exit.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import weakref
import torch

from ...omni_hooks.offload import OffloadConfig, PackedStack

log = logging.getLogger("OmniHooks")

CALLBACK_KEY = "omni_hooks.offload.kept_placement"

#: what differs between a kept placement's key and a run's -> why the run places the blocks anew
CHANGES = {
    "model": "another model than the kept placement's",
    "blocks": "other blocks offloaded (blocks_to_offload, or the VRAM auto plans with, changed)",
    "target": "another device",
    "dtype": "another dtype",
    "pin": "another pin_memory setting",
    "patches": "other weight patches on the MODEL (a LoRA added, removed or set to another strength)",
    "weights_patched": "ComfyUI patched the weights anew (another LoRA or weight patches applied to them)",
    "inplace": "another weight_inplace_update setting",
}


@dataclasses.dataclass(frozen=True)
class PlacementKey:
    """What must be equal for a kept placement to stand for a run's: the model (``BaseModel``, by identity), the
    offloaded blocks, the device, the dtype ComfyUI computes in, the pin setting (the library compares the pin plan
    itself, so a budget that still pins the same blocks keeps the placement), the MODEL's weight
    patches (``patches_uuid``: a LoRA or weight patch gives a clone a new one), the patches ComfyUI applied to the
    weights (``current_weight_patches_uuid``, which in-place patches change without moving the weights) and
    ``weight_inplace_update``. ``prefetch_blocks`` is not part of it: the master copies do not depend on it."""

    model: int
    blocks: tuple[int, ...]
    target: str
    dtype: str
    pin: bool | None
    patches: str
    weights_patched: str
    inplace: bool

    @classmethod
    def of(cls, patcher, blocks: list[torch.nn.Module], target: torch.device, config: OffloadConfig) -> "PlacementKey":
        model = patcher.model
        dtype = patcher.model_dtype() if hasattr(patcher, "model_dtype") else None
        return cls(model=id(model), blocks=tuple(id(b) for b in blocks), target=str(target), dtype=str(dtype),
                   pin=config.pin_memory, patches=str(patcher.patches_uuid),
                   weights_patched=str(getattr(model, "current_weight_patches_uuid", None)),
                   inplace=bool(getattr(patcher, "weight_inplace_update", False)))

    def change_from(self, other: "PlacementKey") -> str | None:
        """Why a placement kept under ``other`` does not stand for this key (None: it may)."""
        if self.model != other.model:
            return CHANGES["model"]
        changed = [CHANGES[f.name] for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)]
        return "; ".join(changed) or None


@dataclasses.dataclass
class KeptPlacement:
    """The packed blocks of one model, under the key they were placed with."""

    key: PlacementKey
    packed: PackedStack
    model: weakref.ref
    finalizer: weakref.finalize


_lock = threading.RLock()  # re-entrant: a model's finalizer may run inside a locked section
_kept: KeptPlacement | None = None
_last_freed: tuple[int, str] | None = None  # (model id, why): the reason a later run of that model places anew


def take(patcher, key: PlacementKey) -> tuple[PackedStack | None, str]:
    """The kept placement for a run under ``key`` (the run owns it from here), or None and why the run places the
    blocks anew; a kept placement that does not stand for ``key`` is freed first."""
    global _kept, _last_freed
    with _lock:
        kept, _kept = _kept, None
        freed, _last_freed = _last_freed, None
    if kept is None:
        if freed is not None and freed[0] == key.model:
            return None, freed[1]
        return None, "first placement of this model"
    if kept.model() is not patcher.model:
        _release(kept)
        return None, CHANGES["model"]
    change = key.change_from(kept.key)
    if change is not None:
        _release(kept)
        return None, change
    kept.finalizer.detach()
    return kept.packed, "kept from the last run of this model"


def keep(patcher, key: PlacementKey, packed: PackedStack) -> None:
    """Keep ``packed`` (placed under ``key``) for the next run of ``patcher``'s model, freeing what was kept."""
    global _kept
    model = patcher.model
    finalizer = weakref.finalize(model, forget_model, id(model), "the model was deleted")
    finalizer.atexit = False
    placement = KeptPlacement(key=key, packed=packed, model=weakref.ref(model), finalizer=finalizer)
    with _lock:
        previous, _kept = _kept, placement
    if previous is not None:
        _release(previous)


def forget_model(model_id: int, why: str) -> None:
    """Free the placement kept for the model with ``id`` ``model_id`` (if any); a later run of it says ``why``."""
    global _kept, _last_freed
    with _lock:
        kept = _kept if _kept is not None and _kept.key.model == model_id else None
        if kept is not None:
            _kept, _last_freed = None, (model_id, why)
    if kept is not None:
        _release(kept)
        log.info("OmniHooks CPU Offload: freed the %.2f GiB of kept blocks (%s)", kept.packed.nbytes / 1024 ** 3, why)


def on_detach(patcher, unpatch_all: bool) -> None:
    """ComfyUI's ``ON_DETACH`` callback: with ``unpatch_all`` ComfyUI unloaded the model (its weights back to the
    offload device, patches undone), so its kept placement is freed; without it, ComfyUI only swaps one clone of the
    loaded model for another and the weights stay."""
    if unpatch_all:
        forget_model(id(patcher.model), "ComfyUI unloaded the model")


def kept() -> KeptPlacement | None:
    """The placement kept now (None: none)."""
    return _kept


def release_all() -> None:
    """Free whatever is kept (at exit, and for a test)."""
    global _kept, _last_freed
    with _lock:
        kept_now, _kept, _last_freed = _kept, None, None
    if kept_now is not None:
        _release(kept_now)


def _release(placement: KeptPlacement) -> None:
    placement.finalizer.detach()
    placement.packed.release()


def _release_at_exit() -> None:
    try:
        release_all()
    except Exception:  # at exit: say so, never fail the interpreter's shutdown
        log.exception("OmniHooks CPU Offload: freeing the kept blocks at exit failed")


atexit.register(_release_at_exit)
