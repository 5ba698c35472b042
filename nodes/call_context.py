"""One model call as the run lifecycle sees it: which call of the sampler's schedule it is, where its
``transformer_options`` sit among its arguments, and the ``CallContext`` every feature shares for it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..omni_hooks.context import CallContext

if TYPE_CHECKING:
    from .features import SamplingRun

RUN_KEY = "omni_hooks.run"  # transformer_options of a sampling run's model-options copy: its SamplingRun
# ... and whether its sampler takes plain Euler steps (``CallContext.euler_steps``; sent to every rank with the call)
EULER_KEY = "omni_hooks.euler_steps"


@dataclass
class StepInfo:
    """Where one call lies in the sampler's schedule (None: the schedule does not say)."""

    step: int | None
    total_steps: int | None
    sigma: float | None = None  # the sigma of this call (heun's second evaluation lies between schedule points)
    schedule: tuple[float, ...] | None = None  # the run's sigmas, the last one after the final step


def step_of(transformer_options: dict, schedules: dict | None = None) -> StepInfo:
    """This call's step within the sampler's schedule, from ``sample_sigmas`` (not from counting calls).

    Exact match first; samplers that evaluate between schedule points (heun, dpm_2, ...) get the interval that holds
    the current sigma. ``schedules`` memoises the schedule as Python floats per run, so a step costs one host read
    (the current sigma), not one per schedule entry.
    """
    schedule = transformer_options.get("sample_sigmas")
    sigmas = transformer_options.get("sigmas")
    if schedule is None or sigmas is None or len(schedule) < 2:
        return StepInfo(None, None)
    total = len(schedule) - 1
    sigma = float(sigmas.flatten()[0])
    memo = schedules if schedules is not None else {}
    held, values = memo.get(id(schedule), (None, None))
    if held is not schedule:  # holding the tensor keeps its id from being reused by another one
        values = tuple(float(s) for s in schedule.tolist())
        memo[id(schedule)] = (schedule, values)
    for i, s in enumerate(values[:-1]):
        if s == sigma:
            return StepInfo(i, total, sigma, values)
    for i in range(total):
        hi, lo = max(values[i], values[i + 1]), min(values[i], values[i + 1])
        if lo <= sigma <= hi:
            return StepInfo(i, total, sigma, values)
    return StepInfo(None, total, sigma, values)


def transformer_options_of(args: tuple, kwargs: dict) -> dict:
    """The ``transformer_options`` of a DIFFUSION_MODEL call.

    By keyword when given so (Lumina2 passes it in ``**kwargs``), else the last positional dict: it is not always the
    last argument (LTXV passes ``keyframe_idxs`` after it) and Flux, Chroma, HunyuanVideo and HiDream pass the
    ControlNet ``control`` dict positionally, but always before it.
    """
    options = kwargs.get("transformer_options")
    if isinstance(options, dict):
        return options
    dicts = [a for a in args if isinstance(a, dict)]
    for candidate in reversed(dicts):  # prefer the one that carries our run, should a model ever order them otherwise
        if RUN_KEY in candidate:
            return candidate
    return dicts[-1] if dicts else {}


def call_context(sampling_run: SamplingRun, options: dict) -> CallContext:
    """The context of one model call: one branch key and label per batch chunk, and the step."""
    uuids = [str(u) for u in options.get("uuids", [])]
    cond_or_uncond = list(options.get("cond_or_uncond", []))
    if len(uuids) != len(cond_or_uncond):
        uuids = [str(c) for c in cond_or_uncond]
    labels = [sampling_run.label_of(u, c) for u, c in zip(uuids, cond_or_uncond)]
    step = step_of(options, sampling_run.schedules)
    return CallContext(branches=uuids, labels=labels, step=step.step, total_steps=step.total_steps, sigma=step.sigma,
                       schedule=step.schedule, euler_steps=options.get(EULER_KEY) is True)
