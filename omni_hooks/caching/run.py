"""The mechanics every block-stack cache shares: decide at the head block, pass blocks through, fix up at the tail.

Per model call (bracketed by the host with ``begin_call(CallContext)``/``end_call``):
  * the head hook (on ``blocks[0]``) asks the run (``decide``) whether to compute: the cache's policy decides per
    branch (``decide_branches``), then each step rule (``rules``: nothing cached, another shape, the forward budget,
    few steps, large steps, the model's own cache) may make a branch compute;
  * on a skip, every block returns its inputs unchanged (``BlockStack.skip_block``) and the tail module's image-stream
    input becomes *head input + cached residual*: the residual is added exactly once, however many blocks there are;
    with ``forecast_order`` set the residual is the forecast's (``residuals.Forecaster``), and its reason "forecast";
  * on a compute, the tail stores ``tail input - head input`` per branch (the residual the next skip reuses); with
    ``skip_correction`` above 0 and a sampler that takes Euler steps (``CallContext.euler_steps``) it adds to its
    stack output what interpolating the gap corrects (``residuals.Corrector``), and the forecast scores its
    candidates on it (``residuals.Forecaster``);
  * a cache whose ``weighs_metric_by_forecast`` is set weighs its metric, under "auto" and 1st order, by the
    forecast's record (``ErrorPerMetric``), so it computes sooner where the forecast did poorly.
The stack is skipped only when every branch of the call may skip (and, under sequence parallelism, only when every
rank may: ``CallContext.rank.agreement``); the verdict is written to the call's ``CallContext.blocks_run``. Outside a
call every hook passes through. All hooks are of the caching phase, so a placement hook (offload) on a block runs only
when that block really computes.

TeaCache and MagCache differ only in ``decide_branches`` (and what they record while calibrating).
"""
from __future__ import annotations

import time

import torch

from ..base import HookRegistry, ModelHook, StateManager, remove_hook_and_restore
from ..blockstack import BlockStack
from ..context import CallContext
from .budget import StepProfile
from .config import StackCacheConfig
from .forecast import COHERENCE_RANGE, WEIGHED_ORDERS
from .hooks import StackBlockHook, StackCaptureHook, StackHeadHook, StackTailHook
from .residuals import Corrector, Forecaster, ProfileRecorder
from .rules import STEP_RULES, StepRule
from .state import ActiveCall, CachedResidualState, Decision, held_bytes, measured_floats
from .stats import OTHER_BRANCH, OTHER_RANK, REUSE, BranchDecision, CacheRunStats, EvaluationRecord


class StackCacheRun:
    """Shared state of one cache's hooks on one model for one sampling run. Subclasses implement ``decide_branches``.

    ``config`` is the cache's frozen ``StackCacheConfig`` (its subclass), read unchanged; everything a run changes
    lives here and in the branch states. ``hook_names`` = (head, block, tail, capture) registry names; the capture
    hook is only installed when ``capture_module`` is given (its first positional input is stored as
    ``ActiveCall.captured``). ``step_rules``: the rules ``decide`` asks after the policy, in order (``rules``).
    """

    hook_names: tuple[str, str, str, str]
    step_rules: tuple[type[StepRule], ...] = STEP_RULES
    # under a forecast of ``WEIGHED_ORDERS``, the policy multiplies its metric by ``metric_weight`` (ErrorPerMetric)
    weighs_metric_by_forecast: bool = False
    # under "auto": the lowest coherence a candidate's errors are credited with (below 0: errors that alternate cancel)
    coherence_floor: float = COHERENCE_RANGE[0]
    measured_floats = staticmethod(measured_floats)

    def __init__(self, stack: BlockStack, state_cls: type[CachedResidualState], config: StackCacheConfig,
                 stats: CacheRunStats, capture_module: torch.nn.Module | None = None):
        self.stack = stack
        self.config = config  # the caller's frozen config, read as it is (never copied or rebuilt)
        self.states = StateManager(state_cls)
        self.stats = stats
        self.capture_module = capture_module
        self._active: ActiveCall | None = None
        self._installed: list[tuple[torch.nn.Module, str]] = []
        self.rules = [rule for cls in self.step_rules if (rule := cls.for_run(config, stack)) is not None]
        self.stats.rules = self.rules
        self.forecaster = (Forecaster(config, stats, self.weighs_metric, self.coherence_floor)
                           if config.forecast_order else None)
        self.corrector = Corrector(config, stats, len(stack.tails())) if config.skip_correction else None
        self.profile = ProfileRecorder() if config.calibrate else None

    # -- policy ---------------------------------------------------------------------------------------------------

    def decide_branches(self, call: ActiveCall, head: torch.nn.Module, args: tuple, kwargs: dict,
                        hidden: torch.Tensor, size: int) -> list[Decision]:
        """One Decision per branch of ``call`` (chunks of ``size`` along dim 0). May update branch states."""
        raise NotImplementedError

    def after_decision(self, call: ActiveCall, compute: bool) -> None:
        """Called once per call after the verdict (e.g. to reset accumulators of computed branches)."""

    def on_residual(self, call: ActiveCall, key: str, residual: torch.Tensor, output: torch.Tensor) -> None:
        """Called per branch after a computed call stored its residual (calibration hooks in here)."""

    @property
    def weighs_metric(self) -> bool:
        """Whether this run weighs its metric by the forecast's record: the cache does (``weighs_metric_by_forecast``)
        and its forecast is one of ``WEIGHED_ORDERS``."""
        return self.weighs_metric_by_forecast and self.config.forecast_order in WEIGHED_ORDERS

    def metric_weight(self, st: CachedResidualState) -> float:
        """What the policy multiplies a branch's metric by: its ``ErrorPerMetric.weight()`` when the run
        ``weighs_metric``, else 1."""
        return st.error_per_metric.weight() if self.weighs_metric else 1.0

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

    def rule(self, name: str) -> StepRule | None:
        """This run's step rule of that ``name`` (None: the run has none)."""
        return next((rule for rule in self.rules if rule.name == name), None)

    def step_profile(self) -> StepProfile | None:
        """A calibrating run's step profile (``ProfileRecorder.step_profile``); None for any other run."""
        return self.profile.step_profile() if self.profile is not None else None

    def cache_bytes(self) -> int:
        """Bytes of the tensors the branch states hold (``state.held_bytes``)."""
        return held_bytes([self.branch_state(key) for key in self.states.contexts()])

    def _count_bytes(self) -> None:
        """The most bytes the branch states have held so far, in the statistics."""
        self.stats.cache_bytes = max(self.stats.cache_bytes, self.cache_bytes())

    # -- the call -------------------------------------------------------------------------------------------------

    def decide(self, head: torch.nn.Module, args: tuple, kwargs: dict, hidden: torch.Tensor) -> bool:
        """Decide for the current call: the policy's decision per branch, then each step rule in turn; the stack
        computes when any branch does (on any rank). True means compute the blocks."""
        call = self._active
        call.keep_own_part()
        if call.chunk == 0 or hidden.shape[0] % call.chunk:
            call.as_one_branch()
        size = hidden.shape[0] // call.chunk
        decisions = self.decide_branches(call, head, args, kwargs, hidden, size)
        call.head_call = (args, kwargs)
        call.states = [self.branch_state(key) for key in call.keys]
        call.branch_shapes = [hidden[i * size:(i + 1) * size].shape for i in range(call.chunk)]
        for rule in self.rules:
            decisions = rule.revise(call, decisions)
        local_compute = any(d.reason != REUSE for d in decisions)
        agreement = call.context.rank.agreement
        # under sequence parallelism every rank must take the same path, or one waits in a collective forever
        compute = agreement.any(local_compute) if agreement is not None else local_compute
        self.after_decision(call, compute)
        for rule in self.rules:
            rule.settle(call, compute)
        reuse_reason = OTHER_BRANCH if local_compute else OTHER_RANK
        call.record = EvaluationRecord(
            step=call.context.step, total_steps=call.context.total_steps, computed=compute,
            branches=[BranchDecision(branch=call.labels[i], computed=compute,
                                     reason=reuse_reason if compute and d.reason == REUSE else d.reason,
                                     metric=d.metric, threshold=self.config.threshold)
                      for i, d in enumerate(decisions)])
        call.context.blocks_run = compute
        return compute

    def skipped_residuals(self) -> list[torch.Tensor]:
        """Per branch of the current (skipped) call: the residual to add, the last computed one or the forecast's
        (``Forecaster.residuals``); with skip correction, what it used is recorded."""
        call = self._active
        states = [self.branch_state(k) for k in call.keys]
        residuals = ([st.previous_residual for st in states] if self.forecaster is None
                     else self.forecaster.residuals(call, states))
        if self.corrector is not None and self.corrector.applies(call.context):
            self.corrector.skipped(call.context, states, residuals)
            self._count_bytes()  # with the gap's sums
        return residuals

    def reused_hidden(self, head_input: torch.Tensor) -> torch.Tensor:
        """The stack output of a skipped call: its head input plus each branch's cached (or forecast) residual."""
        residuals = self.skipped_residuals()
        residual = residuals[0] if len(residuals) == 1 else torch.cat([r.to(head_input.device) for r in residuals])
        return head_input + residual.to(device=head_input.device, dtype=head_input.dtype)

    def store_residual(self, head_input: torch.Tensor, output: torch.Tensor) -> torch.Tensor | None:
        """After a computed call: keep ``output - head_input`` per branch (on ``cache_device`` if set). Returns the
        stack output the model goes on with: ``output`` plus each branch's skip correction, None when nothing is
        corrected (``output`` as it is). Its steps in turn: the correction and the calibration's change (both
        against the kept residual), keeping the new one, the forecast, the policy's ``on_residual``, the profile."""
        call = self._active
        if output.shape != head_input.shape:
            self.stats.stack_shape_mismatch = True
            self.stats.warn(f"the stack output shape {tuple(output.shape)} differs from its input "
                            f"{tuple(head_input.shape)}; such calls are always computed")
            return None
        size = output.shape[0] // call.chunk
        residual = (output - head_input).detach()
        states = [self.branch_state(key) for key in call.keys]
        parts = [residual[i * size:(i + 1) * size] for i in range(call.chunk)]
        correcting = self.corrector is not None and self.corrector.applies(call.context)
        corrections = self.corrector.corrections(call.context, states, parts) if correcting else []
        changes = self.profile.measure(states, parts) if self.profile is not None else []
        device = self.config.cache_device
        for i, (st, part) in enumerate(zip(states, parts)):
            st.previous_residual = part.to(device) if device is not None else part
            st.residual_input_shape = head_input[i * size:(i + 1) * size].shape
        if self.forecaster is not None:
            self.forecaster.computed(call, states)
        for i, (key, part) in enumerate(zip(call.keys, parts)):
            self.on_residual(call, key, part, output[i * size:(i + 1) * size].detach())
        if self.profile is not None:
            self.profile.record(call, changes, parts)
        self._count_bytes()
        return self.corrector.corrected(output, corrections) if correcting else None

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
