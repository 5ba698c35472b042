"""MagCache: the decision policy on top of the shared block-stack cache mechanics (``omni_hooks.stack_cache``).

After vllm-omni ``vllm_omni/diffusion/cache/magcache/hook.py`` and diffusers ``hooks/mag_cache.py``
(MagCache paper, Ma et al. 2025), on the model's own blocks (``BlockStack``):
  * ``MagCacheHeadHook`` (on the first block, "mag_cache_leader_block_hook") decides per branch and, on a skip,
    passes the block's inputs through; the residual is added exactly once, to the tail module's input (never at
    every block: vllm-omni #5560 added it at each of Flux's 57 blocks);
  * ``MagCacheBlockHook`` (on every other block, "mag_cache_block_hook") passes its inputs through on a skip;
  * the tail hook stores each computed call's residual and, while calibrating, records the magnitude ratio, its
    spread and the cosine distance to the previous residual, per branch.
Every call advances the branch's step, whether it was computed or skipped, and a single-block stack is no exception
(the step is taken at the head, not at a tail block that a skip bypasses).

Decision per branch at step t of N (its own curve, nearest-interpolated to N): outside the start/end window or
before the retention step ``int(retention_ratio * N + 0.5)`` compute (accumulators restart); else
``ratio *= mag_ratios[t]``, ``steps += 1``, ``err += |1 - ratio|`` and reuse iff ``threshold > 0``,
``err <= threshold`` and ``steps <= K`` (and a residual of the same shape is cached). The call is skipped only if
every branch may reuse; a computed call restarts every branch's accumulators. Under the "auto" forecast the
accumulated error is not weighed by the forecast's record (``ErrorPerMetric``), as TeaCache's change is: the
per-step curve already tells where the residual moves, and weighing it lowered quality at the same number of
evaluations on both benchmark models (docs/benchmarks.md).
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from ..blockstack import BlockStack
from ..context import CallContext
from ..stack_cache import (
    ActiveCall,
    Decision,
    StackBlockHook,
    StackCacheRun,
    StackHeadHook,
    StackTailHook,
)
from ..stats import CALIBRATE, MAX_SKIPS, RETENTION, REUSE, THRESHOLD, WINDOW, CacheRunStats
from .config import MagCacheConfig
from .state import MagCacheState
from .strategy import MagCacheStrategy, get_strategy

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


class MagCacheHeadHook(StackHeadHook):
    """MagCache's head-block hook: decides per branch, then runs the block or passes its inputs through.

    With ``implicit_calls`` (standalone use, no host bracketing calls) a forward of the head block outside a call
    opens one for the run's current context; the tail closes it.
    """

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        run: MagCacheRun = self.run
        if run.implicit_calls:
            call = run._call
            if call is not None and call.implicit:
                run.end_call()  # an implicit call whose tail never ran (the forward raised): close it
                call = None
            if call is None:
                branch = run.context or "default"
                run.begin_call(CallContext(branches=[branch], labels=[branch]))
                run._call.implicit = True
        return super().new_forward(module, *args, **kwargs)


class MagCacheBlockHook(StackBlockHook):
    """MagCache's hook on every other block: passes its inputs through on a skipped call (never adds a residual)."""


class MagCacheTailHook(StackTailHook):
    """Stores or adds the residual (shared mechanics); closes an implicit call."""

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        args, kwargs = super().pre_forward(module, *args, **kwargs)
        call = self.run._call
        if call is not None and call.implicit and self.last:
            self.run.end_call()
        return args, kwargs


class MagCacheRun(StackCacheRun):
    """MagCache's hooks on one model for one sampling run (``begin_call``/``end_call``/``remove``)."""

    hook_names = HOOK_NAMES
    head_hook_cls = MagCacheHeadHook
    block_hook_cls = MagCacheBlockHook
    tail_hook_cls = MagCacheTailHook

    def __init__(self, config: MagCacheConfig, stack: BlockStack, stats: CacheRunStats | None = None,
                 implicit_calls: bool = False):
        super().__init__(stack, MagCacheState, config, stats or CacheRunStats(
            kind="magcache", model=config.model_label, threshold=config.threshold, notes=list(config.notes)))
        self.config: MagCacheConfig = config
        self.implicit_calls = implicit_calls
        self.context: str | None = None
        # calibration lists of branches whose generation ended (fallback counting), by branch label
        self._emitted: dict[str, dict[str, list[float]]] = {}

    # -- standalone use ---------------------------------------------------------------------------------------------

    def set_context(self, name: str | None) -> None:
        """The branch implicit calls belong to (diffusers' ``cache_context("cond")``); None = "default"."""
        self.context = name

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
            ratios = cfg.ratio_table.for_branch(label, n)
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


def apply_mag_cache_hook(module: torch.nn.Module, config: MagCacheConfig, strategy: MagCacheStrategy | None = None,
                         stats: CacheRunStats | None = None, implicit_calls: bool = True) -> MagCacheRun:
    """Install MagCache on ``module``'s block stack and return the run that drives it.

    ``strategy`` says how ``module`` maps to a ``BlockStack``; None looks it up by the module's class in the strategy
    registry (ValueError listing the registered ones). With ``implicit_calls`` every forward of the module is one
    call of the current context (``run.set_context``); a host that knows branches and steps calls
    ``run.begin_call(CallContext(...))`` / ``run.end_call()`` around each model call instead. Installing on a module
    that already has a cache's forward override raises RuntimeError and changes nothing.
    """
    if strategy is None:
        strategy = get_strategy(module)
    stack = strategy.build_stack(module)
    run = MagCacheRun(config, stack, stats or CacheRunStats(kind="magcache", model=strategy.name,
                                                            threshold=config.threshold),
                      implicit_calls=implicit_calls)
    run.install()
    return run
