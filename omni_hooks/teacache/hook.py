"""TeaCache: the decision policy on top of the shared block-stack cache mechanics (``omni_hooks.caching``).

The algorithm is the TeaCache paper's (Liu et al. 2024). The hooks sit on the model's own blocks (``BlockStack``), so
the model's forward runs unchanged; only the modulated input it measures is model-specific (a family's ``StackSignal``).

Decision per branch: the relative L1 change of the modulated input since the previous call of that branch is mapped
through the rescale polynomial and accumulated; while the sum stays below ``threshold`` the branch may reuse. Under
the "auto" and 1st-order forecasts the sum is weighed by the forecast's record first (``ErrorPerMetric``, 1 to 2:
above 1 where the forecast has recently erred more per unit of change than over the run).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from ..blockstack import BlockStack, StackSignal
from ..context import CallContext
from ..caching.forecast import ALTERNATING_COHERENCE
from ..caching.run import StackCacheRun
from ..caching.state import ActiveCall, Decision
from ..caching.stats import CALIBRATE, FIRST, FORCED, MEASURE, REUSE, SHAPE, THRESHOLD, WINDOW, CacheRunStats
from .config import DEFAULT_RECOMMENDED_THRESHOLD, RECOMMENDED_SPEEDUP, TeaCacheConfig
from .state import TeaCacheState

HOOK_NAMES = ("teacache", "teacache_block", "teacache_tail", "teacache_capture")

def relative_l1(current: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """mean|current - previous| / mean|previous| as a 0-d tensor (no host sync)."""
    return (current - previous).abs().mean() / (previous.abs().mean() + 1e-8)


class TeaCacheRun(StackCacheRun):
    """TeaCache's hooks on one model for one sampling run: the host brackets each model call with
    ``begin_call(CallContext)`` / ``end_call()``; ``remove()`` takes the hooks off."""

    hook_names = HOOK_NAMES
    weighs_metric_by_forecast = True
    coherence_floor = ALTERNATING_COHERENCE  # its change metric does not choose skips by reuse's error

    def __init__(self, config: TeaCacheConfig, stack: BlockStack, modulated_input: StackSignal,
                 stats: CacheRunStats | None = None):
        super().__init__(stack, TeaCacheState, config, stats or CacheRunStats("teacache", config),
                         capture_module=modulated_input.capture)
        self.config: TeaCacheConfig = config
        self.modulated_input = modulated_input
        self.rescale = np.poly1d(config.coefficients)

    def calibration_series(self) -> list[list[tuple[float, float]]]:
        """The (modulated-input change, stack-output change) pairs recorded in calibration mode: one list per branch,
        in step order (the first step has none)."""
        return [list(self.branch_state(key).calibration_pairs) for key in self.states.contexts()]

    def _forced_reason(self, info: CallContext) -> str | None:
        if info.step is None or not info.total_steps:
            return None
        cfg = self.config
        if info.step < cfg.ret_steps or (cfg.force_last_step and info.step >= info.total_steps - 1):
            return FORCED
        if not cfg.in_window(info.step, info.total_steps):
            return WINDOW
        return None

    def decide_branches(self, call: ActiveCall, head: torch.nn.Module, args: tuple, kwargs: dict,
                        hidden: torch.Tensor, size: int) -> list[Decision]:
        cfg = self.config
        modulated = self.modulated_input.compute(head, args, kwargs, call.captured)
        per_branch = modulated.shape[0] == hidden.shape[0]
        forced = self._forced_reason(call.context)
        reasons: list[str] = []
        measured: list[torch.Tensor | None] = [None] * len(call.keys)
        states = [self.branch_state(k) for k in call.keys]
        signals = []
        for i, st in enumerate(states):
            st.unweighted_metric = None
            m = modulated[i * size:(i + 1) * size] if per_branch else modulated
            signals.append(m)
            prev = st.previous_modulated_input
            if cfg.calibrate:
                reasons.append(CALIBRATE)
                if prev is not None and prev.shape == m.shape:
                    measured[i] = relative_l1(m, prev)
            elif st.cnt == 0 or prev is None:
                reasons.append(FIRST)
            elif prev.shape != m.shape or st.residual_input_shape != hidden[i * size:(i + 1) * size].shape:
                reasons.append(SHAPE)
            elif forced:
                reasons.append(forced)
            else:
                reasons.append(MEASURE)
                measured[i] = relative_l1(m, prev)
        rels = self.measured_floats(call, measured)  # one host sync (and, under SP, the mean over ranks)
        metrics: list[float | None] = [None] * len(states)
        for i, rel in enumerate(rels):
            if rel is None:
                continue
            if cfg.calibrate:
                call.head_measures[call.keys[i]] = rel
                continue
            states[i].accumulated_rel_l1_distance += abs(float(self.rescale(rel)))
            states[i].unweighted_metric = states[i].accumulated_rel_l1_distance
            weight = self.metric_weight(states[i])
            metrics[i] = states[i].accumulated_rel_l1_distance * weight
            reasons[i] = REUSE if metrics[i] < cfg.threshold else THRESHOLD
            if reasons[i] == THRESHOLD and states[i].unweighted_metric < cfg.threshold:
                self.stats.computed_sooner(weight)
        for st, m in zip(states, signals):
            st.previous_modulated_input = m.detach()
            st.cnt += 1
        return [Decision(r, metric) for r, metric in zip(reasons, metrics)]

    def after_decision(self, call: ActiveCall, compute: bool) -> None:
        if compute:
            for key in call.keys:
                self.branch_state(key).accumulated_rel_l1_distance = 0.0

    def on_residual(self, call: ActiveCall, key: str, residual: torch.Tensor, output: torch.Tensor) -> None:
        cfg = self.config
        if not cfg.calibrate:
            return
        st = self.branch_state(key)
        rel_in = call.head_measures.get(key)
        if rel_in is not None and st.previous_output is not None and st.previous_output.shape == output.shape:
            st.calibration_pairs.append((rel_in, relative_l1(output, st.previous_output.to(output.device)).item()))
        st.previous_output = output.to(cfg.cache_device) if cfg.cache_device is not None else output.clone()


def apply_teacache_hook(stack: BlockStack, config: TeaCacheConfig, modulated_input: StackSignal,
                        stats: CacheRunStats | None = None) -> TeaCacheRun:
    """Install TeaCache on a block stack and return the run that drives it (``begin_call``/``end_call``/``remove``)."""
    run = TeaCacheRun(config, stack, modulated_input, stats)
    run.install()
    return run


def fit_coefficients(pairs: list[tuple[float, float]], degree: int = 4) -> list[float]:
    """Least-squares polynomial (highest degree first) mapping input change to output change.

    Same fit as vllm-omni's ``coefficient_estimator.py`` (numpy.polyfit, degree 4). Needs more distinct points than
    the degree; raises ValueError otherwise.
    """
    if len({round(x, 12) for x, _ in pairs}) <= degree:
        raise ValueError(f"need more than {degree} distinct calibration points to fit a degree-{degree} polynomial, "
                         f"got {len(pairs)} pairs; sample more steps or prompts")
    x = np.array([p[0] for p in pairs], dtype=np.float64)
    y = np.array([p[1] for p in pairs], dtype=np.float64)
    return [float(c) for c in np.polyfit(x, y, degree)]


def recommended_threshold(coefficients: Sequence[float], series: Sequence[Sequence[tuple[float, float]]],
                          speedup: float = RECOMMENDED_SPEEDUP) -> float:
    """The threshold at which TeaCache with ``coefficients`` would have computed about ``1/speedup`` of the steps of
    the calibrating run that recorded ``series`` (``TeaCacheRun.calibration_series``): the largest one (to 3
    significant digits) that still computes at least that many, replaying the run's decisions branch by branch (its
    first step computed, then reuse while the accumulated rescaled change stays below the threshold).
    ``DEFAULT_RECOMMENDED_THRESHOLD`` when the series hold no step to replay."""
    rescale = np.poly1d(coefficients)
    changes = [[abs(float(rescale(x))) for x, _ in branch] for branch in series if branch]
    if not changes:
        return DEFAULT_RECOMMENDED_THRESHOLD
    steps = sum(len(branch) + 1 for branch in changes)
    wanted = math.ceil(steps / speedup)

    def computed(threshold: float) -> int:
        count = 0
        for branch in changes:
            count += 1  # the first step
            accumulated = 0.0
            for change in branch:
                accumulated += change
                if accumulated >= threshold:
                    count += 1
                    accumulated = 0.0
        return count

    low, high = 0.0, max(sum(branch) for branch in changes) + 1.0  # computed(low) >= wanted > computed(high)
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if computed(middle) >= wanted else (low, middle)
    if low <= 0.0:
        return 0.0
    scale = 10.0 ** (2 - math.floor(math.log10(low)))
    return math.floor(low * scale) / scale  # rounded down: it computes at least as many steps
