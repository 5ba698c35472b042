"""Magnitude-ratio tables: per-branch curves, resampled to any step count.

A published table is either *one per step* (models without CFG, or one list per branch as OmniGen2 ships them) or
*CFG-interleaved* ``[c0, u0, c1, u1, ...]`` (cond first: ComfyUI batches cond before uncond, and the reference
scripts count the cond pass first). An interleaved table is split into its even (cond) and odd (uncond) halves, and
each half is interpolated on its own, so a branch always reads its own curve at its own step index.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

DEFAULT = "default"   # the curve of a flat table: every branch uses it
COND = "cond"
UNCOND = "uncond"


def nearest_interp(src: Sequence[float], steps: int) -> list[float]:
    """Nearest-neighbour resampling of ``src`` to ``steps`` entries (diffusers / vllm-omni ``nearest_interp``).

    ``steps == 1`` gives ``src[-1:]``; otherwise entry i is ``src[round(i * (len(src) - 1) / (steps - 1))]`` with
    round-half-to-even, so the first and last entries are always kept.
    """
    values = [float(v) for v in src]
    if not values:
        raise ValueError("cannot interpolate an empty ratio table")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if steps == 1:
        return values[-1:]
    if len(values) == steps:
        return values
    scale = (len(values) - 1) / (steps - 1)
    index = np.round(np.arange(steps) * scale).astype(np.int64)
    return [values[i] for i in index]


def split_interleaved(table: Sequence[float]) -> dict[str, list[float]]:
    """``[c0, u0, c1, u1, ...]`` -> ``{"cond": [c0, c1, ...], "uncond": [u0, u1, ...]}``."""
    values = [float(v) for v in table]
    if len(values) % 2:
        raise ValueError(f"a CFG-interleaved ratio table needs an even length, got {len(values)}")
    return {COND: values[0::2], UNCOND: values[1::2]}


def interleave(curves: Mapping[str, Sequence[float]]) -> list[float]:
    """The inverse of ``split_interleaved`` (cond and uncond of equal length)."""
    cond, uncond = list(curves[COND]), list(curves[UNCOND])
    if len(cond) != len(uncond):
        raise ValueError(f"cond and uncond curves differ in length ({len(cond)} vs {len(uncond)})")
    return [v for pair in zip(cond, uncond) for v in pair]


def branch_base(label: str) -> str:
    """"cond.1" -> "cond": further cond entries of the same kind (areas, several conds) share the cond curve."""
    return label.split(".", 1)[0]


class MagRatioTable:
    """One curve per branch kind, resampled on demand to a run's step count. Part of the frozen ``MagCacheConfig``:
    it never changes after it is built (a run keeps the curves it resampled: ``MagCacheRun``).

    ``curves`` keys are branch kinds ("cond", "uncond", any other label a host uses) or ``"default"``. A branch
    reads the curve of its own kind, else ``"default"``, else the cond curve.
    """

    def __init__(self, curves: Mapping[str, Sequence[float]]):
        if not curves:
            raise ValueError("a ratio table needs at least one curve")
        self.curves: dict[str, tuple[float, ...]] = {}
        for name, values in curves.items():
            values = tuple(float(v) for v in values)
            if not values:
                raise ValueError(f"the {name!r} ratio curve is empty")
            if not all(np.isfinite(values)) or min(values) < 0:
                raise ValueError(f"the {name!r} ratio curve must hold finite non-negative ratios")
            self.curves[str(name)] = values

    @classmethod
    def from_values(cls, mag_ratios: Sequence[float] | Mapping[str, Sequence[float]],
                    interleaved: bool = False) -> "MagRatioTable":
        """A flat list (one per step), a CFG-interleaved list (``interleaved=True``), or a mapping per branch."""
        if isinstance(mag_ratios, Mapping):
            if interleaved:
                raise ValueError("interleaved=True needs a flat list, not a mapping of per-branch curves")
            return cls(mag_ratios)
        if interleaved:
            return cls(split_interleaved(mag_ratios))
        return cls({DEFAULT: mag_ratios})

    def curve_name(self, label: str) -> str:
        base = branch_base(label)
        if base in self.curves:
            return base
        if DEFAULT in self.curves:
            return DEFAULT
        return COND if COND in self.curves else next(iter(self.curves))

    def calibrated_steps(self, label: str) -> int:
        return len(self.curves[self.curve_name(label)])

    def for_branch(self, label: str, steps: int) -> list[float]:
        """The branch's curve with ``steps`` entries (nearest interpolation)."""
        return nearest_interp(self.curves[self.curve_name(label)], steps)

    def __repr__(self) -> str:
        parts = ", ".join(f"{k}: {len(v)}" for k, v in self.curves.items())
        return f"MagRatioTable({parts})"
