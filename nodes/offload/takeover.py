"""Whether CPU Offload takes a model over from ComfyUI's dynamic VRAM for one run (``decide``): by two whole-run
figures, the node's and ComfyUI's, each ``start + steps x step + end``, against the run-to-run spread of such figures.

The node's start is its placement (packing, and on CUDA page-locking, the offloaded blocks) on the first run of a
model, and what is left of it once the placement is kept (``kept.py``) on later runs; its end is the restore.
ComfyUI's dynamic VRAM starts at once and pays its streaming in its steps. The figures are measured, never guessed:
``MEASURED`` holds, per GPU and model variant, the rows ``benchmarks/bench_offload_node.py`` measured for a regime
(docs/benchmarks.md). Where no row is measured the node stands aside, as it always did under dynamic VRAM.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WholeRun:
    """One sampling run's wall time, ``start_s + steps x step_s + end_s`` (seconds)."""

    start_s: float
    step_s: float
    end_s: float

    def seconds(self, steps: int) -> float:
        return self.start_s + steps * self.step_s + self.end_s

    def describe(self, steps: int) -> str:
        return (f"{self.seconds(steps):.1f} s ({self.start_s:.2f} s start + {steps} x {self.step_s:.3f} s + "
                f"{self.end_s:.2f} s end)")


@dataclass(frozen=True)
class MeasuredRegime:
    """The figures measured for one regime (GPU, model variant, cap): the node's start on a model's first run
    (``node_first_start_s``, the placement paid) and on a later run (``node_kept_start_s``, the placement kept), its
    step and end; ComfyUI's dynamic VRAM's start, step and end; the run-to-run spread of a row (a fraction of its
    whole run); and ``source``, where they were measured."""

    node_first_start_s: float
    node_kept_start_s: float
    node_step_s: float
    node_end_s: float
    comfy_start_s: float
    comfy_step_s: float
    comfy_end_s: float
    spread: float
    source: str

    def whole_runs(self, placement_kept: bool) -> tuple[WholeRun, WholeRun]:
        """(the node's, ComfyUI's) whole run: the node's start is the placement unless it is kept."""
        start = self.node_kept_start_s if placement_kept else self.node_first_start_s
        return (WholeRun(start, self.node_step_s, self.node_end_s),
                WholeRun(self.comfy_start_s, self.comfy_step_s, self.comfy_end_s))


#: (GPU name as torch names it, model variant as the family detects it) -> the regime's measured figures. None yet:
#: the take-over rows wait for a GPU run of benchmarks/bench_offload_node.py (docs/benchmarks.md).
MEASURED: dict[tuple[str, str], MeasuredRegime] = {}


def measured_regime(device: torch.device, variant: str) -> MeasuredRegime | None:
    """The measured figures for ``variant`` on ``device``'s GPU, if any."""
    if device.type != "cuda":
        return None
    return MEASURED.get((torch.cuda.get_device_name(device), variant))


@dataclass(frozen=True)
class TakeoverDecision:
    """The outcome (``take_over``), why, and the inputs it was decided from: the steps, whether the placement was
    kept, the two whole runs in seconds (None where not measured), the spread and the figures' source."""

    take_over: bool
    reason: str
    steps: int | None
    placement_kept: bool
    node_seconds: float | None
    comfy_seconds: float | None
    spread: float | None
    source: str | None

    def summary(self) -> dict:
        return {"decision": "take over" if self.take_over else "stand aside", **dataclasses.asdict(self)}


def decide(regime: MeasuredRegime | None, steps: int | None, placement_kept: bool) -> TakeoverDecision:
    """Take the model over from ComfyUI's dynamic VRAM only where the node's whole run of ``steps`` steps is shorter
    than ComfyUI's by more than the regime's run-to-run spread (a fraction of ComfyUI's); stand aside elsewhere,
    including where no figure is measured for the regime or the run's steps are unknown."""
    if regime is None or steps is None:
        missing = "no whole-run figures are measured for this GPU and model" if regime is None \
            else "the run's step count is unknown"
        return TakeoverDecision(False, f"{missing}, so CPU Offload stands aside for ComfyUI's dynamic VRAM", steps,
                                placement_kept, None, None, None, None if regime is None else regime.source)
    node, comfy = regime.whole_runs(placement_kept)
    node_s, comfy_s = node.seconds(steps), comfy.seconds(steps)
    first = "" if placement_kept else ", its placement counted (first run of this model)"
    figures = (f"the node's whole run {node.describe(steps)}{first} against ComfyUI's dynamic VRAM's "
               f"{comfy.describe(steps)}; run-to-run spread {regime.spread:.1%} ({regime.source})")
    take_over = node_s < comfy_s * (1 - regime.spread)
    verdict = ("CPU Offload takes the model over: shorter by more than the spread" if take_over else
               "CPU Offload stands aside: not shorter by more than the spread")
    return TakeoverDecision(take_over, f"{verdict}: {figures}", steps, placement_kept, node_s, comfy_s,
                            regime.spread, regime.source)
