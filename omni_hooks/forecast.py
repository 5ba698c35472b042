"""Forecasting a skipped step's block-stack residual from the residuals of the last computed steps.

A cache that skips a step adds a residual to the stack's input instead of running the blocks. Order 0 adds the residual
of the last computed step (plain reuse). Order k extrapolates the polynomial through the last k + 1 computed residuals
of the branch to the skipped step's coordinate: finite differences on a non-uniform grid (Lagrange form), the idea of
TaylorSeer (Liu et al., "From Reusing to Forecasting", 2025), here in the sampler's sigma (falling back to the step
index when the host gives no sigma), so that a polynomial-in-sigma residual of degree <= k is forecast exactly.

Memory: a branch keeps at most ``order + 1`` residuals (``ResidualHistory.limit``); the caches count them in
``cache_bytes``. A forecast that is not finite everywhere is replaced by the last residual (``Forecast.fell_back``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

ORDERS = (0, 1, 2)
FORECAST = "forecast"                   # BranchDecision.reason of a skipped branch whose residual was forecast
FORECAST_FALLBACK = "forecast-fallback"  # ... whose forecast was not finite, so the last residual was reused


def check_order(order: int) -> int:
    """``order`` as an int; ValueError unless it is one of ``ORDERS``."""
    if int(order) != order or int(order) not in ORDERS:
        raise ValueError(f"forecast order must be one of {ORDERS}, got {order!r}")
    return int(order)


def lagrange_weights(nodes: list[float], x: float) -> list[float]:
    """Weights w with ``p(x) = sum w_j * p(nodes[j])`` for every polynomial p of degree < len(nodes).

    ``nodes`` must be distinct. Computed in Python floats (float64) so that the weights are the same on every rank.
    """
    weights = []
    for j, xj in enumerate(nodes):
        w = 1.0
        for m, xm in enumerate(nodes):
            if m != j:
                w *= (x - xm) / (xj - xm)
        weights.append(w)
    return weights


@dataclass
class Forecast:
    """A skipped branch's residual: ``residual`` (None: nothing cached) and how it was made."""

    residual: torch.Tensor | None
    order: int = 0              # the order actually used (0: the last residual)
    fell_back: bool = False     # a forecast was made but was not finite; ``residual`` is the last one


@dataclass
class ResidualHistory:
    """The residuals of a branch's last computed steps with their coordinates (sigma or step), oldest first.

    Holds at most ``limit`` entries (order + 1). ``add`` replaces the newest entry when its coordinate is the same, and
    starts afresh when the residual's shape changes (an older residual could not be combined with it).
    """

    limit: int = 1
    coords: list[float | None] = field(default_factory=list)
    residuals: list[torch.Tensor] = field(default_factory=list)

    def add(self, coord: float | None, residual: torch.Tensor) -> None:
        if self.residuals and (self.residuals[-1].shape != residual.shape or coord is None
                               or self.coords[-1] is None):
            self.clear()
        elif self.coords and self.coords[-1] == coord:
            self.coords.pop()
            self.residuals.pop()
        self.coords.append(coord)
        self.residuals.append(residual)
        del self.coords[:-self.limit], self.residuals[:-self.limit]

    def clear(self) -> None:
        self.coords.clear()
        self.residuals.clear()

    @property
    def last(self) -> torch.Tensor | None:
        return self.residuals[-1] if self.residuals else None

    def forecast(self, coord: float | None, check_finite: bool = True) -> Forecast:
        """The residual at ``coord``: the extrapolation through the kept residuals (order = entries - 1), or the
        last residual when only one is kept, ``coord`` is None, or (``check_finite``) the extrapolation is not
        finite. Computed in at least float32, returned in the residuals' dtype."""
        last = self.last
        usable = len(self.residuals) > 1 and coord is not None and coord not in self.coords
        if not usable:
            return Forecast(last)
        weights = lagrange_weights([float(c) for c in self.coords], float(coord))
        dtype = torch.promote_types(last.dtype, torch.float32)
        out = torch.zeros_like(last, dtype=dtype)
        for w, r in zip(weights, self.residuals):
            out.add_(r.to(device=last.device, dtype=dtype), alpha=w)
        if check_finite and not bool(torch.isfinite(out).all()):
            return Forecast(last, fell_back=True)
        return Forecast(out.to(last.dtype), order=len(self.residuals) - 1)
