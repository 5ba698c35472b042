"""What every block-stack cache shares: the base class ``BlockStackCache`` (behaviour only), its ``CacheCalibration``,
its per-run ``CacheSession`` (a feature of the run lifecycle in ``nodes.features``) and the base classes of its two
nodes.

A cache subclass says what differs between caches: its published table and how 'auto' picks from it, how its
frozen config is built from the node's inputs and how a run's hooks are made; its ``CacheCalibration`` says what a
calibrating run records and the file it saves. Everything else is here once: resolving 'auto' / a calibration file /
a published entry, the per-run session, what the Apply node does (clone + ``attach_feature``) and what the Calibrate
node does (a KSampler that records, then saves a named file). Each node declares its own schema inline
(``define_schema``), its shared inputs from ``nodes.caches.inputs``.
"""
from __future__ import annotations

import abc
import dataclasses
import json
import logging
import time
from typing import Any, Callable, ClassVar, Mapping, Protocol

import torch
from comfy_api.latest import io

from ...omni_hooks.caching.budget import StepProfile
from ...omni_hooks.context import CallContext
from ...omni_hooks.caching.config import StackCacheConfig
from ...omni_hooks.caching.few_step import FewStepRule
from ...omni_hooks.caching.large_steps import LargeStepRule
from ...omni_hooks.caching.run import StackCacheRun
from ...omni_hooks.caching.speedup import (SKIP_CORRECTION, SpeedupTrials, TRIAL_CORRECTIONS, TRIAL_ORDERS,
                                           TRIAL_SPEEDUPS, describe as describe_speedup, psnr_db,
                                           recipe as speedup_recipe)
from ...omni_hooks.caching.stats import DISABLED, BranchDecision, CacheRunStats, EvaluationRecord
from . import calibration_files
from .compiler import CompilerDrift, CompilerLeftOut
from .. import families
from .. import stats_store
from ..families.drift import ModelDriftError
from ..families import DetectedModel
from ..features import AppliedFeature, Category, ConfigInputs, FeatureSession, FeatureSpec, attach_feature, named
from ..samplers import skip_corrected
from ..stats_store import FeatureReport
from .inputs import calibration_name, sample_calibrating, sample_with, validate_calibration_name

log = logging.getLogger("OmniHooks")

AUTO = "auto"


class PublishedEntry(Protocol):
    """A published table entry: it names the family it fits."""

    key: str
    family: str


class CacheCalibration(abc.ABC):
    """What a cache records while calibrating and the file it saves (one instance per cache, its ``calibration``)."""

    min_steps: ClassVar[int]  # the fewest sampler steps a calibration can use

    @abc.abstractmethod
    def check_file(self, name: str, data: dict) -> object:
        """ValueError naming the calibration file when no model could use it (the variant list then skips it)."""

    @abc.abstractmethod
    def from_file(self, detected: DetectedModel, value: str, name: str, data: dict) -> PublishedEntry:
        """The entry a calibration file's contents give (shaped as a published entry); ValueError for a malformed
        file."""

    @abc.abstractmethod
    def collect(self, run: StackCacheRun) -> Any:
        """What a calibrating run recorded (read before the run is removed)."""

    @abc.abstractmethod
    def file_contents(self, parts: list[Any], detected: DetectedModel) -> dict:
        """The calibration file's contents from every run's recorded part; ValueError if nothing was recorded."""

    @abc.abstractmethod
    def describe(self, data: dict) -> str:
        """A calibration file's contents in a few words (the Calibrate node's log line and UI text)."""


class BlockStackCache(abc.ABC):
    """One block-stack cache: what makes it differ from the others, as class attributes and methods to override,
    and what every cache does alike (resolving 'auto' / a calibration file / a published entry, building the Apply
    node's config, making a run's ``CacheSession``), here once. No UI text: the nodes declare their schemas.

    A cache is one instance of a subclass (``TeaCache()``), whose ``feature()`` is its module's ``FEATURE`` (listed in
    ``nodes.features.FEATURE_MODULES``); its nodes are
    ``ApplyCacheNode`` and ``CalibrateCacheNode`` subclasses that name it in their ``cache`` attribute.
    """

    kind: ClassVar[str]                    # "teacache": feature kind, calibration folder, statistics kind
    title: ClassVar[str]                   # the Apply node's title, which starts its error messages
    variant_input: ClassVar[str]           # the combo input that picks the published entry ("model_variant", "curve")
    entries: ClassVar[str]                 # what its published entries are called ("TeaCache coefficients")
    calibrate_title: ClassVar[str]         # its Calibrate node's title
    published: ClassVar[Mapping[str, PublishedEntry]]
    calibration: ClassVar[CacheCalibration]
    calibrate_inputs: ClassVar[Mapping[str, Any]]  # the Apply inputs a calibration run uses
    config_inputs: ClassVar[ConfigInputs]  # the Apply node's inputs over its config class (``inputs.CACHE_INPUTS``)

    # -- what each cache says for itself ----------------------------------------------------------------------------

    def auto_key(self, detected: DetectedModel) -> str | None:
        """The published key 'auto' picks for this model, or None (default: the family's auto choice)."""
        return detected.auto_choice(self.kind).key

    @abc.abstractmethod
    def no_auto_fit(self, detected: DetectedModel) -> str:
        """The error text when 'auto' picks nothing for this model (with ``auto_notes``)."""

    @abc.abstractmethod
    def make_config(self, detected: DetectedModel, entry: PublishedEntry | None, tuning: dict[str, Any],
                    shared: dict[str, Any]) -> StackCacheConfig:
        """The Apply node's frozen config (``entry`` None: a calibration run), built from the cache's own inputs
        (``tuning``, by config field) and the ``shared`` fields every cache has (``StackCacheConfig``'s, already
        resolved). Raises the config's own ValueError for a value it cannot use."""

    @abc.abstractmethod
    def build_run(self, session: CacheSession, diffusion_model: torch.nn.Module) -> StackCacheRun:
        """Install this cache's hooks for one run on ``diffusion_model``; the run reads ``session.config``."""

    # -- what every cache does alike --------------------------------------------------------------------------------

    def auto_sentences(self, detected: DetectedModel) -> str:
        """``auto_notes`` as sentences for an error message: each capitalised, with its full stop and a space."""
        return "".join(f"{note[0].upper()}{note[1:]}. " for note in self.auto_notes(detected) if note)

    def auto_notes(self, detected: DetectedModel) -> tuple[str, ...]:
        """What the user should know about 'auto' on this model: the family's notes for this cache, after the line
        that says to calibrate first where the family says nothing of this cache's table is published for it."""
        choice = detected.auto_choice(self.kind)
        if choice.key is not None or choice.unpublished is None:
            return choice.notes
        return (f"no {self.entries} are published for {choice.unpublished}: run {self.calibrate_title} once on this "
                "model, then choose the calibration", *choice.notes)

    def variant_options(self) -> list[str]:
        """'auto', the published entries, and the calibration files of this cache that can be used."""
        names = calibration_files.list_names(self.kind, validate=self.calibration.check_file)
        return [AUTO, *self.published, *(calibration_files.option(name) for name in names)]

    def resolve(self, detected: DetectedModel, value: str) -> PublishedEntry:
        """The entry for this model and widget value: 'auto', a calibration file or a published entry."""
        title, word = self.title, self.variant_input
        if value == AUTO:
            key = self.auto_key(detected)
            if key is None:
                raise ValueError(f"{title}: {self.no_auto_fit(detected)}")
            return self.published[key]
        name = calibration_files.parse_option(value)
        if name is not None:
            try:
                data = calibration_files.load(self.kind, name)
            except ValueError as e:
                raise named(title, e) from None
            family = data.get("family", detected.family.name)
            if family != detected.family.name:
                raise ValueError(f"{title}: calibration {name!r} was made on a {family} model, but this MODEL is "
                                 f"{detected.describe()}. Calibrate this model, or choose another {word}.")
            return self.calibration.from_file(detected, value, name, data)
        found = self.published.get(value)
        if found is None:
            raise ValueError(f"{title}: unknown {word} {value!r}; choose one from the list")
        if found.family != detected.family.name:
            raise ValueError(f"{title}: {word} {value!r} is for {found.family} models, but this MODEL is "
                             f"{detected.describe()}. Choose '{AUTO}' or a {detected.family.name} {word}.")
        return found

    def config_for(self, model, detected: DetectedModel, inputs: dict[str, Any],
                   calibrate: bool = False) -> StackCacheConfig:
        """An Apply node's one frozen config, from its inputs (all but ``model``, each set on its config field:
        ``config_inputs``) and the model as detected. The config checks every value once; its ValueError, and any
        other, names the node and its input."""
        title = self.title
        inputs = dict(inputs)
        value = inputs.pop(self.variant_input, AUTO)
        entry = None if calibrate else self.resolve(detected, value)
        auto = value == AUTO and not calibrate
        try:
            tuning = self.config_inputs.fields(inputs, model)
            shared = dict(start_percent=tuning.pop("start_percent"), end_percent=tuning.pop("end_percent"),
                          cache_device=tuning.pop("cache_device"), calibrate=calibrate,
                          few_step=FewStepRule(), large_steps=LargeStepRule(),
                          step_profile=None if calibrate else self.step_profile(value),
                          notes=self.auto_notes(detected) if auto else ())
            if tuning.get("speedup"):
                self.check_left_to_speedup(inputs, tuning["speedup"])
                trials = None if calibrate else self.speedup_trials(value)
                tuning.update(speedup_recipe(tuning["speedup"], trials))
                shared["notes"] = (*shared["notes"], describe_speedup(tuning["speedup"], trials))
            # inputs a workflow saved before them lacks: such a run keeps the config's defaults
            for optional in ("forecast_order", "forward_budget", "skip_correction", "speedup"):
                if optional in tuning:
                    shared[optional] = tuning.pop(optional)
            reference_key = detected.auto_choice(self.kind).with_reference if auto else None
            if reference_key is not None:  # e.g. Flux: a run with reference latents is Kontext
                note = (f"the conditioning carries reference latents: {self.variant_input} '{reference_key}'",)
                shared["with_reference"] = self.make_config(detected, self.published[reference_key], dict(tuning),
                                                            {**shared, "notes": note})
            return self.make_config(detected, entry, tuning, shared)
        except ValueError as e:
            raise self.config_inputs.error(title, e, inputs, model) from None

    def check_left_to_speedup(self, inputs: dict[str, Any], speedup: float) -> None:
        """ValueError naming the first of ``inputs`` that a speed-up chooses (``caching.speedup.recipe``) but the user
        set to another value than its default: at ``speedup`` above 0 it would do nothing."""
        chosen = speedup_recipe(speedup)
        for name, value in inputs.items():
            if name != "speedup" and self.config_inputs.input(name).field in chosen \
                    and value != self.config_inputs.default(name):
                raise ValueError(f"{name} {value!r} is not used at speedup {speedup:g}, which chooses it "
                                 f"({describe_speedup(speedup)}). Set speedup to 0 to use {name}, or set {name} back "
                                 f"to {self.config_inputs.default(name)!r}")

    def step_profile(self, value: str) -> StepProfile | None:
        """The step profile a calibration file holds (a forward budget places its steps by it); None for a published
        entry or a file made before calibrations recorded one."""
        return self.calibration_part(value, "step_profile", StepProfile.from_data,
                                     "run the Calibrate node again, or set forward_budget to 0")

    def speedup_trials(self, value: str) -> SpeedupTrials | None:
        """The speed-up's trial a calibration file holds (``SpeedupTrials``); None for a published entry or a file
        made without one."""
        return self.calibration_part(value, "speedup_trials", SpeedupTrials.from_data, "run the Calibrate node again")

    def calibration_part(self, value: str, key: str, parse: Callable[[Any], Any], fix: str) -> Any:
        """``parse`` of the part ``key`` of the calibration file the widget ``value`` names; None for a published
        entry or a file without that part. ValueError naming the file and the part, and saying ``fix``, for a part
        ``parse`` refuses."""
        name = calibration_files.parse_option(value)
        if name is None:
            return None
        data = calibration_files.load(self.kind, name).get(key)
        try:
            return None if data is None else parse(data)
        except ValueError as e:
            raise ValueError(f"calibration {name!r} ({calibration_files.directory(self.kind)}) has a bad "
                             f"{key!r}: {e}; {fix}") from None

    def applied(self, node_title: str, node_id: str | None, config: StackCacheConfig) -> AppliedFeature:
        """The marker a node of this cache leaves on its MODEL clone: it carries ``config`` to the run's hooks."""
        return AppliedFeature(kind=self.kind, category=Category.CACHE, node_title=node_title, node_id=node_id,
                              config=config)

    def session(self, patcher, feature: AppliedFeature, detected: DetectedModel) -> CacheSession:
        """This cache's part of one sampling run (the lifecycle's session factory for ``kind``)."""
        return CacheSession(self, patcher, feature, detected)

    def feature(self) -> FeatureSpec:
        """How the run lifecycle runs this cache: its module's ``FEATURE``."""
        return FeatureSpec(kind=self.kind, category=Category.CACHE, session_factory=self.session)


class CacheSession(FeatureSession):
    """A block-stack cache's part of one sampling run: installs its run's hooks, reports its statistics."""

    def __init__(self, cache: BlockStackCache, patcher, feature: AppliedFeature, detected: DetectedModel):
        super().__init__(patcher, feature, detected)
        self.cache = cache
        config: StackCacheConfig = feature.config
        self.config = config  # the node's own object: the run's hooks read it unchanged
        self.stats = CacheRunStats(cache.kind, config)
        if feature.unverified and config.calibrate:  # a calibration must record: no fallback
            raise ModelDriftError(f"{feature.describe()}: cannot calibrate, the model could not be fully checked "
                                  f"before the run: {'; '.join(feature.unverified)}")
        if feature.unverified:  # the drift check could not verify the model: no hook, every step computed
            self.stats.disabled = ("the model could not be fully checked before the run: "
                                   + "; ".join(feature.unverified))
        self.call_started = 0.0  # of the current call, while caching is disabled
        self.run: StackCacheRun | None = None
        self.recorded: list[Any] = []  # what each installed run recorded while calibrating
        self.profiles: list[StepProfile] = []  # ... and its step profile (for a forward budget)
        self.compiler = CompilerLeftOut()

    def after_load(self, patcher) -> None:
        try:
            note = self.compiler.leave_out(patcher.load_device)
        except CompilerDrift as e:  # a cache under the compiler is not safe: every step computed
            self.stats.disabled = self.stats.disabled or str(e)
            return
        if note is not None and note not in self.stats.host_notes:
            self.stats.host_notes.append(note)

    def close(self, status: str) -> None:
        try:
            super().close(status)
        finally:
            self.compiler.restore()

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
            record = computed_record(context, self.config.threshold, time.perf_counter() - self.call_started)
            self.stats.record(record)
        else:
            record = self.run.end_call() if self.run is not None else None
        if record is not None and self.run_header is not None:
            stats_store.step_finished(self.run_header, self.stats, record)

    def remove(self) -> None:
        run, self.run = self.run, None
        if run is not None:
            self.stats.cache_bytes = max(self.stats.cache_bytes, run.cache_bytes())
            self.recorded.append(self.cache.calibration.collect(run))  # before remove(), which clears the states
            profile = run.step_profile() if self.config.calibrate else None
            if profile is not None:
                self.profiles.append(profile)
            run.remove()

    def report(self) -> FeatureReport:
        return FeatureReport.of(self.feature, stats=self.stats)


def computed_record(context: CallContext, threshold: float, seconds: float) -> EvaluationRecord:
    """The record of a call computed because caching is disabled for the run (every branch: reason ``DISABLED``)."""
    labels = list(context.labels) or ["all"]
    return EvaluationRecord(step=context.step, total_steps=context.total_steps, computed=True, seconds=seconds,
                            branches=[BranchDecision(branch=label, computed=True, reason=DISABLED, metric=None,
                                                     threshold=threshold) for label in labels])


def latent_values(samples) -> torch.Tensor:
    """A LATENT's samples as one tensor: an audio-video latent's (ComfyUI's NestedTensor, LTX-2) streams flattened and
    joined."""
    return torch.cat([t.flatten() for t in samples.unbind()]) if getattr(samples, "is_nested", False) else samples


class ApplyCacheNode(io.ComfyNode):
    """An Apply node: MODEL in, the same MODEL with ``cache`` attached for its sampling runs out. A subclass names
    its cache, declares its schema (``define_schema``) and is the node ComfyUI registers."""

    cache: ClassVar[BlockStackCache]

    @classmethod
    def fingerprint_inputs(cls, **inputs: Any) -> str:
        # a calibration file re-made under the same name must re-execute this node (ComfyUI caches its output)
        return calibration_files.fingerprint_option(cls.cache.kind, inputs.get(cls.cache.variant_input))

    @classmethod
    def execute(cls, model, **inputs: Any) -> io.NodeOutput:
        cache = cls.cache
        config = cache.config_for(model, families.detect_for_node(cache.title, model), inputs)
        return io.NodeOutput(attach_feature(model, cache.applied(cache.title, cls.hidden.unique_id, config)))


class CalibrateCacheNode(io.ComfyNode):
    """A Calibrate node: a KSampler that computes every step with ``cache`` recording, and saves a named file. A
    subclass names its cache and its ``title``, declares its schema and is the node ComfyUI registers."""

    cache: ClassVar[BlockStackCache]
    title: ClassVar[str]

    @classmethod
    def validate_inputs(cls, name: str = "") -> bool | str:
        # Only ``name``: with **kwargs ComfyUI would skip the min/max checks of every other input and repeat this
        # message once per input.
        return validate_calibration_name(cls.title, name)

    @classmethod
    def execute(cls, model, seed: int, steps: int, cfg: float, sampler_name: str, scheduler: str, positive,
                negative, latent_image, name: str, try_speedups: bool = False) -> io.NodeOutput:
        cache, title = cls.cache, cls.title
        calibration = cache.calibration
        name = calibration_name(title, name)
        detected = families.detect_for_node(title, model)
        try:
            calibration_files.check_writable(cache.kind)  # before sampling, not after
        except ValueError as e:
            raise named(title, e) from None
        config = cache.config_for(model, detected, dict(cache.calibrate_inputs), calibrate=True)
        latent, sessions = sample_calibrating(model, cache.applied(title, cls.hidden.unique_id, config), seed,
                                              steps, cfg, sampler_name, scheduler, positive, negative, latent_image)
        parts = [part for session in sessions for part in session.recorded]
        try:
            data = calibration.file_contents(parts, detected)
        except ValueError as e:
            raise named(title, e) from None
        data["sampler"] = {"steps": steps, "cfg": cfg, "sampler_name": sampler_name, "scheduler": scheduler}
        profiles = [profile for session in sessions for profile in session.profiles]
        if profiles:  # where a forward budget places its computed steps (the last run's, if there were several)
            data["step_profile"] = profiles[-1].to_data()
        try:
            path = calibration_files.save(cache.kind, name, data)
        except ValueError as e:  # non-finite results (a NaN cfg, a model producing NaN): the old file stays
            raise named(title, e) from None
        if try_speedups:  # saved again with the trial: an interrupted trial leaves the file without one
            sampling = (seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image)
            data["speedup_trials"] = cls.try_speedups(model, detected, name, latent, sampling).to_data()
            path = calibration_files.save(cache.kind, name, data)
        what = calibration.describe(data)
        log.info("OmniHooks %s: %s on %s, saved to %s", title, what, detected.describe(), path)
        return io.NodeOutput(latent, json.dumps(data, indent=1), ui={"text": [f"saved {path.name}: {what}"]})

    @classmethod
    def try_speedups(cls, model, detected: DetectedModel, name: str, latent: dict, sampling: tuple) -> SpeedupTrials:
        """The speed-up's trial on the calibration just saved as ``name``: the Apply node's speed-up at each of
        ``TRIAL_SPEEDUPS`` with each forecast and skip correction of ``TRIAL_ORDERS`` and ``TRIAL_CORRECTIONS``
        (those with another correction than ``SKIP_CORRECTION`` only where the sampler takes one: ``skip_corrected``),
        sampled on the calibration's own inputs (``sampling``), each latent's PSNR against the calibration's
        ``latent`` (every step computed)."""
        cache = cls.cache
        chosen = speedup_recipe(TRIAL_SPEEDUPS[0])  # the fields a speed-up sets: their inputs stay out
        inputs = {name: value for name, value in cache.calibrate_inputs.items()
                  if cache.config_inputs.input(name).field not in chosen}
        inputs[cache.variant_input] = calibration_files.option(name)
        # without a correction to drop (a sampler it does not reach) a pair differing only in it is the same run
        corrected = skip_corrected(sampling[3], model.get_model_object("model_sampling"))
        pairs = [(o, c) for o, c in zip(TRIAL_ORDERS, TRIAL_CORRECTIONS) if corrected or c == SKIP_CORRECTION]
        rows = []
        for speedup in TRIAL_SPEEDUPS:
            config = cache.config_for(model, detected, {**inputs, "speedup": speedup})
            row = []
            for order, correction in pairs:
                tried = dataclasses.replace(config, forecast_order=order, skip_correction=correction)
                got = sample_with(model, cache.applied(cls.title, cls.hidden.unique_id, tried), *sampling)
                row.append(psnr_db(latent_values(got["samples"]), latent_values(latent["samples"])))
            rows.append(tuple(row))
        orders, corrections = zip(*pairs)
        return SpeedupTrials(sampling[1], TRIAL_SPEEDUPS, orders, tuple(rows), corrections)
