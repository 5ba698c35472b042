"""Forecasting a skipped step's block-stack residual from the residuals of the last computed steps.

A cache that skips a step adds a residual to the stack's input instead of running the blocks. Order 0 adds the residual
of the last computed step (plain reuse). Order k extrapolates the polynomial through the last k + 1 computed residuals
of the branch to the skipped step's coordinate: finite differences on a non-uniform grid (Lagrange form), the idea of
TaylorSeer (Liu et al., "From Reusing to Forecasting", 2025), here in the sampler's sigma (falling back to the step
index when the host gives no sigma), so that a polynomial-in-sigma residual of degree <= k is forecast exactly.

Memory: a branch keeps at most ``order + 1`` residuals (``ResidualHistory.limit``); the caches count them in
``cache_bytes``. A forecast that is not finite everywhere is replaced by the last residual (``Forecast.fell_back``).

``AUTO`` chooses the order per branch and skipped step from what the run has seen, with no extra model call: at each
computed step, before its residual joins the history, every order that has enough older residuals predicts it from
them (``ResidualHistory.prediction_errors``); ``OrderScores`` keeps a running relative error per order and the
distance (in the coordinate) those predictions spanned. A skip uses the order whose error, carried to the skip's own
distance from the last computed step, is smallest: an order-k extrapolation errs like the distance to the power
k + 1, reuse like the distance, so a skip close to the last computed step favours the higher orders and one far
from it favours reuse. An error also counts as it adds up in the latent over the coming gaps: each order's running
correlation between its consecutive errors (``OrderScores.coherence``; reuse lagging a drift errs the same way at
every gap) multiplies its error by ``accumulation`` (below 1 for errors that alternate, where the cache credits that:
``StackCacheRun.coherence_floor``). Plain reuse unless an order beats it. An auto branch keeps
``MAX_ORDER + 2`` residuals (the newest is scored against the ``MAX_ORDER + 1`` before it). The scores are measured
per rank shard and averaged over the ranks (like the caches' metrics), so every rank of a group chooses the same
order.

A policy that knows it forecasts (``ErrorPerMetric``, under ``WEIGHED_ORDERS``): at each computed step the cache also
knows the metric that made it compute (TeaCache's accumulated change) and the error the forecast a skip would have
used made predicting that step. Their quotient, the forecast's error per unit of metric, is high where the forecast
does poorly for the change the metric sees; the policy weighs its metric by the recent quotient over the run's mean
(``weight``, bounded to ``WEIGHT_RANGE``: 1 to 2), so computes come sooner where the forecast is weakest, and never
later than the metric alone would have them. Letting the weight fall below 1 where the forecast did well gave no
better quality per evaluation and made a threshold compute fewer steps than with reuse; scaling the metric down by
the forecast's gain over reuse skipped more and lost quality (docs/benchmarks.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

ORDERS = (0, 1, 2)
MAX_ORDER = ORDERS[-1]
AUTO = "auto"                            # the order chosen per branch and skipped step (OrderScores)
FORECAST = "forecast"                   # BranchDecision.reason of a skipped branch whose residual was forecast
FORECAST_FALLBACK = "forecast-fallback"  # ... whose forecast was not finite, so the last residual was reused


SCORE_MEMORY = 0.5  # the running scores: weight of the newest measurement
# OrderScores.best charges an order for how its errors add up over the coming gaps (``accumulation``). Errors that
# alternate are credited as cancelling (ALTERNATING_COHERENCE) only by a cache whose metric does not estimate reuse's
# own error: TeaCache's input change does not; MagCache skips where its curve expects reuse to err little, and
# crediting alternation there made auto lose 1.8 dB to reuse at one MagCache threshold
ACCUMULATED_GAPS = 4
COHERENCE_RANGE = (0.0, 0.9)
ALTERNATING_COHERENCE = -0.5  # the lower bound in place of COHERENCE_RANGE's for a cache that credits alternation
WEIGHT_RANGE = (1.0, 2.0)  # ErrorPerMetric.weight: the record only ever brings a compute forward
# the forecast values under which a cache that weighs its metric by the forecast's record does so: 2nd order is not
# one (weighed, it lost quality per evaluation on one benchmark model; 1st order and auto gained on every one measured)
WEIGHED_ORDERS = (1, AUTO)


def check_order(order: int | str) -> int | str:
    """``order`` as an int, or ``AUTO``; ValueError unless it is one of ``ORDERS`` or ``AUTO``."""
    if order == AUTO:
        return AUTO
    if isinstance(order, str) or int(order) != order or int(order) not in ORDERS:
        raise ValueError(f"forecast order must be one of {ORDERS} or {AUTO!r}, got {order!r}")
    return int(order)


def history_limit(order: int | str) -> int:
    """How many residuals a branch keeps for ``order``: order + 1, and for ``AUTO`` one more than the highest
    order needs, to score it."""
    return MAX_ORDER + 2 if order == AUTO else int(order) + 1


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

    def forecast(self, coord: float | None, check_finite: bool = True, order: int | None = None) -> Forecast:
        """The residual at ``coord``: the extrapolation through the newest ``order + 1`` kept residuals (None: all
        of them, order = entries - 1; fewer kept: as many as there are), or the last residual when only one is
        used, ``coord`` is None, or (``check_finite``) the extrapolation is not finite. Computed in at least
        float32, returned in the residuals' dtype."""
        last = self.last
        used = len(self.residuals) if order is None else min(order + 1, len(self.residuals))
        usable = used > 1 and coord is not None and coord not in self.coords
        if not usable:
            return Forecast(last)
        out = self._extrapolate(self.coords[-used:], self.residuals[-used:], float(coord))
        if check_finite and not bool(torch.isfinite(out).all()):
            return Forecast(last, fell_back=True)
        return Forecast(out.to(last.dtype), order=used - 1)

    @staticmethod
    def _extrapolate(coords: list, residuals: list[torch.Tensor], coord: float) -> torch.Tensor:
        """The Lagrange extrapolation to ``coord`` (in at least float32, on the newest residual's device)."""
        last = residuals[-1]
        weights = lagrange_weights([float(c) for c in coords], coord)
        out = torch.zeros_like(last, dtype=torch.promote_types(last.dtype, torch.float32))
        for w, r in zip(weights, residuals):
            out.add_(r.to(device=last.device, dtype=out.dtype), alpha=w)
        return out

    def prediction_errors(self, coord: float | None, residual: torch.Tensor) -> list[torch.Tensor | None]:
        """Before ``residual`` (at ``coord``) is added, per order of ``ORDERS`` (None: not enough residuals of this
        shape with distinct coordinates): the squared L2 error e the forecast of that order from the kept residuals
        would have made predicting it; then the inner product of e with e', the error the same order made
        predicting the newest kept residual from the ones before it, and the squared norm of e'; last,
        ``residual``'s squared L2 norm. That is ``3 * len(ORDERS) + 1`` 0-d float32 tensors (``OrderScores.update``
        reads them), with no host sync."""
        count = len(ORDERS)
        measured: list[torch.Tensor | None] = [None] * (3 * count)
        comparable = (self.residuals and coord is not None and None not in self.coords and coord not in self.coords
                      and self.residuals[-1].shape == residual.shape)
        target = residual.float()
        if comparable:  # in place where the tensor is this method's own: at most two residual-sized errors at once
            for order in ORDERS:
                if order + 1 > len(self.residuals):
                    break
                made = self._extrapolate(self.coords[-order - 1:], self.residuals[-order - 1:], float(coord))
                error = made.to(target.device).sub_(target)
                measured[order] = error.square().sum()
                if order + 2 <= len(self.residuals):
                    before = self._extrapolate(self.coords[-order - 2:-1], self.residuals[-order - 2:-1],
                                               float(self.coords[-1]))
                    error_before = before.to(target.device).sub_(self.residuals[-1].to(target.device))
                    measured[count + order] = (error * error_before).sum()
                    measured[2 * count + order] = error_before.square().sum()
        return [*measured, target.square().sum()]


def running(old: float | None, new: float) -> float:
    """A running value moved toward ``new`` by ``SCORE_MEMORY`` (``new`` itself when there is none yet)."""
    return new if old is None else (1 - SCORE_MEMORY) * old + SCORE_MEMORY * new


def accumulation(coherence: float, low: float = COHERENCE_RANGE[0]) -> float:
    """How much a run of ``ACCUMULATED_GAPS`` errors of equal size whose consecutive ones correlate by
    ``coherence`` (bounded to ``low`` and ``COHERENCE_RANGE``'s upper bound) adds up to, relative to as many
    independent ones: the squared norm of their sum over its expectation for uncorrelated errors,
    ``1 + 2 * sum((1 - l / n) * rho ** l)`` (below 1 for errors that alternate)."""
    high = COHERENCE_RANGE[1]
    rho = min(high, max(low, coherence))
    gaps = ACCUMULATED_GAPS
    return 1 + 2 * sum((1 - lag / gaps) * rho ** lag for lag in range(1, gaps))


@dataclass
class OrderScores:
    """A branch's running relative squared error of each order (``errors[order]``, None: not measured yet), the
    running correlation of each order's consecutive errors (``coherence[order]``, None: not measured yet) and the
    running distance in the coordinate over which they were measured (``horizon``, None: not known).

    ``update`` takes one measurement (``ResidualHistory.prediction_errors`` as floats) and the distance from the
    newest kept residual to the predicted one: an order's score moves toward its error divided by the residual's
    squared norm, by ``SCORE_MEMORY``; so do its coherence, toward the cosine between its error and its error one
    computed step before, and ``horizon``.
    """

    errors: list[float | None] = field(default_factory=lambda: [None] * len(ORDERS))
    coherence: list[float | None] = field(default_factory=lambda: [None] * len(ORDERS))
    horizon: float | None = None

    def update(self, measured: list[float | None], horizon: float | None = None) -> None:
        count = len(ORDERS)
        norm = measured[-1]
        if norm is None:
            return
        for order in ORDERS:
            error, product, before = measured[order], measured[count + order], measured[2 * count + order]
            if error is None or not math.isfinite(error):
                continue
            self.errors[order] = running(self.errors[order], error / (norm + 1e-12))
            if product is not None and error > 0 and before is not None and before > 0 and math.isfinite(product):
                self.coherence[order] = running(self.coherence[order], product / math.sqrt(error * before))
        if horizon:
            self.horizon = running(self.horizon, horizon)

    def expected(self, order: int, low: float = COHERENCE_RANGE[0]) -> float | None:
        """``order``'s running relative error as it adds up over the coming gaps (``accumulation`` of its
        coherence, bounded below by ``low``; none while not measured)."""
        error, coherence = self.errors[order], self.coherence[order]
        return None if error is None else error * (1.0 if coherence is None else accumulation(coherence, low))

    def best(self, available: int = MAX_ORDER, horizon: float | None = None,
             low: float = COHERENCE_RANGE[0]) -> int:
        """The order (at most ``available``) expected to err least at ``horizon``; 0 (reuse) unless another one
        beats it. Relative to reuse, an order's squared error scales by ``(horizon / self.horizon) ** (2 * order)``
        (none when either distance is unknown), and each order's error counts as it adds up (``expected``, its
        coherence bounded below by ``low``)."""
        reuse = self.expected(0, low)
        if reuse is None:
            return 0
        scale = horizon / self.horizon if horizon and self.horizon else 1.0
        best, best_error = 0, reuse
        for order in range(1, min(available, MAX_ORDER) + 1):
            error = self.expected(order, low)
            if error is not None and error * scale ** (2 * order) < best_error:
                best, best_error = order, error * scale ** (2 * order)
        return best

    def clear(self) -> None:
        self.errors = [None] * len(ORDERS)
        self.coherence = [None] * len(ORDERS)
        self.horizon = None


@dataclass
class ErrorPerMetric:
    """A branch's record of the forecast's relative error per unit of the cache's metric, over its computed steps.

    ``update(error, metric)``: the relative (L2) error the forecast a skip would have used made predicting a computed
    step, and the unweighted metric that made the policy compute it. ``weight`` is the recent quotient (running, by
    ``SCORE_MEMORY``) over the mean of all of them, bounded to ``WEIGHT_RANGE`` (never below 1: where the forecast
    did well the metric alone decides); 1 until one is measured.
    """

    recent: float | None = None
    total: float = 0.0
    count: int = 0

    def update(self, error: float, metric: float | None) -> None:
        if metric is None or not metric > 0 or not math.isfinite(error):
            return
        quotient = error / metric
        self.recent = running(self.recent, quotient)
        self.total += quotient
        self.count += 1

    def weight(self) -> float:
        if self.recent is None or self.total <= 0:
            return 1.0
        low, high = WEIGHT_RANGE
        return min(high, max(low, self.recent * self.count / self.total))
