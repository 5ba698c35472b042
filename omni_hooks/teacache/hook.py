"""TeaCache on a block stack: decide at the head block, pass blocks through on a skip, add the residual at the tail.

After vllm-omni ``vllm_omni/diffusion/cache/teacache/hook.py`` (algorithm, hook-library-spec.md §3.5) with one
structural change: instead of re-implementing each model's forward in an extractor, the hooks sit on the model's own
blocks (``BlockStack``), so the model's forward runs unchanged and only the modulated input is model-specific.

Per model call the host says which batch chunks belong to which branch (``CallInfo``); each branch keeps its own
``TeaCacheState``. The stack is skipped only when every branch of the call may reuse its residual.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from ..base import HookRegistry, ModelHook, StateManager, module_has_active_hooks
from ..blockstack import BlockStack
from ..stats import BranchDecision, CacheRunStats, EvaluationRecord
from .config import TeaCacheConfig
from .state import TeaCacheState

HEAD_HOOK = "teacache"
BLOCK_HOOK = "teacache_block"
TAIL_HOOK = "teacache_tail"
CAPTURE_HOOK = "teacache_capture"

ModulatedInputFn = Callable[[torch.nn.Module, tuple, dict, "torch.Tensor | None"], torch.Tensor]


@dataclass
class ModulatedInput:
    """The extractor protocol: where a model's TeaCache signal comes from.

    ``compute(head_block, args, kwargs, captured)`` returns a batch-first tensor (first dimension = the head's image
    stream batch). If ``capture`` is set, the first positional input of that module, which the model calls before the
    head block, is passed as ``captured`` (e.g. Wan's time embedding entering ``time_projection``).
    """

    compute: ModulatedInputFn
    capture: torch.nn.Module | None = None


@dataclass
class CallInfo:
    """What the host knows about one model call: one branch key (and display label) per batch chunk, and the step."""

    branches: list[str]
    labels: list[str]
    step: int | None = None
    total_steps: int | None = None


def relative_l1(current: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """mean|current - previous| / mean|previous| as a 0-d tensor (no host sync)."""
    return (current - previous).abs().mean() / (previous.abs().mean() + 1e-8)


@dataclass
class _Call:
    info: CallInfo
    keys: list[str]
    labels: list[str]
    chunk: int
    started: float
    record: EvaluationRecord | None = None
    skipping: bool = False
    head_input: torch.Tensor | None = None
    captured: torch.Tensor | None = None
    pending_calibration: dict[str, float] = field(default_factory=dict)


class TeaCacheRun:
    """The shared state of TeaCache's hooks on one model for one sampling run.

    The host brackets every model call with ``begin_call``/``end_call``; outside a call every hook passes through,
    so other users of the same modules are unaffected.
    """

    def __init__(self, config: TeaCacheConfig, stack: BlockStack, modulated_input: ModulatedInput,
                 stats: CacheRunStats | None = None):
        self.config = config
        self.stack = stack
        self.modulated_input = modulated_input
        self.rescale = np.poly1d(config.coefficients)
        self.states = StateManager(TeaCacheState)
        self.stats = stats or CacheRunStats(kind="teacache", model="unknown", threshold=config.rel_l1_thresh)
        self._call: _Call | None = None
        self._installed: list[tuple[torch.nn.Module, str]] = []

    # -- host interface -------------------------------------------------------------------------------------------

    def begin_call(self, info: CallInfo) -> None:
        n = len(info.branches)
        self._call = _Call(info=info, keys=list(info.branches), labels=list(info.labels), chunk=n,
                           started=time.perf_counter())

    def end_call(self) -> EvaluationRecord | None:
        """Close the current call; returns its record (with the seconds spent) if the head block ran."""
        call, self._call = self._call, None
        if call is None or call.record is None:
            return None
        call.record.seconds = time.perf_counter() - call.started
        self.stats.record(call.record)
        return call.record

    @property
    def in_call(self) -> bool:
        return self._call is not None

    def branch_state(self, key: str) -> TeaCacheState:
        self.states.set_context(key)
        return self.states.get_state()

    def calibration_pairs(self) -> list[tuple[float, float]]:
        """Every (modulated-input change, stack-output change) pair recorded in calibration mode, all branches."""
        pairs = []
        for key in self.states.contexts():
            pairs.extend(self.branch_state(key).calibration_pairs)
        return pairs

    def cache_bytes(self) -> int:
        total = 0
        for key in self.states.contexts():
            st = self.branch_state(key)
            for t in (st.previous_residual, st.previous_modulated_input, st.previous_output):
                if t is not None:
                    total += t.numel() * t.element_size()
        return total

    # -- decisions ------------------------------------------------------------------------------------------------

    def _forced_reason(self, info: CallInfo) -> str | None:
        if info.step is None or not info.total_steps:
            return None
        cfg = self.config
        if info.step < cfg.ret_steps or (cfg.force_last_step and info.step >= info.total_steps - 1):
            return "forced"
        position = info.step / max(info.total_steps - 1, 1)
        if not cfg.start_percent <= position <= cfg.end_percent:
            return "window"
        return None

    def decide(self, modulated: torch.Tensor, hidden: torch.Tensor) -> bool:
        """Decide for the current call; True means compute the blocks. Updates every branch's state."""
        call = self._call
        batch = hidden.shape[0]
        if call.chunk == 0 or batch % call.chunk or modulated.shape[0] != batch:
            # chunks unknown or inconsistent: treat the whole batch as one branch
            call.keys = ["|".join(call.keys) or "default"]
            call.labels = ["+".join(call.labels) or "all"]
            call.chunk = 1
        n = call.chunk
        size = batch // n
        forced = self._forced_reason(call.info)
        cfg = self.config
        reasons: list[str] = []
        rel_tensors: list[torch.Tensor] = []
        rel_index: list[int] = []
        states = [self.branch_state(k) for k in call.keys]
        for i, st in enumerate(states):
            m = modulated[i * size:(i + 1) * size]
            h_shape = hidden[i * size:(i + 1) * size].shape
            prev = st.previous_modulated_input
            if cfg.calibrate:
                reasons.append("calibrate")
                if prev is not None and prev.shape == m.shape:
                    rel_tensors.append(relative_l1(m, prev))
                    rel_index.append(i)
            elif st.cnt == 0 or prev is None:
                reasons.append("first")
            elif prev.shape != m.shape or st.residual_input_shape != h_shape:
                reasons.append("shape")
            elif forced:
                reasons.append(forced)
            else:
                reasons.append("measure")
                rel_tensors.append(relative_l1(m, prev))
                rel_index.append(i)
        rels = torch.stack(rel_tensors).tolist() if rel_tensors else []  # one host sync per call
        metrics: list[float | None] = [None] * n
        for i, rel in zip(rel_index, rels):
            st = states[i]
            if cfg.calibrate:
                call.pending_calibration[call.keys[i]] = rel
                continue
            st.accumulated_rel_l1_distance += abs(float(self.rescale(rel)))
            metrics[i] = st.accumulated_rel_l1_distance
            can_reuse = st.previous_residual is not None
            reasons[i] = "reuse" if can_reuse and metrics[i] < cfg.rel_l1_thresh else "threshold"
        compute = any(r != "reuse" for r in reasons)
        decisions = []
        for i, st in enumerate(states):
            st.previous_modulated_input = modulated[i * size:(i + 1) * size].detach()
            st.cnt += 1
            reason = reasons[i]
            if compute:
                st.accumulated_rel_l1_distance = 0.0
                if reason == "reuse":
                    reason = "other-branch"
            decisions.append(BranchDecision(branch=call.labels[i], computed=compute, reason=reason,
                                            metric=metrics[i], threshold=cfg.rel_l1_thresh))
        call.record = EvaluationRecord(step=call.info.step, total_steps=call.info.total_steps,
                                       computed=compute, branches=decisions)
        call.skipping = not compute
        return compute

    def reused_hidden(self, head_input: torch.Tensor) -> torch.Tensor:
        """The stack output of a skipped call: its head input plus each branch's cached residual."""
        call = self._call
        residuals = [self.branch_state(k).previous_residual for k in call.keys]
        residual = residuals[0] if len(residuals) == 1 else torch.cat(
            [r.to(head_input.device) for r in residuals])
        return head_input + residual.to(device=head_input.device, dtype=head_input.dtype)

    def store_residual(self, head_input: torch.Tensor, output: torch.Tensor) -> None:
        """After a computed call: keep ``output - head_input`` per branch (on ``cache_device`` if set)."""
        call = self._call
        if output.shape != head_input.shape:
            self.stats.warn(f"the stack output shape {tuple(output.shape)} differs from its input "
                            f"{tuple(head_input.shape)}; this call cannot be cached")
            return
        size = output.shape[0] // call.chunk
        residual = (output - head_input).detach()
        device = self.config.cache_device
        for i, key in enumerate(call.keys):
            st = self.branch_state(key)
            part = residual[i * size:(i + 1) * size]
            st.previous_residual = part.to(device) if device is not None else part
            st.residual_input_shape = head_input[i * size:(i + 1) * size].shape
            if self.config.calibrate:
                out = output[i * size:(i + 1) * size].detach()
                rel_in = call.pending_calibration.get(key)
                if rel_in is not None and st.previous_output is not None and st.previous_output.shape == out.shape:
                    rel_out = relative_l1(out, st.previous_output.to(out.device)).item()
                    st.calibration_pairs.append((rel_in, rel_out))
                st.previous_output = out.to(device) if device is not None else out.clone()
        self.stats.cache_bytes = max(self.stats.cache_bytes, self.cache_bytes())

    # -- hooks ----------------------------------------------------------------------------------------------------

    def install(self) -> None:
        """Register the hooks on the stack's modules. Raises RuntimeError (changing nothing) on a conflict."""
        plan: list[tuple[torch.nn.Module, str, ModelHook]] = [(self.stack.blocks[0], HEAD_HOOK, TeaCacheHook(self))]
        plan += [(b, BLOCK_HOOK, TeaCacheBlockHook(self)) for b in self.stack.blocks[1:]]
        plan.append((self.stack.tail, TAIL_HOOK, TeaCacheTailHook(self)))
        if self.modulated_input.capture is not None:
            plan.append((self.modulated_input.capture, CAPTURE_HOOK, TeaCacheCaptureHook(self)))
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
            registry = HookRegistry.get_or_create(module)
            registry.remove_hook(name)
            if not module_has_active_hooks(module):
                registry.reset()
        self._installed.clear()
        self._call = None
        self.states.reset()


class TeaCacheHook(ModelHook):
    """On the head block: measure, decide, then run the block or pass its inputs through."""

    def __init__(self, run: TeaCacheRun):
        self.run = run

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        run = self.run
        call = run._call
        if call is None:
            return self.fn_ref.original_forward(*args, **kwargs)
        stack = run.stack
        hidden = stack.head_hidden.get(args, kwargs)
        modulated = run.modulated_input.compute(module, args, kwargs, call.captured)
        compute = run.decide(modulated, hidden)
        call.head_input = hidden.clone() if stack.clone_head_input else hidden
        if compute:
            return self.fn_ref.original_forward(*args, **kwargs)
        return stack.skip_block(module, args, kwargs)

    def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
        self.run.states.reset()
        return module


class TeaCacheBlockHook(ModelHook):
    """On every other block: pass the inputs through while the current call is skipping."""

    def __init__(self, run: TeaCacheRun):
        self.run = run

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        call = self.run._call
        if call is not None and call.skipping:
            return self.run.stack.skip_block(module, args, kwargs)
        return self.fn_ref.original_forward(*args, **kwargs)


class TeaCacheTailHook(ModelHook):
    """On the module after the stack: store the residual after a computed call, add it after a skipped one."""

    def __init__(self, run: TeaCacheRun):
        self.run = run

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        run = self.run
        call = run._call
        if call is None or call.head_input is None:
            return args, kwargs
        head_input, call.head_input = call.head_input, None
        tail = run.stack.tail_hidden
        if call.skipping:
            return tail.replace(args, kwargs, run.reused_hidden(head_input))
        run.store_residual(head_input, tail.get(args, kwargs))
        return args, kwargs


class TeaCacheCaptureHook(ModelHook):
    """On the module whose input is the TeaCache signal: remember that input for the head block."""

    def __init__(self, run: TeaCacheRun):
        self.run = run

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        call = self.run._call
        if call is not None and args:
            call.captured = args[0]
        return args, kwargs


def apply_teacache_hook(stack: BlockStack, config: TeaCacheConfig, modulated_input: ModulatedInput,
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
