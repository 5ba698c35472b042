"""A cached sampling run leaves ComfyUI's model compiler out (ComfyUI 0.35 and later), for that run only.

The compiler (``comfy.model_prefetch``, on by default with dynamic VRAM on CUDA unless ``--disable-comfy-compiler``)
records the GPU allocations of a model call, per block scope, and replays them on the calls after. A cache changes
which blocks run from one step to the next, and keeps tensors (residuals, forecasts) from one step to the next that
were allocated inside the recorded region: users of other caches on those releases report graph breaks and "aimdo
memory compile error". ``malloc_graph_enabled(device)`` reads ``comfy.cli_args.args.disable_comfy_compiler`` at every
call, and some models (MiniMax-H3) ask it in their forward before any DIFFUSION_MODEL wrapper runs, so the switch is
set once the run's models are loaded, before its first call, and put back when the run ends, whatever ended it.

Nothing changes where the host has no compiler (ComfyUI before 0.35), where it is off (the user's
``--disable-comfy-compiler``, no dynamic VRAM, no CUDA), or for the calls of any other sampling run. Where the switch
does not turn the compiler off (a later ComfyUI changed it), the cache computes every step of the run and says why:
what it relies on is checked at every run, as the model's code is.
"""
from __future__ import annotations

import threading

import comfy.cli_args
import torch

try:
    import comfy.model_prefetch as model_prefetch
except ImportError:  # ComfyUI before 0.33 has no model_prefetch
    model_prefetch = None

NOTE = ("ComfyUI's model compiler was left out for this run: a cache changes which blocks run from step to step, and "
        "the compiler replays one recorded allocation pattern")

_lock = threading.Lock()
_holders = 0  # cached runs holding the compiler off now (a worker rank's and rank 0's are separate processes)


def compiler_enabled(device: torch.device) -> bool:
    """Whether this ComfyUI compiles model calls on ``device`` (False on a ComfyUI without the compiler)."""
    enabled = getattr(model_prefetch, "malloc_graph_enabled", None)
    return bool(enabled is not None and enabled(device))


class CompilerDrift(RuntimeError):
    """The compiler is on and the switch a cached run relies on does not turn it off."""


class CompilerLeftOut:
    """One cached run's hold on the compiler switch: ``leave_out`` turns the compiler off when it is on (returning the
    note for the run), ``restore`` puts it back once no cached run holds it. ``restore`` is safe to call whatever
    ``leave_out`` did, and more than once."""

    def __init__(self) -> None:
        self.holding = False

    def leave_out(self, device: torch.device) -> str | None:
        """Turn the compiler off for this run when it is on: returns the run's note (None: it was not on). Raises
        ``CompilerDrift`` when the switch this relies on does not turn it off (the host changed it)."""
        global _holders
        with _lock:
            if self.holding or not compiler_enabled(device):
                return NOTE if self.holding else None
            previous = getattr(comfy.cli_args.args, "disable_comfy_compiler", None)
            comfy.cli_args.args.disable_comfy_compiler = True
            if compiler_enabled(device):
                comfy.cli_args.args.disable_comfy_compiler = previous
                raise CompilerDrift("ComfyUI's model compiler is on and setting args.disable_comfy_compiler did not "
                                    "turn it off (this ComfyUI changed the switch)")
            _holders += 1
            self.holding = True
        return NOTE

    def restore(self) -> None:
        global _holders
        with _lock:
            if not self.holding:
                return
            self.holding = False
            _holders -= 1
            if _holders == 0:
                comfy.cli_args.args.disable_comfy_compiler = False
