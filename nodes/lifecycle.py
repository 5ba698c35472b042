"""The run lifecycle of a cache on a ComfyUI MODEL.

A node never touches the torch module. It clones the MODEL and attaches keyed patcher wrappers:
  * OUTER_SAMPLE: one sampling run. Creates a fresh ``CacheSession`` in a copy of the guider's model options and, in
    ``finally`` (errors and interrupts included), removes every hook, logs and publishes the run's statistics.
  * DIFFUSION_MODEL: one model call. Installs the hooks on first use (on the module actually called, which also
    covers deep clones), tells the cache which batch chunks are which branch and which step this is, then calls on.
The input MODEL and every other clone never see the hooks: they exist only while our run is inside the model, and the
hooks pass through outside a call of ours.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import comfy.model_management
import comfy.model_patcher
import comfy.patcher_extension as pe
import torch

from ..omni_hooks.stats import CacheRunStats
from . import stats_store

log = logging.getLogger("OmniHooks")

CACHES_KEY = "omni_hooks.caches"   # transformer_options: list of the caches applied to this MODEL (deepcopy-safe)
SESSION_KEY = "omni_hooks.session"  # transformer_options of one run's model options copy: the live CacheSession


@dataclass(frozen=True)
class AppliedCache:
    """The marker a cache node leaves on its MODEL clone; small and deepcopy-safe."""

    kind: str          # "teacache" / "magcache"
    node_title: str    # "Apply TeaCache"
    node_id: str | None
    settings: Any      # a frozen dataclass of the node's inputs

    def describe(self) -> str:
        return f"{self.node_title} (node #{self.node_id})" if self.node_id else self.node_title


class CacheConflictError(RuntimeError):
    pass


def applied_caches(model) -> list[AppliedCache]:
    return list(model.model_options.get("transformer_options", {}).get(CACHES_KEY, []))


def attach_cache(model, cache: AppliedCache, session_factory: Callable[[Any, "AppliedCache"], "CacheSession"]):
    """Clone ``model`` and attach ``cache`` to the clone. One cache per MODEL: a second is a clear error."""
    existing = applied_caches(model)
    if existing:
        raise CacheConflictError(
            f"{cache.describe()}: this MODEL already has {existing[0].describe()}. Only one cache can run on a "
            f"model (both would skip the same blocks). Remove one of the two nodes, or connect {cache.node_title} "
            f"to the model loader's output instead.")
    clone = model.clone()
    clone.model_options["transformer_options"][CACHES_KEY] = [cache]
    key = f"omni_hooks.{cache.kind}"

    def outer_sample(executor, *args, **kwargs):
        return _outer_sample(executor, cache, session_factory, args, kwargs)

    clone.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, key, outer_sample)
    clone.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, key, _diffusion_model)
    return clone


@dataclass
class StepInfo:
    step: int | None
    total_steps: int | None


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
        values = [float(s) for s in schedule.tolist()]
        memo[id(schedule)] = (schedule, values)
    for i, s in enumerate(values[:-1]):
        if s == sigma:
            return StepInfo(i, total)
    for i in range(total):
        hi, lo = max(values[i], values[i + 1]), min(values[i], values[i + 1])
        if lo <= sigma <= hi:
            return StepInfo(i, total)
    return StepInfo(None, total)

@dataclass
class CacheSession:
    """One sampling run of one cache: created in OUTER_SAMPLE, installs its hooks lazily, cleans up in close().

    Subclasses implement ``install(diffusion_model)``, ``begin_call(branches, labels, step)``, ``end_call()`` and
    ``remove()``.
    """

    cache: AppliedCache
    stats: CacheRunStats
    installed_on: torch.nn.Module | None = None
    labels: dict[str, str] = field(default_factory=dict)
    schedules: dict = field(default_factory=dict)  # step_of's memo for this run
    # set by stats_store.run_started: which run, prompt and sampler node this is
    run_id: str = ""
    prompt_id: str | None = None
    sampler_node_id: str | None = None
    started_at: float | None = None

    def label_of(self, uuid: str, cond_or_uncond: int) -> str:
        """"cond"/"uncond", with ".1", ".2" for further cond entries of the same kind (areas, multiple conds)."""
        label = self.labels.get(uuid)
        if label is None:
            base = "uncond" if cond_or_uncond == 1 else "cond"
            n = sum(1 for v in self.labels.values() if v.split(".")[0] == base)
            label = base if n == 0 else f"{base}.{n}"
            self.labels[uuid] = label
        return label

    def install(self, diffusion_model: torch.nn.Module) -> None:
        raise NotImplementedError

    def begin_call(self, branches: list[str], labels: list[str], step: StepInfo) -> None:
        raise NotImplementedError

    def end_call(self) -> None:
        raise NotImplementedError

    def remove(self) -> None:
        raise NotImplementedError


def _outer_sample(executor, cache: AppliedCache, session_factory, args, kwargs):
    guider = executor.class_obj
    original_options = guider.model_options
    guider.model_options = comfy.model_patcher.create_model_options_clone(original_options)
    session = session_factory(guider.model_patcher, cache)
    guider.model_options["transformer_options"][SESSION_KEY] = session
    stats_store.run_started(session)
    status = "error"
    try:
        result = executor(*args, **kwargs)
        status = "success"
        return result
    except comfy.model_management.InterruptProcessingException:
        status = "interrupted"
        raise
    finally:
        try:
            session.remove()
        finally:
            guider.model_options = original_options
            stats_store.run_finished(session, status)


def _transformer_options(args: tuple, kwargs: dict) -> dict:
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
        if SESSION_KEY in candidate:
            return candidate
    return dicts[-1] if dicts else {}


def _diffusion_model(executor, *args, **kwargs):
    options = _transformer_options(args, kwargs)
    session: CacheSession | None = options.get(SESSION_KEY)
    if session is None:
        return executor(*args, **kwargs)
    dm = executor.class_obj
    if session.installed_on is not dm:
        if session.installed_on is not None:
            session.remove()
        try:
            session.install(dm)
        except RuntimeError as e:
            raise CacheConflictError(f"{session.cache.describe()}: {e}. Another node already replaces the forward "
                                     f"of these blocks; use only one cache on this model.") from e
        session.installed_on = dm
    uuids = [str(u) for u in options.get("uuids", [])]
    cond_or_uncond = list(options.get("cond_or_uncond", []))
    if len(uuids) != len(cond_or_uncond):
        uuids = [str(c) for c in cond_or_uncond]
    labels = [session.label_of(u, c) for u, c in zip(uuids, cond_or_uncond)]
    session.begin_call(uuids, labels, step_of(options, session.schedules))
    try:
        return executor(*args, **kwargs)
    finally:
        record = session.end_call()
        if record is not None:
            stats_store.step_finished(session, record)
