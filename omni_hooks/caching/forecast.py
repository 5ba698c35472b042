"""Forecasting a skipped step's block-stack residual from the residuals of the last computed steps.

A cache that skips a step adds a residual to the stack's input instead of running the blocks. Order 0 adds the residual
of the last computed step (plain reuse). Order k extrapolates the polynomial through the last k + 1 computed residuals
of the branch to the skipped step's coordinate: finite differences on a non-uniform grid (Lagrange form), the idea of
TaylorSeer (Liu et al., "From Reusing to Forecasting", 2025), here in the sampler's sigma (falling back to the step
index when the host gives no sigma), so that a polynomial-in-sigma residual of degree <= k is forecast exactly.

Every forecast is a weighted sum of the newest kept residuals, its weights computed from their coordinates alone
(``Candidate``): the orders above, and two more that ``AUTO`` may choose (``CANDIDATES``):

* ``TAYLOR``: the 2nd-order Taylor expansion about the newest computed step with TaylorSeer's derivative update across
  refreshes: the first derivative is the difference quotient of the two newest residuals, the second the change of
  that quotient since the refresh before, over the newest distance (so the derivatives lag by half a gap, which damps
  the 2nd-order term against Lagrange's);
* ``CHEBYSHEV``: a least-squares fit of Chebyshev polynomials up to ``CHEBYSHEV_DEGREE`` over the newest
  ``CHEBYSHEV_WINDOW`` residuals, its slope and curvature ridge-regularised (``CHEBYSHEV_RIDGE``), as Spectrum (Han et
  al., "Adaptive Spectral Feature Forecasting for Diffusion Sampling Acceleration", 2026) fits features over the run:
  more residuals than coefficients, so it smooths a trajectory that alternates instead of following it.

Memory: a branch keeps at most ``order + 1`` residuals (``ResidualHistory.limit``); the caches count them in
``cache_bytes``. A forecast that is not finite everywhere is replaced by the last residual (``Forecast.fell_back``).

``AUTO`` chooses the candidate per branch and skipped step from what the run has seen, with no extra model call: at
each computed step, before its residual joins the history, every candidate that has enough older residuals predicts it
from them (``ResidualHistory.prediction_errors``); ``CandidateScores`` keeps a running relative error per candidate and
the distance (in the coordinate) those predictions spanned. A skip uses the candidate whose error, carried to the
skip's own distance from the last computed step, is smallest: an order-k extrapolation errs like the distance to the
power k + 1, reuse like the distance (``Candidate.degree``), so a skip close to the last computed step favours the
candidates of higher degree and one far from it favours reuse. An error also counts as it adds up in the latent over the
coming gaps: each candidate's running correlation between its consecutive errors (``CandidateScores.coherence``; reuse
lagging a drift errs the same way at every gap) multiplies its error by ``accumulation`` (below 1 for errors that
alternate, where the cache credits that: ``StackCacheRun.coherence_floor``). Plain reuse unless a candidate beats it. An
auto branch keeps ``AUTO_KEPT`` residuals (the newest is scored against the ones before it). The scores are measured per
rank shard and averaged over the ranks (like the caches' metrics), so every rank of a group chooses the same one.

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
from typing import Callable

import torch

ORDERS = (0, 1, 2)  # the orders a cache can be set to (``forecast_order``)
MAX_ORDER = ORDERS[-1]
TAYLOR = 3      # candidates only AUTO chooses (``CANDIDATES``)
CHEBYSHEV = 4
AUTO = "auto"                            # the candidate chosen per branch and skipped step (CandidateScores)
FORECAST = "forecast"                   # BranchDecision.reason of a skipped branch whose residual was forecast
FORECAST_FALLBACK = "forecast-fallback"  # ... whose forecast was not finite, so the last residual was reused


SCORE_MEMORY = 0.5  # the running scores: weight of the newest measurement
# CandidateScores.best charges a candidate for how its errors add up over the coming gaps (``accumulation``). Errors
# that alternate are credited as cancelling (ALTERNATING_COHERENCE) only by a cache whose metric does not estimate
# reuse's own error: TeaCache's input change does not; MagCache skips where its curve expects reuse to err little, and
# crediting alternation there made auto lose 1.8 dB to reuse at one MagCache threshold
ACCUMULATED_GAPS = 4
COHERENCE_RANGE = (0.0, 0.9)
ALTERNATING_COHERENCE = -0.5  # the lower bound in place of COHERENCE_RANGE's for a cache that credits alternation
WEIGHT_RANGE = (1.0, 2.0)  # ErrorPerMetric.weight: the record only ever brings a compute forward
# the forecast values under which a cache that weighs its metric by the forecast's record does so: 2nd order is not
# one (weighed, it lost quality per evaluation on one benchmark model; 1st order and auto gained on every one measured)
WEIGHED_ORDERS = (1, AUTO)
CHEBYSHEV_WINDOW = 4   # residuals the Chebyshev fit spans
CHEBYSHEV_DEGREE = 2   # T0, T1, T2: one coefficient fewer than the window has residuals
CHEBYSHEV_RIDGE = 0.1  # on the slope and curvature coefficients, the window mapped onto [-1, 1] (Spectrum's 0.1)


def check_order(order: int | str) -> int | str:
    """``order`` as an int, or ``AUTO``; ValueError unless it is one of ``ORDERS`` or ``AUTO``."""
    if order == AUTO:
        return AUTO
    if isinstance(order, str) or int(order) != order or int(order) not in ORDERS:
        raise ValueError(f"forecast order must be one of {ORDERS} or {AUTO!r}, got {order!r}")
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


def taylor_weights(nodes: list[float], x: float) -> list[float]:
    """TaylorSeer's 2nd-order step from the three ``nodes`` (oldest first) to ``x``, as weights on their residuals:
    ``r2 + dx * d1 + dx ** 2 / 2 * d2`` with ``d1 = (r2 - r1) / h2``, the quotient before it ``(r1 - r0) / h1`` and
    ``d2 = (d1 - that) / h2`` (``h1``, ``h2``: the two distances, ``dx = x - nodes[2]``). Exact for linear
    residuals; for curved ones the lagged derivatives make it err less than Lagrange far from the nodes and more
    near them. Python floats, like ``lagrange_weights``."""
    t0, t1, t2 = nodes
    h1, h2, dx = t1 - t0, t2 - t1, x - t2
    half = dx * dx / 2
    return [half / (h1 * h2), -dx / h2 - half * (1 / h2 + 1 / h1) / h2, 1 + dx / h2 + half / (h2 * h2)]


def chebyshev_weights(nodes: list[float], x: float, degree: int = CHEBYSHEV_DEGREE,
                      ridge: float = CHEBYSHEV_RIDGE) -> list[float]:
    """Weights on the ``nodes``' residuals of the ridge-regularised least-squares fit by Chebyshev polynomials
    ``T_0 .. T_degree``, evaluated at ``x``: the nodes and ``x`` mapped onto [-1, 1], ``ridge`` added to every
    coefficient's normal equation but ``T_0``'s (the level is never shrunk, so constant residuals are reproduced
    exactly). Python floats: the same weights on every rank."""
    lo, hi = min(*nodes, x), max(*nodes, x)
    centre, half = (lo + hi) / 2, (hi - lo) / 2 or 1.0

    def basis(t: float) -> list[float]:
        tau = (t - centre) / half
        values = [1.0, tau]
        while len(values) <= degree:
            values.append(2 * tau * values[-1] - values[-2])
        return values[:degree + 1]

    rows = [basis(t) for t in nodes]
    size = degree + 1
    normal = [[sum(r[i] * r[j] for r in rows) + (ridge if i == j and i > 0 else 0.0) for j in range(size)]
              for i in range(size)]
    # weights = basis(x)^T normal^-1 rows^T: solve normal^T a = basis(x) (normal is symmetric), then w_j = a . rows_j
    a = solve(normal, basis(x))
    return [sum(ai * ri for ai, ri in zip(a, r)) for r in rows]


def solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """``matrix^-1 rhs`` for a small non-singular matrix, by Gaussian elimination with partial pivoting."""
    n = len(rhs)
    m = [list(row) + [b] for row, b in zip(matrix, rhs)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [a - f * b for a, b in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


@dataclass(frozen=True)
class Candidate:
    """A forecast: a weighted sum of the branch's ``needs`` newest residuals, the weights from their coordinates
    and the target's (``weights(nodes, x)``). ``key``: its place in ``CANDIDATES`` (0 to 2 are also the forecast
    orders a user sets); ``degree``: its error grows like the distance to the power ``degree`` + 1
    (``CandidateScores.best`` carries scores to a skip's distance by it)."""

    key: int
    name: str
    needs: int
    degree: int
    weights: Callable[[list[float], float], list[float]]


CANDIDATE = {
    0: Candidate(0, "reuse", 1, 0, lagrange_weights),
    1: Candidate(1, "1st order", 2, 1, lagrange_weights),
    2: Candidate(2, "2nd order", 3, 2, lagrange_weights),
    TAYLOR: Candidate(TAYLOR, "Taylor", 3, 1, taylor_weights),
    CHEBYSHEV: Candidate(CHEBYSHEV, "Chebyshev fit", CHEBYSHEV_WINDOW, 1, chebyshev_weights),
}
CANDIDATES = tuple(CANDIDATE)  # what AUTO scores, in this order
CANDIDATE_NAMES = {key: c.name for key, c in CANDIDATE.items()}
AUTO_KEPT = max(c.needs for c in CANDIDATE.values()) + 1  # the newest is scored against the ones before it


def history_limit(order: int | str) -> int:
    """How many residuals a branch keeps for ``order``: order + 1, and for ``AUTO`` ``AUTO_KEPT``."""
    return AUTO_KEPT if order == AUTO else int(order) + 1


@dataclass
class Forecast:
    """A skipped branch's residual: ``residual`` (None: nothing cached) and how it was made."""

    residual: torch.Tensor | None
    candidate: int = 0          # the candidate actually used (its key; 0: the last residual)
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

    def forecast(self, coord: float | None, check_finite: bool = True, candidate: int | None = None) -> Forecast:
        """The residual at ``coord``: the forecast of the candidate keyed ``candidate`` from the newest kept residuals
        (None: the Lagrange extrapolation through all of them, of order entries - 1; a candidate that needs more
        residuals than are kept: the highest Lagrange order they allow), or the last residual when only one is used,
        ``coord`` is None, or (``check_finite``) the forecast is not finite. Computed in at least float32, returned in
        the residuals' dtype."""
        last = self.last
        kept = len(self.residuals)
        used = CANDIDATE[min(kept - 1, MAX_ORDER) if candidate is None else candidate] if kept else CANDIDATE[0]
        if used.needs > kept:
            used = CANDIDATE[min(kept - 1, MAX_ORDER)]
        usable = used.needs > 1 and coord is not None and coord not in self.coords
        if not usable:
            return Forecast(last)
        out = self._combine(used, self.coords, self.residuals, float(coord))
        if check_finite and not bool(torch.isfinite(out).all()):
            return Forecast(last, fell_back=True)
        return Forecast(out.to(last.dtype), candidate=used.key)

    @staticmethod
    def _combine(candidate: Candidate, coords: list, residuals: list[torch.Tensor], coord: float) -> torch.Tensor:
        """``candidate``'s forecast at ``coord`` from the newest ``candidate.needs`` of ``residuals`` (at their
        ``coords``), in at least float32, on the newest residual's device."""
        used = residuals[-candidate.needs:]
        last = used[-1]
        weights = candidate.weights([float(c) for c in coords[-candidate.needs:]], coord)
        out = torch.zeros_like(last, dtype=torch.promote_types(last.dtype, torch.float32))
        for w, r in zip(weights, used):
            out.add_(r.to(device=last.device, dtype=out.dtype), alpha=w)
        return out

    def prediction_errors(self, coord: float | None, residual: torch.Tensor) -> list[torch.Tensor | None]:
        """Before ``residual`` (at ``coord``) is added, per candidate of ``CANDIDATES`` (None: not enough residuals
        of this shape with distinct coordinates): the squared L2 error e the candidate's forecast from the kept
        residuals would have made predicting it; then the inner product of e with e', the error the same candidate
        made predicting the newest kept residual from the ones before it, and the squared norm of e'; last,
        ``residual``'s squared L2 norm. That is ``3 * len(CANDIDATES) + 1`` 0-d float32 tensors
        (``CandidateScores.update`` reads them), with no host sync."""
        count = len(CANDIDATES)
        measured: list[torch.Tensor | None] = [None] * (3 * count)
        comparable = (self.residuals and coord is not None and None not in self.coords and coord not in self.coords
                      and self.residuals[-1].shape == residual.shape)
        target = residual.float()
        if comparable:  # in place where the tensor is this method's own: at most two residual-sized errors at once
            newest = self.residuals[-1].to(target.device)
            for i, key in enumerate(CANDIDATES):
                candidate = CANDIDATE[key]
                if candidate.needs > len(self.residuals):
                    continue
                made = self._combine(candidate, self.coords, self.residuals, float(coord))
                error = made.to(target.device).sub_(target)
                measured[i] = error.square().sum()
                if candidate.needs + 1 <= len(self.residuals):
                    before = self._combine(candidate, self.coords[:-1], self.residuals[:-1], float(self.coords[-1]))
                    error_before = before.to(target.device).sub_(newest)
                    measured[count + i] = (error * error_before).sum()
                    measured[2 * count + i] = error_before.square().sum()
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
class CandidateScores:
    """A branch's running relative squared error of each candidate (``errors[key]``, None: not measured yet), the
    running correlation of each candidate's consecutive errors (``coherence[key]``, None: not measured yet) and the
    running distance in the coordinate over which they were measured (``horizon``, None: not known). Indexed by
    candidate key (``CANDIDATES`` is ``0 .. n - 1``).

    ``update`` takes one measurement (``ResidualHistory.prediction_errors`` as floats) and the distance from the
    newest kept residual to the predicted one: a candidate's score moves toward its error divided by the residual's
    squared norm, by ``SCORE_MEMORY``; so do its coherence, toward the cosine between its error and its error one
    computed step before, and ``horizon``.
    """

    errors: list[float | None] = field(default_factory=lambda: [None] * len(CANDIDATES))
    coherence: list[float | None] = field(default_factory=lambda: [None] * len(CANDIDATES))
    horizon: float | None = None

    def update(self, measured: list[float | None], horizon: float | None = None) -> None:
        count = len(CANDIDATES)
        norm = measured[-1]
        if norm is None:
            return
        for key in CANDIDATES:
            error, product, before = measured[key], measured[count + key], measured[2 * count + key]
            if error is None or not math.isfinite(error):
                continue
            self.errors[key] = running(self.errors[key], error / (norm + 1e-12))
            if product is not None and error > 0 and before is not None and before > 0 and math.isfinite(product):
                self.coherence[key] = running(self.coherence[key], product / math.sqrt(error * before))
        if horizon:
            self.horizon = running(self.horizon, horizon)

    def expected(self, key: int, low: float = COHERENCE_RANGE[0]) -> float | None:
        """Candidate ``key``'s running relative error as it adds up over the coming gaps (``accumulation`` of its
        coherence, bounded below by ``low``; none while not measured)."""
        error, coherence = self.errors[key], self.coherence[key]
        return None if error is None else error * (1.0 if coherence is None else accumulation(coherence, low))

    def best(self, kept: int = AUTO_KEPT, horizon: float | None = None, low: float = COHERENCE_RANGE[0]) -> int:
        """The candidate (of those needing at most ``kept`` residuals) expected to err least at ``horizon``; 0
        (reuse) unless another one beats it. Relative to reuse, a candidate's squared error scales by
        ``(horizon / self.horizon) ** (2 * degree)`` (its ``Candidate.degree``; none when either distance is unknown),
        and each candidate's error counts as it adds up (``expected``, its coherence bounded below by ``low``)."""
        reuse = self.expected(0, low)
        if reuse is None:
            return 0
        scale = horizon / self.horizon if horizon and self.horizon else 1.0
        best, best_error = 0, reuse
        for key in CANDIDATES[1:]:
            candidate = CANDIDATE[key]
            error = self.expected(key, low)
            if candidate.needs <= kept and error is not None and error * scale ** (2 * candidate.degree) < best_error:
                best, best_error = key, error * scale ** (2 * candidate.degree)
        return best

    def clear(self) -> None:
        self.errors = [None] * len(CANDIDATES)
        self.coherence = [None] * len(CANDIDATES)
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
