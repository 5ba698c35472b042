"""MagCache: the decision policy on top of the shared block-stack cache mechanics (``omni_hooks.caching``).

After vllm-omni ``vllm_omni/diffusion/cache/magcache/hook.py`` and diffusers ``hooks/mag_cache.py`` (MagCache paper,
Ma et al. 2025), on the model's own blocks (``BlockStack``): the shared head hook decides per branch, a skip passes
every block through and adds the cached residual once, at the tail; the tail stores each computed call's residual
and, while calibrating, records the magnitude ratio, its spread and the cosine distance to the previous residual, per
branch. Every call advances the branch's step, computed or skipped (the step is taken at the head, so a
single-block stack is no exception).

Decision per branch at step t of N (its own curve, nearest-interpolated to N): outside the start/end window or
before the retention step ``int(retention_ratio * N + 0.5)`` compute (accumulators restart); else
``ratio *= mag_ratios[t]``, ``steps += 1``, ``err += |1 - ratio|`` and reuse iff ``threshold > 0``,
``err <= threshold`` and ``steps <= K`` (and a residual of the same shape is cached). The call is skipped only if
every branch may reuse; a computed call restarts every branch's accumulators. Under the "auto" forecast the
accumulated error is not weighed by the forecast's record (``ErrorPerMetric``), as TeaCache's change is: the
per-step curve already tells where the residual moves (docs/benchmarks.md).
"""
from __future__ import annotations

import logging

import torch

from ..blockstack import BlockStack
from ..context import CallContext
from ..caching.run import StackCacheRun
from ..caching.state import ActiveCall, Decision
from ..caching.stats import CALIBRATE, MAX_SKIPS, RETENTION, REUSE, THRESHOLD, WINDOW, CacheRunStats
from .config import MagCacheConfig
from .state import MagCacheState

log = logging.getLogger("omni_hooks")

HOOK_NAMES = ("mag_cache_leader_block_hook", "mag_cache_block_hook", "mag_cache_tail_hook", "mag_cache_capture")


def residual_change(current: torch.Tensor, previous: torch.Tensor) -> tuple[float, float, float]:
    """(mean, std) over tokens of ``||r_t|| / (||r_{t-1}|| + 1e-8)`` and mean ``1 - cos(r_t, r_{t-1})``.

    Norms and cosines over the last dimension, in float32 (Zehong-Ma MagCache calibration, vllm-omni, diffusers
    ``_perform_calibration_step``). One host sync.
    """
    cur = current.detach().float()
    prev = previous.detach().to(device=cur.device, dtype=torch.float32)
    if cur.ndim < 2:
        cur, prev = cur.reshape(1, -1), prev.reshape(1, -1)
    ratios = cur.norm(dim=-1) / (prev.norm(dim=-1) + 1e-8)
    cos = torch.nn.functional.cosine_similarity(cur, prev, dim=-1, eps=1e-8)
    std = ratios.std() if ratios.numel() > 1 else torch.zeros((), device=cur.device)
    values = torch.stack([ratios.mean(), std, (1 - cos).mean()]).tolist()
    return float(values[0]), float(values[1]), float(values[2])


class MagCacheRun(StackCacheRun):
    """MagCache's hooks on one model for one sampling run: the host brackets each model call with
    ``begin_call(CallContext)`` / ``end_call()``; ``remove()`` takes the hooks off."""

    hook_names = HOOK_NAMES

    def __init__(self, config: MagCacheConfig, stack: BlockStack, stats: CacheRunStats | None = None):
        super().__init__(stack, MagCacheState, config, stats or CacheRunStats("magcache", config))
        self.config: MagCacheConfig = config
        # calibration lists of branches whose generation ended (fallback counting), by branch label
        self._emitted: dict[str, dict[str, list[float]]] = {}
        # each branch's curve resampled to a step count (``MagRatioTable.for_branch``), by (label, steps)
        self._curves: dict[tuple[str, int], list[float]] = {}

    # -- step position ----------------------------------------------------------------------------------------------

    def _steps_in_generation(self, st: MagCacheState, label: str) -> int:
        if self.config.num_inference_steps is not None:
            return self.config.num_inference_steps
        table = self.config.ratio_table
        return table.calibrated_steps(label) if table is not None else 0

    def _position(self, st: MagCacheState, info: CallContext, label: str) -> tuple[int, int | None]:
        """(step, steps) of this branch's call; starts the branch afresh when a new generation begins.

        The host's step when it knows it (a step lower than the branch's last one means a new sampling pass);
        otherwise the branch's own call count, wrapping after N calls.
        """
        if info.step is not None:
            if st.step_index is not None and info.step < st.step_index:
                self._new_generation(st, label)
            total = info.total_steps or self._steps_in_generation(st, label) or None
            return info.step, total
        total = self._steps_in_generation(st, label) or None
        if total is not None and st.calls >= total:
            self._new_generation(st, label)
        return st.calls, total

    def _new_generation(self, st: MagCacheState, label: str) -> None:
        self._emit_calibration(st, label)
        st.reset()

    # -- policy -----------------------------------------------------------------------------------------------------

    def decide_branches(self, call: ActiveCall, head: torch.nn.Module, args: tuple, kwargs: dict,
                        hidden: torch.Tensor, size: int) -> list[Decision]:
        cfg = self.config
        decisions: list[Decision] = []
        for key, label in zip(call.keys, call.labels):
            st: MagCacheState = self.branch_state(key)
            step, total = self._position(st, call.context, label)
            st.label = label
            st.calls += 1
            st.step_index = step
            if cfg.calibrate:
                call.head_measures[key] = st.previous_residual  # the tail compares the new residual with it
                decisions.append(Decision(CALIBRATE))
                continue
            n = total or step + 1
            if not cfg.in_window(step, n):
                st.reset_accumulators()
                decisions.append(Decision(WINDOW))
                continue
            if step < int(cfg.retention_ratio * n + 0.5):
                st.reset_accumulators()
                decisions.append(Decision(RETENTION))
                continue
            ratios = self._curves.get((label, n))
            if ratios is None:
                ratios = self._curves[(label, n)] = cfg.ratio_table.for_branch(label, n)
            gamma = ratios[step] if step < len(ratios) else 1.0
            st.accumulated_ratio *= gamma
            st.accumulated_steps += 1
            st.accumulated_err += abs(1.0 - st.accumulated_ratio)
            if cfg.threshold <= 0 or st.accumulated_err > cfg.threshold:
                reason = THRESHOLD
            elif st.accumulated_steps > cfg.max_skip_steps:
                reason = MAX_SKIPS
            else:
                reason = REUSE
            decisions.append(Decision(reason, st.accumulated_err))
        return decisions

    def after_decision(self, call: ActiveCall, compute: bool) -> None:
        if compute:  # the new residual is the reference from now on
            for key in call.keys:
                self.branch_state(key).reset_accumulators()

    # -- calibration ------------------------------------------------------------------------------------------------

    def on_residual(self, call: ActiveCall, key: str, residual: torch.Tensor, output: torch.Tensor) -> None:
        if not self.config.calibrate:
            return
        st: MagCacheState = self.branch_state(key)
        previous = call.head_measures.get(key)
        if previous is None or previous.shape != residual.shape:
            ratio, std, cos_dis = 1.0, 0.0, 0.0
        else:
            ratio, std, cos_dis = residual_change(residual, previous)
        st.norm_ratios.append(ratio)
        st.norm_stds.append(std)
        st.cos_dises.append(cos_dis)
        if call.context.step is None:
            total = self._steps_in_generation(st, st.label)
            if total and st.calls >= total:
                self._emit_calibration(st, st.label)

    def _emit_calibration(self, st: MagCacheState, label: str) -> None:
        if not st.norm_ratios:
            return
        self._emitted[label or "default"] = {"ratios": list(st.norm_ratios), "stds": list(st.norm_stds),
                                             "cos_dists": list(st.cos_dises)}
        log.info("omni_hooks MagCache calibration (%s, %d steps): mag_ratios=%s", label or "default",
                 len(st.norm_ratios), [round(r, 5) for r in st.norm_ratios])
        st.norm_ratios.clear()
        st.norm_stds.clear()
        st.cos_dises.clear()

    def get_calibration_result(self) -> dict[str, dict[str, list[float]]]:
        """Per branch label: ``{"ratios", "stds", "cos_dists"}``, one entry per call of the branch's latest
        generation (the one in progress if it recorded anything, else the last finished one)."""
        result = {label: {k: list(v) for k, v in lists.items()} for label, lists in self._emitted.items()}
        for key in self.states.contexts():
            st: MagCacheState = self.branch_state(key)
            if st.norm_ratios:
                result[st.label or "default"] = {"ratios": list(st.norm_ratios), "stds": list(st.norm_stds),
                                                 "cos_dists": list(st.cos_dises)}
        return result

    def remove(self) -> None:
        """Remove the hooks; calibration results stay available from ``get_calibration_result``."""
        for key in self.states.contexts():
            st: MagCacheState = self.branch_state(key)
            self._emit_calibration(st, st.label)
        super().remove()


def apply_mag_cache_hook(stack: BlockStack, config: MagCacheConfig,
                         stats: CacheRunStats | None = None) -> MagCacheRun:
    """Install MagCache on a block stack and return the run that drives it (``begin_call``/``end_call``/``remove``).

    RuntimeError, changing nothing, when a block already has another hook that overrides its forward (a cache)."""
    run = MagCacheRun(config, stack, stats)
    run.install()
    return run
