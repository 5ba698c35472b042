"""Block-stack caches as data: one ``CacheSpec`` per cache, from which its Apply and Calibrate nodes are built.

A spec says what differs between caches: the published table and how 'auto' picks from it, the calibration file
format, the node inputs that tune the policy, and how a run's ``StackCacheRun`` is made. Everything else is here once:
resolving 'auto' / a calibration file / a published entry, the per-run ``CacheSession`` (a feature of the run
lifecycle in ``nodes.features``), the Apply node (clone + ``attach_feature``) and the Calibrate node (a KSampler that
records, then saves a named file).
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

import torch
from comfy_api.latest import io

from ...omni_hooks.context import CallContext
from ...omni_hooks.stack_cache import StackCacheRun
from ...omni_hooks.stats import BranchDecision, CacheRunStats, EvaluationRecord
from . import calibration_files
from .. import families
from .. import stats_store
from ..drift import ModelDriftError
from ..families import DetectedModel, model_input
from ..features import AppliedFeature, Category, FeatureSession, FeatureSpec, attach_feature, named, register_feature
from .inputs import (cache_device_for, cache_device_input, calibration_name, calibration_sampler_inputs,
                          check_cache_device, forecast_input, sample_calibrating, validate_calibration_name)

log = logging.getLogger("OmniHooks")

AUTO = "auto"


class Recommendation(Protocol):
    """A published table entry: it names the family it fits."""

    key: str
    family: str


class CacheSettings(Protocol):
    """What an Apply node resolved at execute time (a frozen, deepcopy-safe dataclass)."""

    threshold: float
    cache_device: str
    model_label: str
    notes: tuple[str, ...]


@dataclass(frozen=True)
class CacheSpec:
    """Everything that makes one block-stack cache different from another."""

    kind: str                        # "teacache": feature kind, calibration folder, statistics kind
    apply_node_id: str
    apply_title: str
    apply_description: str
    calibrate_node_id: str
    calibrate_title: str
    calibrate_description: str
    variant_input: str               # the combo input that picks the recommendation ("model_variant", "curve")
    variant_tooltip: str
    published: Mapping[str, Recommendation]
    # (adapter) -> the published key 'auto' picks, or None; and the error text when it picks none
    auto_key: Callable[[DetectedModel], str | None]
    no_auto_fit: Callable[[DetectedModel], str]
    # (adapter, option value, file name, file contents) -> a Recommendation; ValueError for a malformed file
    from_file: Callable[[DetectedModel, str, str, dict], Recommendation]
    # (file name, file contents): ValueError naming the file when no model could use it (the variant list skips it)
    check_file: Callable[[str, dict], object]
    tuning_inputs: Callable[[], list[io.Input]]
    # (adapter, recommendation or None when calibrating, tuning inputs, auto chosen) -> settings; ValueError if bad
    make_settings: Callable[[DetectedModel, Recommendation | None, dict[str, Any], bool], CacheSettings]
    calibrate_tuning: dict[str, Any]  # the tuning inputs a calibration run uses
    # (session, diffusion model) -> the installed StackCacheRun
    build_run: Callable[["CacheSession", torch.nn.Module], StackCacheRun]
    # (run) -> what a calibrating run recorded; (recorded parts, adapter) -> the calibration file's contents
    collect_calibration: Callable[[StackCacheRun], Any]
    calibration_file: Callable[[list[Any], DetectedModel], dict]
    describe_calibration: Callable[[dict], str]
    min_calibration_steps: int
    calibration_noun: str                  # what the calibration file holds ("fitted coefficients", "curve")
    calibration_steps_tooltip: str
    calibration_sampler_tooltip: str
    calibration_output: str                # the calibrate node's string output: its name and tooltip
    calibration_output_tooltip: str


def variant_options(spec: CacheSpec) -> list[str]:
    """'auto', the published entries, and the calibration files of this cache that can be used."""
    names = calibration_files.list_names(spec.kind, validate=spec.check_file)
    return [AUTO, *spec.published, *(calibration_files.option(name) for name in names)]


def resolve(spec: CacheSpec, adapter: DetectedModel, value: str) -> Recommendation:
    """The recommendation for this model and widget value: 'auto', a calibration file or a published entry."""
    title, word = spec.apply_title, spec.variant_input
    if value == AUTO:
        key = spec.auto_key(adapter)
        if key is None:
            raise ValueError(f"{title}: {spec.no_auto_fit(adapter)}")
        return spec.published[key]
    name = calibration_files.parse_option(value)
    if name is not None:
        try:
            data = calibration_files.load(spec.kind, name)
        except ValueError as e:
            raise named(title, e) from None
        family = data.get("family", adapter.family)
        if family != adapter.family:
            raise ValueError(f"{title}: calibration {name!r} was made on a {family} model, but this MODEL is "
                             f"{adapter.describe()}. Calibrate this model, or choose another {word}.")
        return spec.from_file(adapter, value, name, data)
    found = spec.published.get(value)
    if found is None:
        raise ValueError(f"{title}: unknown {word} {value!r}; choose one from the list")
    if found.family != adapter.family:
        raise ValueError(f"{title}: {word} {value!r} is for {found.family} models, but this MODEL is "
                         f"{adapter.describe()}. Choose '{AUTO}' or a {adapter.family} {word}.")
    return found


def settings_for(spec: CacheSpec, model, inputs: dict[str, Any], calibrate: bool = False) -> CacheSettings:
    """Resolve an Apply node's inputs (all but ``model``) into its settings; ValueError naming the node."""
    adapter = families.detect_for_node(spec.apply_title, model)
    tuning = dict(inputs)
    value = tuning.pop(spec.variant_input, AUTO)
    check_cache_device(spec.apply_title, tuning["cache_device"])
    for input_name, number in tuning.items():
        if isinstance(number, float) and not math.isfinite(number):
            raise ValueError(f"{spec.apply_title}: {input_name} must be a finite number, got {number}")
    start, end = tuning["start_percent"], tuning["end_percent"]
    if not 0.0 <= start <= end <= 1.0:
        raise ValueError(f"{spec.apply_title}: start_percent ({start}) must not be above end_percent ({end})")
    recommendation = None if calibrate else resolve(spec, adapter, value)
    try:
        return spec.make_settings(adapter, recommendation, tuning, value == AUTO and not calibrate)
    except ValueError as e:
        raise named(spec.apply_title, e) from None


class CacheSession(FeatureSession):
    """One sampling run of a block-stack cache on one MODEL: installs its run's hooks, publishes its statistics."""

    def __init__(self, spec: CacheSpec, patcher, feature: AppliedFeature):
        super().__init__(patcher, feature)
        self.spec = spec
        settings: CacheSettings = feature.settings
        self.settings = settings
        self.stats = CacheRunStats(kind=spec.kind, model=settings.model_label, threshold=settings.threshold,
                                   notes=list(settings.notes))
        if feature.unverified and getattr(settings, "calibrate", False):  # a calibration must record: no fallback
            raise ModelDriftError(f"{feature.describe()}: cannot calibrate, the model could not be fully checked "
                                  f"before the run: {'; '.join(feature.unverified)}")
        if feature.unverified:  # the drift check could not verify the model: no hook, every step computed
            self.stats.disabled = ("the model could not be fully checked before the run: "
                                   + "; ".join(feature.unverified))
        self.call_started = 0.0  # of the current call, while caching is disabled
        self.adapter = families.detect(patcher)
        self.cache_device = cache_device_for(patcher, settings.cache_device)
        self.run: StackCacheRun | None = None
        self.calibration: list[Any] = []  # what each installed run recorded while calibrating
        # set by stats_store.run_started: which run, prompt and sampler node this is
        self.run_id = ""
        self.prompt_id: str | None = None
        self.sampler_node_id: str | None = None
        self.node_title: str | None = None
        self.workflow_id: str | None = None
        self.started_at: float | None = None
        stats_store.run_started(self)

    def install(self, diffusion_model: torch.nn.Module) -> None:
        if self.stats.disabled is None:
            self.run = self.spec.build_run(self, diffusion_model)

    def begin_call(self, context: CallContext) -> None:
        if self.stats.disabled is not None:
            self.call_started = time.perf_counter()
            return
        self.run.begin_call(context)

    def end_call(self, context: CallContext) -> None:
        if self.stats.disabled is not None:
            record = computed_record(context, self.settings.threshold, time.perf_counter() - self.call_started)
            self.stats.record(record)
        else:
            record = self.run.end_call() if self.run is not None else None
        if record is not None:
            stats_store.step_finished(self, record)

    def remove(self) -> None:
        run, self.run = self.run, None
        if run is not None:
            self.stats.cache_bytes = max(self.stats.cache_bytes, run.cache_bytes())
            self.calibration.append(self.spec.collect_calibration(run))  # before remove(), which clears the states
            run.remove()

    def publish(self, status: str, features: list[dict[str, Any]]) -> bool:
        extra: dict[str, Any] = {}
        if features:
            extra["features"] = features
        # a feature that ran the model on several devices says how many (the panel shows it)
        world_size = max((f["summary"].get("world_size", 1) for f in features), default=1)
        if world_size > 1:
            extra["world_size"] = world_size
        stats_store.run_finished(self, status, extra=extra or None)
        return True


def computed_record(context: CallContext, threshold: float, seconds: float) -> EvaluationRecord:
    """The record of a call computed because caching is disabled for the run (every branch: reason "disabled")."""
    labels = list(context.labels) or ["all"]
    return EvaluationRecord(step=context.step, total_steps=context.total_steps, computed=True, seconds=seconds,
                            branches=[BranchDecision(branch=label, computed=True, reason="disabled", metric=None,
                                                     threshold=threshold) for label in labels])


def _register(spec: CacheSpec) -> None:
    register_feature(FeatureSpec(kind=spec.kind, category=Category.CACHE,
                                 session_factory=lambda patcher, feature: CacheSession(spec, patcher, feature)))


def percent_window_inputs(end_note: str = "") -> list[io.Input]:
    """start_percent / end_percent, which every cache has (checked by ``settings_for``)."""
    return [
        io.Float.Input("start_percent", default=0.0, min=0.0, max=1.0, step=0.01,
                       tooltip="Caching starts at this fraction of this sampler's steps; earlier steps are always "
                       "computed (they set the composition)."),
        io.Float.Input("end_percent", default=1.0, min=0.0, max=1.0, step=0.01,
                       tooltip=f"Caching stops after this fraction of this sampler's steps; later steps are always "
                       f"computed.{end_note}"),
    ]


def _schema(node_id: str, title: str, description: str, inputs: list[io.Input], outputs: list[io.Output],
            **extra: Any) -> io.Schema:
    return io.Schema(node_id=node_id, display_name=f"{title} (OmniHooks)", category="OmniHooks",
                     description=description, inputs=inputs, outputs=outputs, hidden=[io.Hidden.unique_id], **extra)


def apply_node(spec: CacheSpec, class_name: str) -> type[io.ComfyNode]:
    """The Apply node of ``spec``: MODEL in, the same MODEL with the cache attached for its sampling runs out."""
    _register(spec)

    class ApplyCache(io.ComfyNode):
        @classmethod
        def define_schema(cls) -> io.Schema:
            inputs = [
                model_input(" Not one that already has another cache."),
                *spec.tuning_inputs(),
                cache_device_input(),
                io.Combo.Input(spec.variant_input, options=variant_options(spec), default=AUTO,
                               tooltip=spec.variant_tooltip),
                forecast_input(),  # last: a saved workflow's widget values keep their positions
            ]
            cache_name = spec.apply_title.removeprefix("Apply ")
            output = io.Model.Output(tooltip=f"The same MODEL with {cache_name} attached for its sampling runs.")
            return _schema(spec.apply_node_id, spec.apply_title, spec.apply_description, inputs, [output])

        @classmethod
        def fingerprint_inputs(cls, **inputs: Any) -> str:
            # a calibration file re-made under the same name must re-execute this node (ComfyUI caches its output)
            return calibration_files.fingerprint_option(spec.kind, inputs.get(spec.variant_input))

        @classmethod
        def execute(cls, model, **inputs: Any) -> io.NodeOutput:
            settings = settings_for(spec, model, inputs)
            feature = AppliedFeature(kind=spec.kind, category=Category.CACHE, node_title=spec.apply_title,
                                     node_id=cls.hidden.unique_id, settings=settings)
            return io.NodeOutput(attach_feature(model, feature))

    ApplyCache.__name__ = ApplyCache.__qualname__ = class_name
    return ApplyCache


def calibrate_node(spec: CacheSpec, class_name: str) -> type[io.ComfyNode]:
    """The Calibrate node of ``spec``: a KSampler that computes every step, records, and saves a named file."""
    name_tooltip = (f"File name for the {spec.calibration_noun} (letters, digits, space . _ -); saved in ComfyUI's "
                    f"user directory under omni_hooks/{spec.kind}/. An existing file of that name is replaced.")

    class CalibrateCache(io.ComfyNode):
        @classmethod
        def define_schema(cls) -> io.Schema:
            inputs = [
                *calibration_sampler_inputs(
                    spec.min_calibration_steps, steps_tooltip=spec.calibration_steps_tooltip,
                    cfg_tooltip="Classifier-free guidance scale; above 1 calibrates the cond and uncond branches.",
                    sampler_tooltip=spec.calibration_sampler_tooltip),
                io.String.Input("name", default="my-model", tooltip=name_tooltip),
            ]
            outputs = [io.Latent.Output(tooltip="The sampled latent (every step computed)."),
                       io.String.Output(display_name=spec.calibration_output, tooltip=spec.calibration_output_tooltip)]
            return _schema(spec.calibrate_node_id, spec.calibrate_title, spec.calibrate_description, inputs, outputs,
                           is_output_node=True)

        @classmethod
        def validate_inputs(cls, name: str = "") -> bool | str:
            # Only ``name``: with **kwargs ComfyUI would skip the min/max checks of every other input and repeat
            # this message once per input.
            return validate_calibration_name(spec.calibrate_title, name)

        @classmethod
        def execute(cls, model, seed: int, steps: int, cfg: float, sampler_name: str, scheduler: str, positive,
                    negative, latent_image, name: str) -> io.NodeOutput:
            name = calibration_name(spec.calibrate_title, name)
            adapter = families.detect_for_node(spec.calibrate_title, model)
            try:
                calibration_files.check_writable(spec.kind)  # before sampling, not after
            except ValueError as e:
                raise named(spec.calibrate_title, e) from None
            settings = settings_for(spec, model, dict(spec.calibrate_tuning), calibrate=True)
            feature = AppliedFeature(kind=spec.kind, category=Category.CACHE, node_title=spec.calibrate_title,
                                     node_id=cls.hidden.unique_id, settings=settings)
            latent, sessions = sample_calibrating(model, feature, seed, steps, cfg, sampler_name, scheduler,
                                                  positive, negative, latent_image)
            parts = [part for session in sessions for part in session.calibration]
            try:
                data = spec.calibration_file(parts, adapter)
            except ValueError as e:
                raise named(spec.calibrate_title, e) from None
            data["sampler"] = {"steps": steps, "cfg": cfg, "sampler_name": sampler_name, "scheduler": scheduler}
            try:
                path = calibration_files.save(spec.kind, name, data)
            except ValueError as e:  # non-finite results (a NaN cfg, a model producing NaN): the old file stays
                raise named(spec.calibrate_title, e) from None
            what = spec.describe_calibration(data)
            log.info("OmniHooks %s: %s on %s, saved to %s", spec.calibrate_title, what, adapter.describe(), path)
            return io.NodeOutput(latent, json.dumps(data, indent=1), ui={"text": [f"saved {path.name}: {what}"]})

    CalibrateCache.__name__ = CalibrateCache.__qualname__ = class_name
    return CalibrateCache
