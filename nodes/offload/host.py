"""What ComfyUI offers CPU Offload and what it does itself: where the blocks can run, the VRAM its loader keeps free,
its dynamic VRAM (which streams weights itself), the weights it page-locked in RAM, its pinned-memory limit and its
offload streams. Everything here reads or calls ComfyUI's own code; ``node.py`` decides what to do with it.
"""
from __future__ import annotations

import sys
from typing import Any

import comfy.model_management
import comfy.model_patcher
import comfy.sampler_helpers
import comfy.utils
import torch

from ...omni_hooks.base import HookPhase, ModelHook
from ..features import LoadRequest
from .placement import gib


def dynamic_vram_reason(patcher) -> str | None:
    """Why ComfyUI's dynamic VRAM (newer versions: ``ModelPatcherDynamic``, comfy-aimdo) manages this model, else
    None (ComfyUI 0.3.64 has neither)."""
    dynamic = getattr(comfy.model_patcher, "ModelPatcherDynamic", None)
    if dynamic is not None and isinstance(patcher, dynamic):
        return f"this MODEL is a {dynamic.__name__} (ComfyUI's dynamic VRAM)"
    memory_management = sys.modules.get("comfy.memory_management")
    enabled = getattr(memory_management, "aimdo_enabled", False)
    if callable(enabled):
        enabled = enabled()
    if enabled:
        return "ComfyUI's dynamic VRAM (comfy-aimdo) is enabled"
    return None


def offload_target(patcher) -> torch.device | None:
    """The device the blocks run on when it is not where ComfyUI offloads to (None: nothing to offload to)."""
    load = torch.device(patcher.load_device)
    if load.type == "cpu" or load == torch.device(patcher.offload_device):
        return None
    if load.type == "cuda" and load.index is None:
        load = torch.device("cuda", torch.cuda.current_device())
    return load


def no_target_reason(patcher) -> str:
    load, offload = torch.device(patcher.load_device), torch.device(patcher.offload_device)
    if load.type == "cpu":
        return f"ComfyUI runs this model on the CPU (offload device {offload})"
    return f"ComfyUI keeps this model on {load}, its offload device too (--highvram or --gpu-only)"


def activation_reserve(patcher, request: LoadRequest | None) -> tuple[int, str]:
    """The device bytes to keep free for the run's activations, as ComfyUI's loader reserves them (its
    ``--reserve-vram`` included), and how."""
    mm = comfy.model_management
    minimum = int(mm.minimum_inference_memory())
    extra = int(mm.extra_reserved_memory())
    reserved = f", with {gib(extra)} that ComfyUI keeps free (--reserve-vram)" if extra else ""
    if request is None or request.noise_shape is None:
        return minimum, f"ComfyUI's minimum inference memory{reserved}"
    try:
        required, _ = comfy.sampler_helpers.estimate_memory(patcher, request.noise_shape, request.conds or {})
    except Exception as e:  # an estimate is advice; a model whose conds the estimate cannot read still runs
        return minimum, f"ComfyUI's minimum inference memory{reserved} (its estimate for this run failed: {e})"
    return int(max(minimum, required + extra)), f"ComfyUI's estimate for this run{reserved}"


class HostStreamsHook(ModelHook):
    """Before an offloaded block runs: order ComfyUI's own offload streams (``--async-offload``) after the compute
    stream, which has waited for the block's copy.

    ComfyUI 0.3.64's ``get_offload_stream`` makes each of its streams wait for the compute stream one layer ahead, so
    the first cast layer of a block could otherwise read its slot on one of those streams before the copy landed
    (a dtype cast or a LoRA weight function runs there)."""

    phase = HookPhase.PLACEMENT

    def __init__(self, device: torch.device):
        self.device = device
        self.order_streams = torch.compiler.disable(self._order_streams)

    def _order_streams(self) -> None:
        streams = getattr(comfy.model_management, "STREAMS", {}).get(self.device, ())
        if streams:
            compute = torch.cuda.current_stream(self.device)
            for stream in streams:
                stream.wait_stream(compute)

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        self.order_streams()
        return args, kwargs


def pinned_memory_budget() -> tuple[int | None, str | None]:
    """The host memory CPU Offload may page-lock under ComfyUI's own limit (``MAX_PINNED_MEMORY`` less what ComfyUI
    holds pinned), and a note saying so; ``(None, None)`` on a ComfyUI without a limit (0.3.64), ``(0, note)`` where
    ComfyUI pins nothing (``--disable-pinned-memory``, or a GPU it does not pin for)."""
    mm = comfy.model_management
    limit = getattr(mm, "MAX_PINNED_MEMORY", None)
    if limit is None:
        return None, None
    if limit <= 0:
        return 0, "ComfyUI pins no memory here (--disable-pinned-memory, or not an NVIDIA or AMD GPU): nothing pinned"
    held = int(getattr(mm, "TOTAL_PINNED_MEMORY", 0))
    budget = max(0, int(limit) - held)
    return budget, f"pinned memory up to {gib(budget)}: ComfyUI's limit {gib(limit)} less the {gib(held)} it holds"


class ComfyPins:
    """The weights of the offloaded blocks that ComfyUI page-locked in RAM, unpinned through ComfyUI for the run
    (``ModelPatcher.unpin_weight``) and pinned again (``pin_weight_to_device``) once they are back.

    ComfyUI 0.3.75 and newer page-lock the weights its partial load leaves in RAM, each tensor's own memory. The run
    releases those tensors and frees that memory, which must not happen while it is registered: CUDA then refuses a
    later registration of that range (error 712) and copies from it can read stale pages. ComfyUI's bookkeeping (its
    ``pinned`` keys and pinned total) stays true. ``nbytes``: what was unpinned, kept for the card after ``restore``.
    """

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.nbytes = 0
        self._patcher: Any = None

    def release(self, patcher, blocks: list[torch.nn.Module]) -> None:
        """Unpin every weight of ``blocks`` that ComfyUI pinned (none on a ComfyUI that pins nothing)."""
        pinned = getattr(patcher, "pinned", None)
        if not pinned:
            return
        self._patcher = patcher
        ours = {id(t) for block in blocks for t in (*block.parameters(), *block.buffers())}
        for key in sorted(pinned):
            try:
                weight = comfy.utils.get_attr(patcher.model, key)
            except AttributeError:
                continue
            if id(weight) not in ours:
                continue
            patcher.unpin_weight(key)
            self.keys.append(key)
            self.nbytes += weight.numel() * weight.element_size()

    def restore(self) -> None:
        """Pin again what ``release`` unpinned (the weights are back in RAM by then). Idempotent."""
        keys, self.keys = self.keys, []
        for key in keys:
            self._patcher.pin_weight_to_device(key)


class HostStreaming:
    """What ComfyUI's dynamic VRAM keeps of a model on the GPU while CPU Offload stands aside, so its card still
    answers "did it help": the model's weight bytes, those resident (``loaded_size()``) when each call began, the
    device memory ComfyUI could still give it at the first call (its budget beyond what is resident), and per
    computed call the bytes that were not resident, which ComfyUI streams during the call."""

    def __init__(self, patcher) -> None:
        self.patcher = patcher
        self.model_bytes = int(patcher.model_size())
        self.resident: list[int] = []
        self.free_bytes_first_call = 0

    def at_call_start(self) -> int:
        """ComfyUI's resident bytes of this model now (recorded); the bytes not resident."""
        resident = int(self.patcher.loaded_size())
        if not self.resident:
            free = getattr(self.patcher, "get_free_memory", None)  # ComfyUI 0.33: torch's free and comfy-aimdo's
            device = self.patcher.load_device
            self.free_bytes_first_call = int(free(device) if free is not None
                                             else comfy.model_management.get_free_memory(device))
        self.resident.append(resident)
        return max(0, self.model_bytes - resident)

    def summary(self) -> dict[str, int]:
        return {"model_bytes": self.model_bytes,
                "resident_bytes_first_call": self.resident[0] if self.resident else 0,
                "resident_bytes_last_call": self.resident[-1] if self.resident else 0,
                "free_bytes_first_call": self.free_bytes_first_call}
