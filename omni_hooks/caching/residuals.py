"""What a cache run does with its branches' residuals besides keeping them, one class per job: a skip's residual from
the forecast, and the candidates scored on each computed one (``Forecaster``); the skipped steps corrected once the
step after them is computed (``Corrector``); the step profile a calibrating run measures (``ProfileRecorder``).
``StackCacheRun.skipped_residuals`` and ``StackCacheRun.store_residual`` call them in turn.
"""
from __future__ import annotations

import math

import torch

from ..context import CallContext
from .budget import SKETCH_SIZE, SKETCH_VALUES, StepProfile
from .config import StackCacheConfig
from .forecast import AUTO, AUTO_KEPT, CANDIDATES, FORECAST, FORECAST_FALLBACK, history_limit
from .state import ActiveCall, CachedResidualState, measured_floats
from .stats import CacheRunStats


def coordinate(context: CallContext) -> float | None:
    """Where a call lies for forecasting: its sigma, else its step (None: unknown, so no forecast)."""
    return context.sigma if context.sigma is not None else context.step


def distance(st: CachedResidualState, coord: float | None) -> float | None:
    """How far ``coord`` lies from the branch's last computed step (None: either is unknown)."""
    last = st.history.coords[-1] if st.history.coords else None
    return None if coord is None or last is None else abs(float(coord) - float(last))


class Forecaster:
    """The forecast of a run whose ``config.forecast_order`` is set (``forecast``): a skipped branch's residual from
    its history, and on a computed call each candidate scored (under "auto") and the history extended.
    ``weighs_metric``: the run's policy weighs its metric by the forecast's record (``ErrorPerMetric``);
    ``coherence_floor``: the lowest coherence a candidate's errors are credited with under "auto"."""

    def __init__(self, config: StackCacheConfig, stats: CacheRunStats, weighs_metric: bool, coherence_floor: float):
        self.config = config
        self.stats = stats
        self.weighs_metric = weighs_metric
        self.coherence_floor = coherence_floor

    def residuals(self, call: ActiveCall, states: list[CachedResidualState]) -> list[torch.Tensor]:
        """Per branch of the skipped call: its forecast residual. The branch's reason in the call's record becomes
        "forecast" (or "forecast-fallback" when the forecast was not finite)."""
        coord = coordinate(call.context)
        residuals = []
        for i, st in enumerate(states):
            candidate = (st.scores.best(len(st.history.residuals), distance(st, coord), self.coherence_floor)
                         if self.config.forecast_order == AUTO else None)
            made = st.history.forecast(coord, candidate=candidate)
            residuals.append(made.residual if made.residual is not None else st.previous_residual)
            reason = FORECAST_FALLBACK if made.fell_back else FORECAST if made.candidate else None
            if call.record is not None and i < len(call.record.branches):
                call.record.branches[i].candidate = made.candidate
                if reason:
                    call.record.branches[i].reason = reason
            if made.fell_back:
                self.stats.warn("a forecast residual was not finite; those steps reused the last computed residual "
                                f"({FORECAST_FALLBACK!r} in the per-step reasons)")
        return residuals

    def computed(self, call: ActiveCall, states: list[CachedResidualState]) -> None:
        """After a computed call stored each branch's residual (``previous_residual``): score the candidates on
        predicting it (under "auto", or for a policy that ``weighs_metric``), then add it to the history."""
        coord = coordinate(call.context)
        scoring = self.config.forecast_order == AUTO or self.weighs_metric
        measured: list[torch.Tensor | None] = []
        distances: list[float | None] = []
        for st in states:
            if scoring:
                distances.append(distance(st, coord))
                measured += st.history.prediction_errors(coord, st.previous_residual)
            st.history.limit = history_limit(self.config.forecast_order)
            st.history.add(coord, st.previous_residual)
        if measured:
            self.score(call, states, measured, distances)

    def score(self, call: ActiveCall, states: list[CachedResidualState], measured: list[torch.Tensor | None],
              distances: list[float | None]) -> None:
        """Update each branch's ``CandidateScores`` from its prediction errors (``ResidualHistory.prediction_errors``,
        concatenated over the call's branches) made over ``distances``: one host sync, and under sequence
        parallelism the means over the ranks, so that every rank chooses the same candidates. A policy that weighs its
        metric by the forecast also scores the candidate a skip at that distance would have used against the metric
        that made this call compute (``ErrorPerMetric``)."""
        floats = measured_floats(call, measured)
        width = len(floats) // len(states)
        for i, st in enumerate(states):
            branch = floats[i * width:(i + 1) * width]
            errors, norm = branch[:len(CANDIDATES)], branch[-1]
            if self.weighs_metric and norm is not None:
                order = self.config.forecast_order  # a set order forecasts by the candidate of that key
                error = errors[st.scores.best(AUTO_KEPT, distances[i], self.coherence_floor)
                               if order == AUTO else order]
                error = errors[0] if error is None else error
                if error is not None:
                    st.error_per_metric.update(math.sqrt(error / (norm + 1e-12)), st.unweighted_metric)
            st.scores.update(branch, distances[i])


class Corrector:
    """Skip correction (``skip_correction``) for a run whose ``config.skip_correction`` is above 0: what the skipped
    steps used, and on the computed step after them, what its stack output adds."""

    def __init__(self, config: StackCacheConfig, stats: CacheRunStats, streams: int):
        self.config = config
        self.stats = stats
        self.streams = streams

    def applies(self, context: CallContext) -> bool:
        """Whether this call takes part: the sampler takes Euler steps (or, under a speed-up, is one whose gaps are
        weighed by its step weights: ``weights``), the call's sigma and step within a known schedule are known, and
        the stack has one stream. The first call that cannot says why in the run's statistics
        (``CacheRunStats.skip_correction_note``)."""
        why = None
        if not context.euler_steps and self.weights(context) is None:
            why = ("the sampler does not take plain Euler steps (use the sampler 'euler', or the speed-up, which also "
                   "corrects 'uni_pc', 'dpmpp_2m' and 'res_multistep'; other samplers move the latent otherwise, with "
                   "several evaluations per step or outputs combined across steps, which the correction does not "
                   "model)")
        elif context.sigma is None or context.step is None or not context.schedule \
                or context.step + 1 >= len(context.schedule):
            why = "the host could not tell this call's sigma and step"
        elif self.streams > 1:
            why = "this model's block stack carries several streams"
        if why is not None and self.stats.skip_correction_note is None:
            self.stats.skip_correction_note = f"skip correction: not applied, {why}"
        return why is None

    def weights(self, context: CallContext) -> tuple[float, ...] | None:
        """The step weights a gap is weighed by (``skip_correction``): the sampler's under a speed-up with a sampler
        of ``CallContext.weighted_correction``; None: the sigma steps (plain Euler), or no correction."""
        usable = (not context.euler_steps and context.weighted_correction and self.config.speedup > 0
                  and context.step_weights is not None and context.schedule is not None
                  and len(context.step_weights) == len(context.schedule) - 1)
        return context.step_weights if usable else None

    def weight(self, context: CallContext) -> float | None:
        """This call's step weight for ``SkipCorrection`` (None: its sigma step)."""
        weights = self.weights(context)
        return None if weights is None else float(weights[context.step])

    @staticmethod
    def next_sigma(context: CallContext) -> float:
        """The sigma the call's step moves to (its schedule is known: ``applies``)."""
        return context.schedule[context.step + 1]

    def skipped(self, context: CallContext, states: list[CachedResidualState], residuals: list[torch.Tensor]) -> None:
        """Record, per branch, the residual a skipped call used."""
        weight = self.weight(context)
        for st, residual in zip(states, residuals):
            st.skips.skipped(residual, context.sigma, self.next_sigma(context), weight)

    def corrections(self, context: CallContext, states: list[CachedResidualState],
                    parts: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Per branch of a computed call (its new residual in ``parts``, before it is kept): what its stack output
        adds for the skipped steps before it (None: nothing)."""
        out = []
        weight = self.weight(context)
        self.stats.corrected_by_weights |= weight is not None
        for st, part in zip(states, parts):
            out.append(st.skips.correction(st.previous_residual, st.residual_sigma, part, context.sigma,
                                           self.next_sigma(context), self.config.skip_correction, weight))
            st.residual_sigma = context.sigma
        return out

    def corrected(self, output: torch.Tensor, corrections: list[torch.Tensor | None]) -> torch.Tensor | None:
        """``output`` plus each branch's correction (one chunk per branch), counted; None when nothing is
        corrected."""
        if not any(c is not None for c in corrections):
            return None
        self.stats.corrected_steps += 1
        size = output.shape[0] // len(corrections)
        return torch.cat([output[i * size:(i + 1) * size] + (c.to(output.dtype) if c is not None else 0)
                          for i, c in enumerate(corrections)])


def relative_change(current: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """``|current - previous| / |previous|`` (L2, in float32) as a 0-d tensor, no host sync."""
    prev = previous.to(current.device).float()
    return ((current.float() - prev).square().sum() / (prev.square().sum() + 1e-12)).sqrt()


SKETCH_ROWS_AT_ONCE = 4096  # rows of a residual ``sketch`` takes at once (its temporaries: 16 MB in float32)


def sketch(part: torch.Tensor) -> torch.Tensor:
    """``SKETCH_SIZE`` numbers standing for a branch's residual (all of a smaller one), float32: the residual cut into
    rows of ``SKETCH_SIZE`` values (the last one padded with zeros), each row multiplied by a fixed random sign
    (``row_signs``), summed. Linear, and it keeps the norm of a difference of two residuals in expectation (a random
    projection), with every value of the residual counted, not a few sampled."""
    flat = part.reshape(-1)
    if flat.numel() <= SKETCH_SIZE:
        return flat.float()
    rows = -(-flat.numel() // SKETCH_SIZE)
    signs = row_signs(rows).to(flat.device)
    out = torch.zeros(SKETCH_SIZE, dtype=torch.float32, device=flat.device)
    for first in range(0, rows, SKETCH_ROWS_AT_ONCE):  # bounded temporaries, whatever the residual's size
        block = flat[first * SKETCH_SIZE:(first + SKETCH_ROWS_AT_ONCE) * SKETCH_SIZE].float()
        block = torch.nn.functional.pad(block, (0, -block.numel() % SKETCH_SIZE)).view(-1, SKETCH_SIZE)
        out += (block * signs[first:first + block.shape[0], None]).sum(dim=0)
    return out


def row_signs(rows: int) -> torch.Tensor:
    """``rows`` signs (+1 / -1, float32), the same in every process and run (a generator of its own, seed 0)."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 2, (rows,), generator=generator).float() * 2 - 1


class ProfileRecorder:
    """While calibrating: per step, its sigma, each branch's relative residual change and a sketch of its residuals
    (``sketch``; ``step_profile``). Under sequence parallelism a rank sketches its own shard (the calibration file is
    rank 0's)."""

    def __init__(self) -> None:
        self.changes: dict[int, tuple[float, list[float]]] = {}
        self.sketches: dict[int, list[float]] = {}  # step -> its first call's branches' sketches, one after another

    @staticmethod
    def measure(states: list[CachedResidualState], parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each branch's change from its kept residual to its new one (``parts``, before it is kept)."""
        return [relative_change(part, st.previous_residual) for st, part in zip(states, parts)
                if st.previous_residual is not None and st.previous_residual.shape == part.shape]

    def record(self, call: ActiveCall, changes: list[torch.Tensor], parts: list[torch.Tensor]) -> None:
        """Add a computed call's changes (``measure``) to its step, and the sketch of its residuals (``parts``) if the
        step has none yet."""
        step, sigma = call.context.step, call.context.sigma
        if step is not None and sigma is not None and (changes or not self.changes):
            values = measured_floats(call, changes) if changes else [0.0]  # the first step: no change of its own
            self.changes.setdefault(step, (sigma, []))[1].extend(values)
            if step not in self.sketches:
                self.sketches[step] = torch.cat([sketch(part) for part in parts]).tolist()

    def step_profile(self) -> StepProfile | None:
        """What a calibrating run measured for a forward budget: per computed step its sigma, the relative change
        of the residual from the step before (mean over the branches and calls of the step) and its sketch (strided
        further where the run's sketches would hold over ``SKETCH_VALUES`` values; none where a step's differs in
        length or is not finite); None with fewer than two steps measured or a change that is not a finite number (a
        model that produced NaN)."""
        points = sorted(self.changes.items())
        sigmas = [sigma for _, (sigma, _) in points]
        changes = [sum(values) / len(values) for _, (_, values) in points]
        if len(points) < 2 or not all(math.isfinite(v) for v in sigmas + changes):
            return None
        sketches = [self.sketches.get(step) for step, _ in points]
        if any(k is None for k in sketches) or len({len(k) for k in sketches}) != 1 \
                or not all(math.isfinite(v) for k in sketches for v in k):
            return StepProfile(tuple(sigmas), tuple(changes))
        stride = -(-len(sketches[0]) // max(1, SKETCH_VALUES // len(sketches)))
        return StepProfile(tuple(sigmas), tuple(changes), tuple(tuple(k[::stride]) for k in sketches))
