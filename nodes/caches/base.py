"""What every block-stack cache shares: the base class ``BlockStackCache``, its per-run ``CacheSession`` (a feature
of the run lifecycle in ``nodes.features``) and the base classes of its two nodes.

A cache subclass says what differs between caches (class attributes and methods): the published table and how
'auto' picks from it, the calibration file format, the node inputs that tune the policy, and how a run's
``StackCacheRun`` is made. Everything else is here once: resolving 'auto' / a calibration file / a published entry,
the per-run session, the Apply node (clone + ``attach_feature``) and the Calibrate node (a KSampler that records,
then saves a named file). A new cache is a module with a subclass, its table, ``register_cache(Subclass())`` and two
node classes (``class ApplyX(ApplyCacheNode): cache = X``).
"""
from __future__ import annotations

import abc
import json
import logging
import math
import time
from typing import Any, ClassVar, Mapping, Protocol

import torch
from comfy_api.latest import io

from ...omni_hooks.context import CallContext
from ...omni_hooks.stack_cache import StackCacheRun
from ...omni_hooks.stats import BranchDecision, CacheRunStats, EvaluationRecord
from . import calibration_files
from .. import families
from .. import stats_store
from ..families.drift import ModelDriftError
from ..families import DetectedModel, model_input
from ..features import AppliedFeature, Category, FeatureSession, FeatureSpec, attach_feature, named, register_feature
from ..stats_store import FeatureReport
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


class BlockStackCache(abc.ABC):
    """One block-stack cache: what makes it differ from the others, as class attributes and methods to override,
    and what every cache does alike (resolving 'auto' / a calibration file / a published entry, validating the Apply
    node's inputs, making a run's ``CacheSession``), here once.

    A cache is one instance of a subclass (``TeaCache()``), registered with ``register_cache``; its nodes are
    ``ApplyCacheNode`` and ``CalibrateCacheNode`` subclasses that name it in their ``cache`` attribute.
    """

    kind: ClassVar[str]                    # "teacache": feature kind, calibration folder, statistics kind
    apply_node_id: ClassVar[str]
    apply_title: ClassVar[str]
    apply_description: ClassVar[str]
    calibrate_node_id: ClassVar[str]
    calibrate_title: ClassVar[str]
    calibrate_description: ClassVar[str]
    variant_input: ClassVar[str]           # the combo input that picks the recommendation ("model_variant", "curve")
    variant_tooltip: ClassVar[str]
    published: ClassVar[Mapping[str, Recommendation]]
    calibrate_tuning: ClassVar[Mapping[str, Any]]  # the tuning inputs a calibration run uses
    min_calibration_steps: ClassVar[int]
    calibration_noun: ClassVar[str]        # what the calibration file holds ("fitted coefficients", "curve")
    calibration_steps_tooltip: ClassVar[str]
    calibration_sampler_tooltip: ClassVar[str]
    calibration_output: ClassVar[str]      # the calibrate node's string output: its name and tooltip
    calibration_output_tooltip: ClassVar[str]

    # -- what each cache says for itself ----------------------------------------------------------------------------

    def auto_key(self, adapter: DetectedModel) -> str | None:
        """The published key 'auto' picks for this model, or None (default: the family data's recommendation)."""
        return adapter.recommendation(self.kind).key

    @abc.abstractmethod
    def no_auto_fit(self, adapter: DetectedModel) -> str:
        """The error text when 'auto' picks nothing for this model."""

    @abc.abstractmethod
    def check_file(self, name: str, data: dict) -> object:
        """ValueError naming the calibration file when no model could use it (the variant list then skips it)."""

    @abc.abstractmethod
    def from_file(self, adapter: DetectedModel, value: str, name: str, data: dict) -> Recommendation:
        """The recommendation a calibration file's contents give; ValueError for a malformed file."""

    @abc.abstractmethod
    def tuning_inputs(self) -> list[io.Input]:
        """The Apply node's inputs that tune the policy (between ``model`` and ``cache_device``)."""

    @abc.abstractmethod
    def make_settings(self, adapter: DetectedModel, recommendation: Recommendation | None, tuning: dict[str, Any],
                      auto: bool) -> CacheSettings:
        """The Apply node's settings (``recommendation`` None: a calibration run); ValueError if they are bad."""

    @abc.abstractmethod
    def build_run(self, session: CacheSession, diffusion_model: torch.nn.Module) -> StackCacheRun:
        """Install this cache's hooks for one run on ``diffusion_model``."""

    @abc.abstractmethod
    def collect_calibration(self, run: StackCacheRun) -> Any:
        """What a calibrating run recorded (read before the run is removed)."""

    @abc.abstractmethod
    def calibration_file(self, parts: list[Any], adapter: DetectedModel) -> dict:
        """The calibration file's contents from every run's recorded part; ValueError if nothing was recorded."""

    @abc.abstractmethod
    def describe_calibration(self, data: dict) -> str:
        """A calibration file's contents in a few words (the Calibrate node's log line and UI text)."""

    # -- what every cache does alike --------------------------------------------------------------------------------

    def variant_options(self) -> list[str]:
        """'auto', the published entries, and the calibration files of this cache that can be used."""
        names = calibration_files.list_names(self.kind, validate=self.check_file)
        return [AUTO, *self.published, *(calibration_files.option(name) for name in names)]

    def resolve(self, adapter: DetectedModel, value: str) -> Recommendation:
        """The recommendation for this model and widget value: 'auto', a calibration file or a published entry."""
        title, word = self.apply_title, self.variant_input
        if value == AUTO:
            key = self.auto_key(adapter)
            if key is None:
                raise ValueError(f"{title}: {self.no_auto_fit(adapter)}")
            return self.published[key]
        name = calibration_files.parse_option(value)
        if name is not None:
            try:
                data = calibration_files.load(self.kind, name)
            except ValueError as e:
                raise named(title, e) from None
            family = data.get("family", adapter.family)
            if family != adapter.family:
                raise ValueError(f"{title}: calibration {name!r} was made on a {family} model, but this MODEL is "
                                 f"{adapter.describe()}. Calibrate this model, or choose another {word}.")
            return self.from_file(adapter, value, name, data)
        found = self.published.get(value)
        if found is None:
            raise ValueError(f"{title}: unknown {word} {value!r}; choose one from the list")
        if found.family != adapter.family:
            raise ValueError(f"{title}: {word} {value!r} is for {found.family} models, but this MODEL is "
                             f"{adapter.describe()}. Choose '{AUTO}' or a {adapter.family} {word}.")
        return found

    def settings_for(self, model, inputs: dict[str, Any], calibrate: bool = False) -> CacheSettings:
        """Resolve an Apply node's inputs (all but ``model``) into its settings; ValueError naming the node."""
        title = self.apply_title
        adapter = families.detect_for_node(title, model)
        tuning = dict(inputs)
        value = tuning.pop(self.variant_input, AUTO)
        check_cache_device(title, tuning["cache_device"])
        for input_name, number in tuning.items():
            if isinstance(number, float) and not math.isfinite(number):
                raise ValueError(f"{title}: {input_name} must be a finite number, got {number}")
        start, end = tuning["start_percent"], tuning["end_percent"]
        if not 0.0 <= start <= end <= 1.0:
            raise ValueError(f"{title}: start_percent ({start}) must not be above end_percent ({end})")
        recommendation = None if calibrate else self.resolve(adapter, value)
        try:
            return self.make_settings(adapter, recommendation, tuning, value == AUTO and not calibrate)
        except ValueError as e:
            raise named(title, e) from None

    def applied(self, node_title: str, node_id: str | None, settings: CacheSettings) -> AppliedFeature:
        """The marker a node of this cache leaves on its MODEL clone."""
        return AppliedFeature(kind=self.kind, category=Category.CACHE, node_title=node_title, node_id=node_id,
                              settings=settings)

    def session(self, patcher, feature: AppliedFeature) -> CacheSession:
        """One sampling run of this cache (the lifecycle's session factory for ``kind``)."""
        return CacheSession(self, patcher, feature)


def register_cache(cache: BlockStackCache) -> BlockStackCache:
    """Make ``cache`` a feature of the run lifecycle (once per kind, at import); returns it."""
    register_feature(FeatureSpec(kind=cache.kind, category=Category.CACHE, session_factory=cache.session))
    return cache


class CacheSession(FeatureSession):
    """One sampling run of a block-stack cache on one MODEL: installs its run's hooks, reports its statistics."""

    def __init__(self, cache: BlockStackCache, patcher, feature: AppliedFeature):
        super().__init__(patcher, feature)
        self.cache = cache
        settings: CacheSettings = feature.settings
        self.settings = settings
        self.stats = CacheRunStats(kind=cache.kind, model=settings.model_label, threshold=settings.threshold,
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

    def install(self, diffusion_model: torch.nn.Module) -> None:
        if self.stats.disabled is None:
            self.run = self.cache.build_run(self, diffusion_model)

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
        if record is not None and self.run_header is not None:
            stats_store.step_finished(self.run_header, self.stats, record)

    def remove(self) -> None:
        run, self.run = self.run, None
        if run is not None:
            self.stats.cache_bytes = max(self.stats.cache_bytes, run.cache_bytes())
            self.calibration.append(self.cache.collect_calibration(run))  # before remove(), which clears the states
            run.remove()

    def report(self) -> FeatureReport:
        return FeatureReport.of(self.feature, stats=self.stats)


def computed_record(context: CallContext, threshold: float, seconds: float) -> EvaluationRecord:
    """The record of a call computed because caching is disabled for the run (every branch: reason "disabled")."""
    labels = list(context.labels) or ["all"]
    return EvaluationRecord(step=context.step, total_steps=context.total_steps, computed=True, seconds=seconds,
                            branches=[BranchDecision(branch=label, computed=True, reason="disabled", metric=None,
                                                     threshold=threshold) for label in labels])


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


class ApplyCacheNode(io.ComfyNode):
    """An Apply node: MODEL in, the same MODEL with ``cache`` attached for its sampling runs out. A subclass names
    its cache and is the node ComfyUI registers."""

    cache: ClassVar[BlockStackCache]

    @classmethod
    def define_schema(cls) -> io.Schema:
        cache = cls.cache
        inputs = [
            model_input(" Not one that already has another cache."),
            *cache.tuning_inputs(),
            cache_device_input(),
            io.Combo.Input(cache.variant_input, options=cache.variant_options(), default=AUTO,
                           tooltip=cache.variant_tooltip),
            forecast_input(),  # last: a saved workflow's widget values keep their positions
        ]
        cache_name = cache.apply_title.removeprefix("Apply ")
        output = io.Model.Output(tooltip=f"The same MODEL with {cache_name} attached for its sampling runs.")
        return _schema(cache.apply_node_id, cache.apply_title, cache.apply_description, inputs, [output])

    @classmethod
    def fingerprint_inputs(cls, **inputs: Any) -> str:
        # a calibration file re-made under the same name must re-execute this node (ComfyUI caches its output)
        return calibration_files.fingerprint_option(cls.cache.kind, inputs.get(cls.cache.variant_input))

    @classmethod
    def execute(cls, model, **inputs: Any) -> io.NodeOutput:
        cache = cls.cache
        settings = cache.settings_for(model, inputs)
        return io.NodeOutput(attach_feature(model, cache.applied(cache.apply_title, cls.hidden.unique_id, settings)))


class CalibrateCacheNode(io.ComfyNode):
    """A Calibrate node: a KSampler that computes every step with ``cache`` recording, and saves a named file. A
    subclass names its cache and is the node ComfyUI registers."""

    cache: ClassVar[BlockStackCache]

    @classmethod
    def define_schema(cls) -> io.Schema:
        cache = cls.cache
        name_tooltip = (f"File name for the {cache.calibration_noun} (letters, digits, space . _ -); saved in "
                        f"ComfyUI's user directory under omni_hooks/{cache.kind}/. An existing file of that name is "
                        f"replaced.")
        inputs = [
            *calibration_sampler_inputs(
                cache.min_calibration_steps, steps_tooltip=cache.calibration_steps_tooltip,
                cfg_tooltip="Classifier-free guidance scale; above 1 calibrates the cond and uncond branches.",
                sampler_tooltip=cache.calibration_sampler_tooltip),
            io.String.Input("name", default="my-model", tooltip=name_tooltip),
        ]
        outputs = [io.Latent.Output(tooltip="The sampled latent (every step computed)."),
                   io.String.Output(display_name=cache.calibration_output, tooltip=cache.calibration_output_tooltip)]
        return _schema(cache.calibrate_node_id, cache.calibrate_title, cache.calibrate_description, inputs, outputs,
                       is_output_node=True)

    @classmethod
    def validate_inputs(cls, name: str = "") -> bool | str:
        # Only ``name``: with **kwargs ComfyUI would skip the min/max checks of every other input and repeat this
        # message once per input.
        return validate_calibration_name(cls.cache.calibrate_title, name)

    @classmethod
    def execute(cls, model, seed: int, steps: int, cfg: float, sampler_name: str, scheduler: str, positive,
                negative, latent_image, name: str) -> io.NodeOutput:
        cache, title = cls.cache, cls.cache.calibrate_title
        name = calibration_name(title, name)
        adapter = families.detect_for_node(title, model)
        try:
            calibration_files.check_writable(cache.kind)  # before sampling, not after
        except ValueError as e:
            raise named(title, e) from None
        settings = cache.settings_for(model, dict(cache.calibrate_tuning), calibrate=True)
        latent, sessions = sample_calibrating(model, cache.applied(title, cls.hidden.unique_id, settings), seed,
                                              steps, cfg, sampler_name, scheduler, positive, negative, latent_image)
        parts = [part for session in sessions for part in session.calibration]
        try:
            data = cache.calibration_file(parts, adapter)
        except ValueError as e:
            raise named(title, e) from None
        data["sampler"] = {"steps": steps, "cfg": cfg, "sampler_name": sampler_name, "scheduler": scheduler}
        try:
            path = calibration_files.save(cache.kind, name, data)
        except ValueError as e:  # non-finite results (a NaN cfg, a model producing NaN): the old file stays
            raise named(title, e) from None
        what = cache.describe_calibration(data)
        log.info("OmniHooks %s: %s on %s, saved to %s", title, what, adapter.describe(), path)
        return io.NodeOutput(latent, json.dumps(data, indent=1), ui={"text": [f"saved {path.name}: {what}"]})
