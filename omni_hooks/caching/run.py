"""The mechanics every block-stack cache shares: decide at the head block, pass blocks through, fix up at the tail.

Per model call (bracketed by the host with ``begin_call(CallContext)``/``end_call``):
  * the head hook (on ``blocks[0]``) asks the cache's policy (``decide``) whether to compute, per branch;
  * on a skip, every block returns its inputs unchanged (``BlockStack.skip_block``) and the tail module's image-stream
    input becomes *head input + cached residual*: the residual is added exactly once, however many blocks there are;
  * on a compute, the tail stores ``tail input - head input`` per branch (the residual the next skip reuses);
  * with ``forecast_order`` k > 0 a branch keeps its last k + 1 residuals and a skip adds their extrapolation to the
    call's sigma (``omni_hooks.caching.forecast``) instead of the last one; its reason becomes "forecast";
  * with ``forecast_order`` "auto" each computed call scores every candidate forecast (``omni_hooks.caching.forecast``:
    the orders, TaylorSeer's Taylor step, a Chebyshev fit) on predicting its residual from the older
    ones (means over the ranks under sequence parallelism) and a skip uses the order expected to err least at its
    distance from the last computed step, counting how each order's errors add up over the coming gaps (0: reuse;
    a cache whose ``coherence_floor`` is below 0 counts errors that alternate as partly cancelling);
  * the steps of large sigma steps are always computed (``omni_hooks.caching.large_steps``); with a forward budget
    (``omni_hooks.caching.budget``) the run computes about that many steps where its plan places them instead;
  * a cache whose ``weighs_metric_by_forecast`` is set weighs its metric, under "auto" and 1st order, by the
    forecast's record (``ErrorPerMetric``), so it computes sooner where the forecast did poorly;
  * with ``skip_correction`` above 0 and a sampler that takes Euler steps (``CallContext.euler_steps``), a computed
    call after skipped ones adds to its stack output what interpolating the gap corrects
    (``omni_hooks.caching.skip_correction``).
Every skipped branch's record says which order its residual came from (``BranchDecision.forecast_order``).
The stack is skipped only when every branch of the call may skip (and, under sequence parallelism, only when every
rank may: ``CallContext.rank.agreement``); the verdict is written to the call's ``CallContext.blocks_run``. Outside a
call every hook passes through. All hooks are of the caching phase, so a placement hook (offload) on a block runs only
when that block really computes.

TeaCache and MagCache differ only in ``decide`` (and what they record while calibrating).
"""
from __future__ import annotations

import math
import time

import torch

from ..base import HookRegistry, ModelHook, StateManager, remove_hook_and_restore
from ..blockstack import BlockStack
from .budget import ForwardBudget, StepProfile
from ..context import CallContext
from .config import StackCacheConfig
from .few_step import FEW_STEP_REASON
from .large_steps import LARGE_STEP_REASON
from .forecast import (AUTO, AUTO_KEPT, CANDIDATES, COHERENCE_RANGE, FORECAST, FORECAST_FALLBACK, WEIGHED_ORDERS,
                       history_limit)
from .hooks import StackBlockHook, StackCaptureHook, StackHeadHook, StackTailHook
from .state import ActiveCall, CachedResidualState, Decision
from .stats import (CALIBRATE, FIRST, OTHER_BRANCH, OTHER_RANK, REUSE, SHAPE, THRESHOLD, WINDOW, BranchDecision,
                    CacheRunStats, EvaluationRecord)


# the reasons a branch computes whatever a forward budget says: nothing usable is cached, the step is outside the
# user's start/end window, or the run calibrates
NEEDED_REASONS = frozenset({FIRST, SHAPE, WINDOW, CALIBRATE})


def relative_change(current: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """``|current - previous| / |previous|`` (L2, in float32) as a 0-d tensor, no host sync."""
    prev = previous.to(current.device).float()
    return ((current.float() - prev).square().sum() / (prev.square().sum() + 1e-12)).sqrt()


class StackCacheRun:
    """Shared state of one cache's hooks on one model for one sampling run. Subclasses implement ``decide_branches``.

    ``config`` is the cache's frozen ``StackCacheConfig`` (its subclass), read unchanged; everything a run changes
    lives here and in the branch states. ``hook_names`` = (head, block, tail, capture) registry names; the capture
    hook is only installed when ``capture_module`` is given (its first positional input is stored as
    ``ActiveCall.captured``).
    """

    hook_names: tuple[str, str, str, str]
    # under a forecast of ``WEIGHED_ORDERS``, the policy multiplies its metric by ``metric_weight`` (ErrorPerMetric)
    weighs_metric_by_forecast: bool = False
    # under "auto": the lowest coherence an order's errors are credited with (below 0: errors that alternate cancel)
    coherence_floor: float = COHERENCE_RANGE[0]

    def __init__(self, stack: BlockStack, state_cls: type[CachedResidualState], config: StackCacheConfig,
                 stats: CacheRunStats, capture_module: torch.nn.Module | None = None):
        self.stack = stack
        self.config = config  # the caller's frozen config, read as it is (never copied or rebuilt)
        self._skipped_steps: set[int] = set()
        self.states = StateManager(state_cls)
        self.stats = stats
        self.capture_module = capture_module
        self._active: ActiveCall | None = None
        self._installed: list[tuple[torch.nn.Module, str]] = []
        self.budget = ForwardBudget(config.active_budget, config.step_profile) if config.active_budget else None
        self.stats.budget = self.budget
        # while calibrating: per step, its sigma and each branch's relative residual change (``step_profile``)
        self._calibrated_changes: dict[int, tuple[float, list[float]]] = {}
        self._large_steps: frozenset[int] | None = None  # the run's large steps (``config.large_steps``), once known

    # -- policy ---------------------------------------------------------------------------------------------------

    def decide_branches(self, call: ActiveCall, head: torch.nn.Module, args: tuple, kwargs: dict,
                        hidden: torch.Tensor, size: int) -> list[Decision]:
        """One Decision per branch of ``call`` (chunks of ``size`` along dim 0). May update branch states."""
        raise NotImplementedError

    def after_decision(self, call: ActiveCall, compute: bool) -> None:
        """Called once per call after the verdict (e.g. to reset accumulators of computed branches)."""

    @property
    def weighs_metric(self) -> bool:
        """Whether this run weighs its metric by the forecast's record: the cache does (``weighs_metric_by_forecast``)
        and its forecast is one of ``WEIGHED_ORDERS``."""
        return self.weighs_metric_by_forecast and self.config.forecast_order in WEIGHED_ORDERS

    def metric_weight(self, st: CachedResidualState) -> float:
        """What the policy multiplies a branch's metric by: its ``ErrorPerMetric.weight()`` when the run
        ``weighs_metric``, else 1."""
        return st.error_per_metric.weight() if self.weighs_metric else 1.0

    def on_residual(self, call: ActiveCall, key: str, residual: torch.Tensor, output: torch.Tensor) -> None:
        """Called per branch after a computed call stored its residual (calibration hooks in here)."""

    # -- host interface -------------------------------------------------------------------------------------------

    @property
    def active_call(self) -> ActiveCall | None:
        """The call in progress between ``begin_call`` and ``end_call`` (None outside one: the hooks pass through)."""
        return self._active

    def begin_call(self, context: CallContext) -> None:
        self._active = ActiveCall(context=context, keys=list(context.branches), labels=list(context.labels),
                                  chunk=len(context.branches), started=time.perf_counter())

    def end_call(self) -> EvaluationRecord | None:
        """Close the current call; returns its record (with the seconds spent) if the head block ran."""
        call, self._active = self._active, None
        if call is None or call.record is None:
            return None
        call.record.seconds = time.perf_counter() - call.started
        self.stats.record(call.record)
        return call.record

    def branch_state(self, key: str):
        self.states.set_context(key)
        return self.states.get_state()

    def cache_bytes(self) -> int:
        """Bytes of the tensors the branch states hold (each tensor once: the newest residual is also in the
        forecast history)."""
        seen: set[int] = set()
        total = 0
        for key in self.states.contexts():
            st = self.branch_state(key)
            for value in [*vars(st).values(), *st.history.residuals, st.skips.used]:
                if isinstance(value, torch.Tensor) and id(value) not in seen:
                    seen.add(id(value))
                    total += value.numel() * value.element_size()
        return total

    # -- the call -------------------------------------------------------------------------------------------------

    def decide(self, head: torch.nn.Module, args: tuple, kwargs: dict, hidden: torch.Tensor) -> bool:
        """Decide for the current call; True means compute the blocks."""
        call = self._active
        batch = hidden.shape[0]
        self._keep_own_part(call)
        if call.chunk == 0 or batch % call.chunk:
            # chunks unknown or inconsistent: treat the whole batch as one branch
            call.keys = ["|".join(call.keys) or "default"]
            call.labels = ["+".join(call.labels) or "all"]
            call.chunk = 1
        size = batch // call.chunk
        decisions = self.decide_branches(call, head, args, kwargs, hidden, size)
        step, total = call.context.step, call.context.total_steps
        for i, key in enumerate(call.keys):
            st = self.branch_state(key)
            if decisions[i].reason == REUSE and (
                    st.previous_residual is None or st.residual_input_shape != hidden[i * size:(i + 1) * size].shape):
                decisions[i] = Decision(SHAPE if st.previous_residual is not None else FIRST, decisions[i].metric)
        if self.budget is not None and step is not None and total:
            decisions = self._within_budget(call, decisions, step, total)
        few_step = self.config.active_few_step
        large = self.config.active_large_steps
        if few_step is not None and few_step.applies(total):
            large = None  # a run of few steps has the few-step rule (its last step included)
            if self.stats.few_step_note is None:  # once per run: the run's step count does not change
                self.stats.few_step_note = few_step.describe(total)
            if few_step.forces(step, total, step is not None and step - 1 in self._skipped_steps):
                decisions = [Decision(FEW_STEP_REASON, d.metric) if d.reason == REUSE else d for d in decisions]
        if large is not None and step is not None and call.context.schedule:
            if self._large_steps is None:  # once per run: the schedule does not change within it
                self._large_steps = large.steps(call.context.schedule)
                if self._large_steps:
                    self.stats.large_step_note = large.describe(self._large_steps, len(call.context.schedule) - 1)
            if step in self._large_steps:
                decisions = [Decision(LARGE_STEP_REASON, d.metric) if d.reason == REUSE else d for d in decisions]
        must = self.stack.must_compute(args, kwargs) if self.stack.must_compute is not None else None
        if must is not None:
            decisions = [Decision(must, d.metric) if d.reason == REUSE else d for d in decisions]
        local_compute = any(d.reason != REUSE for d in decisions)
        agreement = call.context.rank.agreement
        # under sequence parallelism every rank must take the same path, or one waits in a collective forever
        compute = agreement.any(local_compute) if agreement is not None else local_compute
        self.after_decision(call, compute)
        if self.budget is not None and step is not None and total:
            self.budget.settle(step, compute)
        if not compute and step is not None:
            self._skipped_steps.add(step)
        reuse_reason = OTHER_BRANCH if local_compute else OTHER_RANK
        call.record = EvaluationRecord(
            step=call.context.step, total_steps=call.context.total_steps, computed=compute,
            branches=[BranchDecision(branch=call.labels[i], computed=compute,
                                     reason=reuse_reason if compute and d.reason == REUSE else d.reason,
                                     metric=d.metric, threshold=self.config.threshold)
                      for i, d in enumerate(decisions)])
        call.context.blocks_run = compute
        return compute

    def _within_budget(self, call: ActiveCall, decisions: list[Decision], step: int, total: int) -> list[Decision]:
        """The call's decisions under the forward budget (``omni_hooks.caching.budget``): the plan's steps compute, a
        branch's threshold may bring one forward, what must compute does (nothing cached, a new shape, a step
        outside the start/end window); the policy's other rules (its first steps, retention, K) give way."""
        budget = self.budget
        if budget.total != total:
            outside = {s for s in range(total) if not self.config.in_window(s, total)}
            budget.start(total, list(call.context.schedule) if call.context.schedule else None, outside)
        must = any(d.reason in NEEDED_REASONS for d in decisions)
        wants = self.config.threshold > 0 and any(d.reason == THRESHOLD for d in decisions)  # 0: the plan alone
        compute, why = budget.decide(step, wants, must)
        if not compute:
            return [d if d.reason in NEEDED_REASONS else Decision(REUSE, d.metric) for d in decisions]
        keep = {*NEEDED_REASONS, THRESHOLD}
        return [d if d.reason in keep else Decision(why or d.reason, d.metric) for d in decisions]

    @staticmethod
    def _keep_own_part(call: ActiveCall) -> None:
        """CFG parallel: keep the branches of the part of the batch this rank computes (``RankView.batch_part``);
        branches that do not divide into the parts become one."""
        batch_part = call.context.rank.batch_part
        index, parts = batch_part() if batch_part is not None else (0, 1)
        if parts == 1:
            return
        if call.chunk == 0 or call.chunk % parts:
            call.keys, call.labels = ["|".join(call.keys) or "default"], ["+".join(call.labels) or "all"]
            call.chunk = 1
            return
        size = call.chunk // parts
        call.keys = call.keys[index * size:(index + 1) * size]
        call.labels = call.labels[index * size:(index + 1) * size]
        call.chunk = size

    @staticmethod
    def measured_floats(call: ActiveCall, values: list[torch.Tensor | None]) -> list[float | None]:
        """Per-branch measured 0-d tensors (None: not measured) as host floats, with one host sync.

        Under sequence parallelism (``call.context.rank.agreement``) each value is the mean over the ranks, since a
        rank measures only its shard of the tokens; the agreement is then called exactly once per call, on every
        rank, measured or not, so no rank waits on a collective another one skipped.
        """
        agreement = call.context.rank.agreement
        measured = [v for v in values if v is not None]
        if agreement is None:
            floats = iter(torch.stack(measured).tolist() if measured else [])
            return [next(floats) if v is not None else None for v in values]
        zero = torch.zeros((), dtype=torch.float32, device=measured[0].device if measured else None)
        means = agreement.mean(torch.stack([zero if v is None else v.float() for v in values])).tolist()
        return [m if v is not None else None for v, m in zip(values, means)]

    @staticmethod
    def coordinate(context: CallContext) -> float | None:
        """Where a call lies for forecasting: its sigma, else its step (None: unknown, so no forecast)."""
        return context.sigma if context.sigma is not None else context.step

    @staticmethod
    def distance(st: CachedResidualState, coord: float | None) -> float | None:
        """How far ``coord`` lies from the branch's last computed step (None: either is unknown)."""
        last = st.history.coords[-1] if st.history.coords else None
        return None if coord is None or last is None else abs(float(coord) - float(last))

    def correcting(self, context: CallContext) -> bool:
        """Whether this call takes part in skip correction: ``config.skip_correction`` is above 0, the sampler takes
        Euler steps, the call's sigma and step within a known schedule are known, and the stack has one stream. The
        first call that cannot says why in the run's statistics (``CacheRunStats.skip_correction_note``)."""
        if not self.config.skip_correction:
            return False
        why = None
        if not context.euler_steps:
            why = ("the sampler does not take plain Euler steps (use the sampler 'euler'; other samplers move the "
                   "latent otherwise, with several evaluations per step or outputs combined across steps, which the "
                   "correction does not model)")
        elif context.sigma is None or context.step is None or not context.schedule \
                or context.step + 1 >= len(context.schedule):
            why = "the host could not tell this call's sigma and step"
        elif len(self.stack.tails()) > 1:
            why = "this model's block stack carries several streams"
        if why is not None and self.stats.skip_correction_note is None:
            self.stats.skip_correction_note = f"skip correction: not applied, {why}"
        return why is None

    @staticmethod
    def next_sigma(context: CallContext) -> float:
        """The sigma the call's step moves to (its schedule is known: ``correcting``)."""
        return context.schedule[context.step + 1]

    def skipped_residuals(self) -> list[torch.Tensor]:
        """Per branch of the current (skipped) call: the residual to add. With forecasting, the branch's reason in
        the call's record becomes "forecast" (or "forecast-fallback" when the forecast was not finite)."""
        call = self._active
        states = [self.branch_state(k) for k in call.keys]
        residuals = ([st.previous_residual for st in states] if not self.config.forecast_order
                     else self._forecast_residuals(call, states))
        if self.correcting(call.context):
            for st, residual in zip(states, residuals):
                st.skips.skipped(residual, call.context.sigma, self.next_sigma(call.context))
            self.stats.cache_bytes = max(self.stats.cache_bytes, self.cache_bytes())  # with the gap's sums
        return residuals

    def _forecast_residuals(self, call: ActiveCall, states: list[CachedResidualState]) -> list[torch.Tensor]:
        """Per branch of the skipped call: its forecast residual (``skipped_residuals`` with a forecast)."""
        coord = self.coordinate(call.context)
        residuals = []
        for i, st in enumerate(states):
            order = (st.scores.best(len(st.history.residuals), self.distance(st, coord), self.coherence_floor)
                     if self.config.forecast_order == AUTO else None)
            made = st.history.forecast(coord, order=order)
            residuals.append(made.residual if made.residual is not None else st.previous_residual)
            reason = FORECAST_FALLBACK if made.fell_back else FORECAST if made.order else None
            if call.record is not None and i < len(call.record.branches):
                call.record.branches[i].forecast_order = made.order
                if reason:
                    call.record.branches[i].reason = reason
            if made.fell_back:
                self.stats.warn("a forecast residual was not finite; those steps reused the last computed residual "
                                f"({FORECAST_FALLBACK!r} in the per-step reasons)")
        return residuals

    def reused_hidden(self, head_input: torch.Tensor) -> torch.Tensor:
        """The stack output of a skipped call: its head input plus each branch's cached (or forecast) residual."""
        residuals = self.skipped_residuals()
        residual = residuals[0] if len(residuals) == 1 else torch.cat([r.to(head_input.device) for r in residuals])
        return head_input + residual.to(device=head_input.device, dtype=head_input.dtype)

    def store_residual(self, head_input: torch.Tensor, output: torch.Tensor) -> torch.Tensor | None:
        """After a computed call: keep ``output - head_input`` per branch (on ``cache_device`` if set). Returns the
        stack output the model goes on with: ``output`` plus each branch's skip correction, None when nothing is
        corrected (``output`` as it is)."""
        call = self._active
        if output.shape != head_input.shape:
            self.stats.stack_shape_mismatch = True
            self.stats.warn(f"the stack output shape {tuple(output.shape)} differs from its input "
                            f"{tuple(head_input.shape)}; such calls are always computed")
            return None
        size = output.shape[0] // call.chunk
        residual = (output - head_input).detach()
        coord = self.coordinate(call.context)
        correcting = self.correcting(call.context)
        corrections: list[torch.Tensor | None] = []
        measured: list[torch.Tensor | None] = []
        distances: list[float | None] = []
        changes: list[torch.Tensor] = []
        for i, key in enumerate(call.keys):
            st = self.branch_state(key)
            part = residual[i * size:(i + 1) * size]
            if correcting:
                corrections.append(st.skips.correction(st.previous_residual, st.residual_sigma, part,
                                                       call.context.sigma, self.next_sigma(call.context),
                                                       self.config.skip_correction))
                st.residual_sigma = call.context.sigma
            if self.config.calibrate and st.previous_residual is not None and st.previous_residual.shape == part.shape:
                changes.append(relative_change(part, st.previous_residual))
            st.previous_residual = part.to(self.config.cache_device) if self.config.cache_device is not None else part
            st.residual_input_shape = head_input[i * size:(i + 1) * size].shape
            if self.config.forecast_order:
                if self.config.forecast_order == AUTO or self.weighs_metric:
                    distances.append(self.distance(st, coord))
                    measured += st.history.prediction_errors(coord, st.previous_residual)
                st.history.limit = history_limit(self.config.forecast_order)
                st.history.add(coord, st.previous_residual)
            self.on_residual(call, key, part, output[i * size:(i + 1) * size].detach())
        if measured:
            self._score_orders(call, measured, distances)
        step, sigma = call.context.step, call.context.sigma
        first = not self._calibrated_changes
        if self.config.calibrate and step is not None and sigma is not None and (changes or first):
            values = self.measured_floats(call, changes) if changes else [0.0]  # the first step: no change of its own
            self._calibrated_changes.setdefault(step, (sigma, []))[1].extend(values)
        self.stats.cache_bytes = max(self.stats.cache_bytes, self.cache_bytes())
        if not any(c is not None for c in corrections):
            return None
        self.stats.corrected_steps += 1
        return torch.cat([output[i * size:(i + 1) * size] + (c.to(output.dtype) if c is not None else 0)
                          for i, c in enumerate(corrections)])

    def step_profile(self) -> StepProfile | None:
        """What a calibrating run measured for a forward budget: per computed step its sigma and the relative change
        of the residual from the step before (mean over the branches and calls of the step); None with fewer than
        two steps measured or a change that is not a finite number (a model that produced NaN)."""
        points = sorted(self._calibrated_changes.items())
        sigmas = [sigma for _, (sigma, _) in points]
        changes = [sum(values) / len(values) for _, (_, values) in points]
        if len(points) < 2 or not all(math.isfinite(v) for v in sigmas + changes):
            return None
        return StepProfile(tuple(sigmas), tuple(changes))
    def _score_orders(self, call: ActiveCall, measured: list[torch.Tensor | None],
                      distances: list[float | None]) -> None:
        """Update each branch's ``OrderScores`` from its prediction errors (``ResidualHistory.prediction_errors``,
        concatenated over the call's branches) made over ``distances``: one host sync, and under sequence
        parallelism the means over the ranks, so that every rank chooses the same orders. A cache that weighs its
        metric by the forecast also scores the order a skip at that distance would have used against the metric
        that made this call compute (``ErrorPerMetric``)."""
        floats = self.measured_floats(call, measured)
        width = len(floats) // len(call.keys)
        for i, key in enumerate(call.keys):
            st = self.branch_state(key)
            branch = floats[i * width:(i + 1) * width]
            errors, norm = branch[:len(CANDIDATES)], branch[-1]
            if self.weighs_metric and norm is not None:
                order = self.config.forecast_order
                error = errors[st.scores.best(AUTO_KEPT, distances[i], self.coherence_floor)
                               if order == AUTO else order]
                error = errors[0] if error is None else error
                if error is not None:
                    st.error_per_metric.update(math.sqrt(error / (norm + 1e-12)), st.unweighted_metric)
            st.scores.update(branch, distances[i])

    # -- hooks ----------------------------------------------------------------------------------------------------

    def install(self) -> None:
        """Register the hooks on the stack's modules. Raises RuntimeError (changing nothing) on a conflict."""
        head, block, tail, capture = self.hook_names
        plan: list[tuple[torch.nn.Module, str, ModelHook]] = [(self.stack.blocks[0], head, StackHeadHook(self))]
        plan += [(b, block, StackBlockHook(self)) for b in self.stack.blocks[1:]]
        tails = self.stack.tails()
        plan += [(module, tail, StackTailHook(self, part, len(tails))) for part, (module, _where) in enumerate(tails)]
        if self.capture_module is not None:
            plan.append((self.capture_module, capture, StackCaptureHook(self)))
        try:
            for module, name, hook in plan:
                HookRegistry.get_or_create(module).register_hook(name, hook)
                self._installed.append((module, name))
        except Exception:
            self.remove()
            raise

    def remove(self) -> None:
        """Remove every hook this run installed; a module left without hooks is restored exactly."""
        for module, name in reversed(self._installed):
            remove_hook_and_restore(module, name)
        self._installed.clear()
        self._active = None
        self.states.reset()
