"""One run lifecycle for every feature this pack applies to a ComfyUI MODEL: caches, offload, sequence parallel.

A node never touches the torch module. It calls ``attach_feature``, which clones the MODEL, appends a small
deepcopy-safe ``AppliedFeature`` to the clone's list of features and (once per clone lineage) adds one pair of keyed
patcher wrappers that drive every feature of the MODEL:

  * OUTER_SAMPLE, one sampling run: a ``SamplingRun`` detects the model once (``nodes.families.detect``) and holds
    one ``FeatureSession`` (a feature's part of the sampling run) per applied feature, created in ``SESSION_ORDER``
    (weights, then sharding, then caching) inside the ``try`` whose ``finally`` closes them in reverse order, errors
    and interrupts included, then publishes the run's one statistics entry (``nodes.stats_store``), made of each
    session's ``report()``. The guider's model options are swapped for a copy for the run and always restored.
    Before any session exists, ``checked_for_drift`` checks the model (``nodes.families.drift``).
  * PREPARE_SAMPLING, model load: after ComfyUI loaded the models for the run, each session's ``after_load`` may act
    on the loaded MODEL (offload must); whatever it does is undone by the session's ``close``.
  * DIFFUSION_MODEL, one model call: sessions install their hooks lazily on the module actually called (so deep
    clones are covered), the wrapper builds the call's ``CallContext`` (branches, labels, step) and passes it to every
    session's ``begin_call`` in order and ``end_call`` in reverse.

The input MODEL and every other clone never see a hook: hooks exist only during a run of ours and pass through
outside a call of ours. Which features may share a MODEL is the table ``COMBINABLE``; a refused pair is a
``FeatureConflictError`` naming both nodes.
"""
from __future__ import annotations

import dataclasses
import enum
import importlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import comfy.model_management
import comfy.model_patcher
import comfy.patcher_extension as pe
import torch

from ..omni_hooks.context import CallContext
from . import stats_store
from .families import DetectedModel, detect, drift
from .samplers import corrects_by_weights, step_index, step_weights, takes_euler_steps
from .stats_store import FeatureReport, RunHeader

log = logging.getLogger("OmniHooks")

FEATURES_KEY = "omni_hooks.features"  # transformer_options: the tuple of AppliedFeature on this MODEL
RUN_KEY = "omni_hooks.run"  # transformer_options of a sampling run's model-options copy: its SamplingRun
# ... and whether its sampler takes plain Euler steps (``CallContext.euler_steps``; sent to every rank with the call)
EULER_KEY = "omni_hooks.euler_steps"
# ... and how much each step's output moves the final latent on that sampler (``CallContext.step_weights``)
WEIGHTS_KEY = "omni_hooks.step_weights"
# ... and whether a speed-up's skip correction weighs the gaps by them (``CallContext.weighted_correction``)
WEIGHTED_KEY = "omni_hooks.weighted_correction"
WRAPPER_KEY = "omni_hooks"
CATEGORY = "OmniHooks"                 # every node's menu category


def display_name(title: str) -> str:
    """A node's name in ComfyUI's menus: its title and the pack's."""
    return f"{title} (OmniHooks)"


class Category(str, enum.Enum):
    """What a feature does to the model; decides compatibility and the order of a run's sessions."""

    OFFLOAD = "offload"
    SEQUENCE_PARALLEL = "sequence parallel"
    CACHE = "cache"


# Pairs of categories that may share one MODEL. Not listed: two caches (both would skip the same blocks), two
# offloads, two sequence-parallel nodes.
COMBINABLE: frozenset[frozenset[Category]] = frozenset({
    frozenset({Category.CACHE, Category.OFFLOAD}),
    frozenset({Category.CACHE, Category.SEQUENCE_PARALLEL}),
    frozenset({Category.OFFLOAD, Category.SEQUENCE_PARALLEL}),
})

# A run's sessions begin in this order and end in the reverse: weights must be placed before the model runs sharded,
# and a cache decides on what the sharded model computes.
SESSION_ORDER: tuple[Category, ...] = (Category.OFFLOAD, Category.SEQUENCE_PARALLEL, Category.CACHE)
# After ComfyUI's load, sequence parallel reads the loaded weights (to send them to its other ranks) before offload
# replaces the blocks' weights with placeholders.
LOAD_ORDER: tuple[Category, ...] = (Category.SEQUENCE_PARALLEL, Category.OFFLOAD, Category.CACHE)


@dataclass(frozen=True)
class AppliedFeature:
    """The marker a node leaves on its MODEL clone: small and deepcopy-safe (it travels in ``model_options``)."""

    kind: str          # "teacache", "magcache", "offload", ...
    category: Category
    node_title: str    # "Apply TeaCache"
    node_id: str | None
    config: Any        # the feature's one frozen config (omni_hooks), built by the node, read unchanged by its hooks
    # set for one run by the drift check: what it could not verify about the model (a cache then computes every step)
    unverified: tuple[str, ...] = ()

    def describe(self) -> str:
        return f"{self.node_title} (node #{self.node_id})" if self.node_id else self.node_title


class FeatureConflictError(RuntimeError):
    """Two features that cannot share a MODEL, or a hook that another node's hook excludes."""


@dataclass(frozen=True)
class LoadRequest:
    """What ComfyUI loaded a run's models for (the arguments of ``prepare_sampling``): the shape of the run's noise
    and its conditioning, from which ``comfy.sampler_helpers.estimate_memory`` estimates the run's activations, and
    the run's sampler steps (its sigmas less one; None where the sampling call did not show them)."""

    noise_shape: tuple[int, ...] | None
    conds: Any = None
    steps: int | None = None


class FeatureSession:
    """One feature's part of one sampling run (``SamplingRun``). Subclasses override what they need; every default
    does nothing.

    Made with the MODEL's patcher, the feature and the sampling run's ``DetectedModel`` (detected once per sampling
    run). Contract: ``__init__`` must not touch the torch module. ``install(dm)`` may register hooks on ``dm`` and is
    called again (after ``remove()``) if the run calls another module. ``close(status)`` undoes everything
    ``after_load`` and ``install`` did, is called exactly once per run whatever happened, and must not raise for a
    half-done setup. ``load_request`` is set just before ``after_load`` (None until then); ``run_header`` (which run
    this is, for events sent during the run) when the session is made.
    """

    load_request: LoadRequest | None = None
    run_header: RunHeader | None = None

    def __init__(self, patcher, feature: AppliedFeature, detected: DetectedModel):
        self.patcher = patcher
        self.feature = feature
        self.detected = detected

    def after_load(self, patcher) -> None:
        """ComfyUI has loaded the models for this run."""

    def install(self, diffusion_model: torch.nn.Module) -> None:
        """Register this feature's hooks on the diffusion model about to be called."""

    def remove(self) -> None:
        """Remove what ``install`` registered."""

    def before_call(self, args: tuple, kwargs: dict, transformer_options: dict) -> None:
        """A model call is about to start (hooks installed, before ``begin_call``): its arguments as the
        DIFFUSION_MODEL wrapper got them; ``transformer_options`` is this call's own copy and may be changed."""

    def call_arguments(self, args: tuple, kwargs: dict, options: dict) -> tuple[tuple, dict]:
        """The arguments the model is called with, after every ``before_call`` (default: unchanged). ``options`` is
        the call's ``transformer_options`` (one of the arguments)."""
        return args, kwargs

    def call_output(self, output: Any) -> Any:
        """What the call returns, from what the model returned (default: unchanged)."""
        return output

    def begin_call(self, context: CallContext) -> None:
        """A model call starts (hooks installed)."""

    def end_call(self, context: CallContext) -> None:
        """The model call ended (also after an error inside it)."""

    def explain_failure(self, error: Exception) -> Exception | None:
        """A model call raised ``error``: return a clearer exception to raise instead (None: not this feature's)."""
        return None

    def close(self, status: str) -> None:
        """The run ended with ``status`` ("success", "error", "interrupted"): undo everything."""
        self.remove()

    def summary(self) -> dict[str, Any] | None:
        """What this feature did in the run, JSON-safe: its card in the run's entry (None: no card)."""
        return None

    def report(self) -> FeatureReport:
        """This feature's part of the run's statistics entry, after ``close`` (default: ``summary()`` as its card).
        Override to add a headline, top-level fields or a cache's statistics."""
        return FeatureReport.of(self.feature, card=self.summary())


SessionFactory = Callable[[Any, AppliedFeature, DetectedModel], FeatureSession]


@dataclass(frozen=True)
class FeatureSpec:
    """How a kind of feature runs: its category and how its part of a sampling run (its session) is made. The module
    of a feature kind defines it as ``FEATURE`` and is listed in ``FEATURE_MODULES``."""

    kind: str
    category: Category
    session_factory: SessionFactory


#: Every kind of feature of the pack: the modules (relative to this package) whose ``FEATURE`` says how it runs.
#: Rank 0's lifecycle and every sequence-parallel worker know the kinds from here alone (``feature_specs``); a new
#: kind of feature is one line here.
FEATURE_MODULES: tuple[str, ...] = (
    ".caches.teacache",
    ".caches.magcache",
    ".offload.session",
    ".sequence_parallel.node",
)

_SPECS: dict[str, FeatureSpec] = {}  # feature_specs(), once made


def named(title: str, error: ValueError) -> ValueError:
    """``error`` as a ValueError whose message starts with the node's title (once)."""
    message = str(error)
    return ValueError(message if message.startswith(title) else f"{title}: {message}")


def _same(value: Any, model: Any = None) -> Any:
    return value


@dataclass(frozen=True)
class ConfigInput:
    """How one node input sets one field of its feature's config.

    ``field``: the field's name. ``to_config(value, model)``: the input's value as the field's, for the node's MODEL
    (what only the node means by a value: -1 for None, GiB for bytes, a combo's words; a value the node cannot map
    raises ValueError in the node's words). ``from_config(field_value)``: the reverse, for the widget's default.
    Neither checks a value the config checks.
    """

    field: str
    to_config: Callable[[Any, Any], Any] = _same
    from_config: Callable[[Any], Any] = _same


class ConfigInputs:
    """A node's inputs and the config class they build: the one mapping every node of this pack uses.

    ``table`` names each input that sets a field of another name or form (a ``ConfigInput``, or the field's name
    alone); any other input sets the field of its own name unchanged. The schema takes each input's default from the
    config (``default``), the node builds its config from ``fields``, and a config's ValueError reaches the user in
    the node's words (``error``): so each value is checked once, in the config, and each default written once, there.
    """

    def __init__(self, config_cls: type, table: dict[str, ConfigInput | str] | None = None):
        self.config_cls = config_cls
        self.table = {name: spec if isinstance(spec, ConfigInput) else ConfigInput(spec)
                      for name, spec in (table or {}).items()}

    def input(self, name: str) -> ConfigInput:
        """The ``ConfigInput`` of the node's input ``name``."""
        return self.table.get(name) or ConfigInput(name)

    def default(self, name: str) -> Any:
        """The widget default of input ``name``: its config field's default, in the node's form."""
        spec = self.input(name)
        (found,) = [f for f in dataclasses.fields(self.config_cls) if f.name == spec.field]
        return spec.from_config(found.default)

    def fields(self, inputs: dict[str, Any], model: Any = None) -> dict[str, Any]:
        """``inputs`` (the node's, by name) as the config fields they set, for ``model``."""
        return {self.input(name).field: self.input(name).to_config(value, model) for name, value in inputs.items()}

    def error(self, title: str, error: ValueError, inputs: dict[str, Any], model: Any = None) -> ValueError:
        """A config's ``error`` about the fields ``inputs`` set, as the node's: its title first, and where the
        message starts with a field another input sets, that input's name, its value and its form of None."""
        message = str(error)
        for name, value in inputs.items():
            spec = self.input(name)
            if spec.field == name and spec.to_config is _same or not message.startswith(f"{spec.field} "):
                continue
            message = f"{name}{message[len(spec.field):]}"
            if spec.to_config is not _same:
                try:
                    message = message.replace(f"got {spec.to_config(value, model)!r}", f"got {value!r}")
                except ValueError:  # the input's own value was refused: its message is the node's already
                    pass
                message = message.replace("None (auto)", f"{spec.from_config(None)!r} (auto)")
            break
        return named(title, ValueError(message))


def feature_specs() -> dict[str, FeatureSpec]:
    """Every feature kind's ``FeatureSpec``, by kind: the ``FEATURE`` of each module of ``FEATURE_MODULES``, imported
    on the first call (each of them imports this module, so not before). ValueError for a kind declared twice."""
    if not _SPECS:
        specs: dict[str, FeatureSpec] = {}
        for name in FEATURE_MODULES:
            spec: FeatureSpec = importlib.import_module(name, __package__).FEATURE
            if spec.kind in specs:
                raise ValueError(f"feature kind {spec.kind!r} is declared twice (FEATURE_MODULES: {name})")
            specs[spec.kind] = spec
        _SPECS.update(specs)
    return _SPECS


def applied_features(model) -> tuple[AppliedFeature, ...]:
    return tuple(model.model_options.get("transformer_options", {}).get(FEATURES_KEY, ()))


def check_combinable(existing: tuple[AppliedFeature, ...], feature: AppliedFeature) -> None:
    """FeatureConflictError naming both nodes when ``feature`` may not join ``existing`` on one MODEL."""
    for other in existing:
        if frozenset({other.category, feature.category}) in COMBINABLE:
            continue
        if other.category == feature.category == Category.CACHE:
            why = (f"Only one cache can run on a model (both would skip the same blocks). Remove one of the two "
                   f"nodes, or connect {feature.node_title} to the model loader's output instead.")
        else:
            why = f"A MODEL takes one {feature.category.value} node; remove one of the two."
        raise FeatureConflictError(f"{feature.describe()}: this MODEL already has {other.describe()}. {why}")


def attach_feature(model, feature: AppliedFeature):
    """A clone of ``model`` carrying ``feature`` (after those it already has). The input MODEL is not changed."""
    if feature.kind not in feature_specs():
        raise ValueError(f"unknown feature kind {feature.kind!r}; list the module defining its FEATURE in "
                         "FEATURE_MODULES (nodes/features.py)")
    existing = applied_features(model)
    check_combinable(existing, feature)
    clone = model.clone()
    clone.model_options["transformer_options"][FEATURES_KEY] = existing + (feature,)
    if not clone.get_wrappers(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY):
        clone.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, _outer_sample)
        clone.add_wrapper_with_key(pe.WrappersMP.PREPARE_SAMPLING, WRAPPER_KEY, _prepare_sampling)
        clone.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY, _diffusion_model)
    return clone


@dataclass
class SamplingRun:
    """One sampling run of a MODEL with all its features: the model detected once (``detected``), the features'
    sessions in ``SESSION_ORDER`` and what they share."""

    patcher: Any
    detected: DetectedModel
    sessions: list[FeatureSession] = field(default_factory=list)
    installed_on: torch.nn.Module | None = None
    labels: dict[str, str] = field(default_factory=dict)
    schedules: dict = field(default_factory=dict)  # step_of's memo for this run
    header: RunHeader | None = None                # the run's statistics header, once opened
    closed: bool = False
    steps: int | None = None                       # the run's sampler steps (its sigmas less one)

    def open(self, features: tuple[AppliedFeature, ...], factories: dict[str, SessionFactory] | None = None) -> None:
        """Create one session per feature, in ``SESSION_ORDER`` (each kept as soon as it exists, for ``close``).
        ``factories``: a kind's session made otherwise than its spec says (a worker rank's side of a feature)."""
        rank = {category: i for i, category in enumerate(SESSION_ORDER)}
        ordered = sorted(features, key=lambda f: rank[f.category])
        if ordered:  # the run's node (its statistics entry's): its cache's, else the feature last in SESSION_ORDER
            self.header = stats_store.run_started(ordered[-1])
        for feature in ordered:
            factory = (factories or {}).get(feature.kind) or feature_specs()[feature.kind].session_factory
            session = factory(self.patcher, feature, self.detected)
            session.run_header = self.header
            self.sessions.append(session)

    def after_load(self, patcher, request: LoadRequest | None = None) -> None:
        rank = {category: i for i, category in enumerate(LOAD_ORDER)}
        for session in sorted(self.sessions, key=lambda s: rank[s.feature.category]):
            session.load_request = request
            session.after_load(patcher)

    def label_of(self, uuid: str, cond_or_uncond: int) -> str:
        """"cond"/"uncond", with ".1", ".2" for further cond entries of the same kind (areas, multiple conds)."""
        label = self.labels.get(uuid)
        if label is None:
            base = "uncond" if cond_or_uncond == 1 else "cond"
            n = sum(1 for v in self.labels.values() if v.split(".")[0] == base)
            label = base if n == 0 else f"{base}.{n}"
            self.labels[uuid] = label
        return label

    def ensure_installed(self, diffusion_model: torch.nn.Module) -> None:
        """Install every session's hooks on ``diffusion_model`` (moving them if the run called another module)."""
        if self.installed_on is diffusion_model:
            return
        self.remove_hooks()
        try:
            for session in self.sessions:
                session.install(diffusion_model)
        except RuntimeError as e:
            self.remove_hooks()
            names = ", ".join(s.feature.describe() for s in self.sessions)
            raise FeatureConflictError(f"{names}: {e}. Another node already replaces the forward of these blocks; "
                                       f"use only one cache on this model.") from e
        except Exception:
            self.remove_hooks()
            raise
        self.installed_on = diffusion_model

    def remove_hooks(self) -> None:
        for session in reversed(self.sessions):
            session.remove()
        self.installed_on = None

    def close(self, status: str) -> None:
        """Close every session in reverse order, each whatever the others did, then publish the run's statistics
        (one entry of every session's ``report``); re-raise the first failure."""
        if self.closed:
            return
        self.closed = True
        failure: BaseException | None = None
        for session in reversed(self.sessions):
            try:
                session.close(status)
            except Exception as e:  # keep closing the others; the first failure is raised below
                log.exception("OmniHooks: closing %s failed", session.feature.describe())
                failure = failure or e
        self.installed_on = None
        try:
            self.publish(status)
        except Exception:  # statistics never fail a run
            log.exception("OmniHooks: publishing the run's statistics failed")
        if failure is not None:
            raise failure

    def publish(self, status: str) -> None:
        if self.header is not None:
            stats_store.run_finished(self.header, status, [session.report() for session in self.sessions])


def _outer_sample(executor, *args, **kwargs):
    guider = executor.class_obj
    original_options = guider.model_options
    features = tuple(original_options.get("transformer_options", {}).get(FEATURES_KEY, ()))
    sampling_run = SamplingRun(patcher=guider.model_patcher, detected=detect(guider.model_patcher))
    guider.model_options = comfy.model_patcher.create_model_options_clone(original_options)
    guider.model_options["transformer_options"][RUN_KEY] = sampling_run
    # outer_sample(noise, latent_image, sampler, sigmas, ...); options, so that they reach the other ranks too
    sampler = kwargs.get("sampler", args[2] if len(args) > 2 else None)
    sigmas = kwargs.get("sigmas", args[3] if len(args) > 3 else None)
    model_sampling = guider.model_patcher.get_model_object("model_sampling")
    guider.model_options["transformer_options"][EULER_KEY] = takes_euler_steps(sampler, model_sampling)
    guider.model_options["transformer_options"][WEIGHTS_KEY] = step_weights(sampler, sigmas, model_sampling,
                                                                            guider.model_patcher)
    guider.model_options["transformer_options"][WEIGHTED_KEY] = corrects_by_weights(sampler)
    sampling_run.steps = max(len(sigmas) - 1, 0) if sigmas is not None else None
    status = "error"
    try:
        features = checked_for_drift(sampling_run, features)
        if carries_reference_latents(guider):
            features = tuple(for_reference_latents(feature) for feature in features)
        guider.model_options["transformer_options"][FEATURES_KEY] = features  # what the run's calls (and ranks) see
        sampling_run.open(features)
        result = executor(*args, **kwargs)
        status = "success"
        return result
    except comfy.model_management.InterruptProcessingException:
        status = "interrupted"
        raise
    finally:
        try:
            sampling_run.close(status)
        finally:
            guider.model_options = original_options


def carries_reference_latents(guider) -> bool:
    """True when a conditioning of ``guider``'s run carries reference latents (ComfyUI's ReferenceLatent node: Flux
    Kontext, image edits)."""
    conds = getattr(guider, "original_conds", None) or {}
    return any(cond.get("reference_latents") is not None for group in conds.values() for cond in group or ())


def for_reference_latents(feature: AppliedFeature) -> AppliedFeature:
    """``feature`` for a run with reference latents: with its config's ``with_reference`` where it has one (a
    cache's 'auto' on Flux: Kontext's published entry and window), unchanged otherwise."""
    alternative = getattr(feature.config, "with_reference", None)
    return dataclasses.replace(feature, config=alternative) if alternative is not None else feature


def checked_for_drift(sampling_run: SamplingRun, features: tuple[AppliedFeature, ...]) -> tuple[AppliedFeature, ...]:
    """``features`` once the sampling run's model passed ``drift.check_model`` against its detected family: raises
    ``ModelDriftError`` naming the nodes that rely on what differs; returns the caches marked with what could not be
    verified. Runs before anything is installed or exchanged."""
    if not features:
        return features
    parallel = [f for f in features if f.category == Category.SEQUENCE_PARALLEL]
    report = drift.check_model(sampling_run.detected.family, sampling_run.patcher.model.diffusion_model,
                               sequence_parallel=bool(parallel))
    error = (report.error(", ".join(f.describe() for f in features), (drift.MODEL,))
             or report.error(", ".join(f.describe() for f in parallel), (drift.SEQUENCE_PLAN,)))
    if error is not None:
        raise error
    for what in report.undecided:
        log.warning("OmniHooks: %s: %s", report.family.display_name, what.what)
    unverified = tuple(f.what for f in report.undecided)
    return tuple(dataclasses.replace(f, unverified=unverified) if unverified and f.category == Category.CACHE else f
                 for f in features)


def _prepare_sampling(executor, model_patcher, *args, **kwargs):
    loaded = executor(model_patcher, *args, **kwargs)
    options = kwargs.get("model_options") or {}
    sampling_run: SamplingRun | None = options.get("transformer_options", {}).get(RUN_KEY)
    if sampling_run is not None:
        # prepare_sampling(model, noise_shape, conds, model_options=...)
        noise_shape = kwargs.get("noise_shape", args[0] if args else None)
        conds = kwargs.get("conds", args[1] if len(args) > 1 else None)
        request = LoadRequest(tuple(noise_shape) if noise_shape is not None else None, conds, sampling_run.steps)
        sampling_run.after_load(model_patcher, request)
    return loaded


# -- one model call: which call of the sampler's schedule it is, where its transformer_options sit, its CallContext

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
    return StepInfo(step_index(values, sigma), total, sigma, values)


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
                       schedule=step.schedule, euler_steps=options.get(EULER_KEY) is True,
                       step_weights=options.get(WEIGHTS_KEY), weighted_correction=options.get(WEIGHTED_KEY) is True)


def run_call(sampling_run: SamplingRun, diffusion_model: torch.nn.Module, forward: Callable[..., Any], args: tuple,
             kwargs: dict, options: dict) -> Any:
    """One model call of ``sampling_run``: hooks installed on ``diffusion_model``, every session's ``before_call``,
    ``call_arguments`` and ``begin_call``, ``forward(*args, **kwargs)``, ``call_output`` and ``end_call`` in
    reverse. A failure of the call is replaced by the first session's explanation of it (``explain_failure``), if
    any. The DIFFUSION_MODEL wrapper and a sequence-parallel worker rank both drive a call through here."""
    sampling_run.ensure_installed(diffusion_model)
    for session in sampling_run.sessions:
        session.before_call(args, kwargs, options)
    for session in sampling_run.sessions:
        args, kwargs = session.call_arguments(args, kwargs, options)
    context = call_context(sampling_run, options)
    begun: list[FeatureSession] = []
    try:
        for session in sampling_run.sessions:
            session.begin_call(context)
            begun.append(session)
        output = forward(*args, **kwargs)
        for session in reversed(sampling_run.sessions):
            output = session.call_output(output)
        return output
    except Exception as error:
        for session in sampling_run.sessions:
            explained = session.explain_failure(error)
            if explained is not None:
                raise explained from error
        raise
    finally:
        for session in reversed(begun):
            session.end_call(context)


def _diffusion_model(executor, *args, **kwargs):
    options = transformer_options_of(args, kwargs)
    sampling_run: SamplingRun | None = options.get(RUN_KEY)
    if sampling_run is None or not sampling_run.sessions:
        return executor(*args, **kwargs)
    return run_call(sampling_run, executor.class_obj, executor, args, kwargs, options)
