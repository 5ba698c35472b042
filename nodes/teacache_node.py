"""Apply TeaCache: the node, its settings, and the per-run session that drives omni_hooks' TeaCache."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from comfy_api.latest import io

from ..omni_hooks.stats import CacheRunStats
from ..omni_hooks.teacache import CallContext, TeaCacheConfig, TeaCacheRun, apply_teacache_hook
from . import calibration_files
from .adapters import ModelAdapter, UnsupportedModelError, detect_adapter
from .coefficients import PUBLISHED, TeaCacheCoefficients, for_family
from .lifecycle import AppliedCache, CacheSession, StepInfo, attach_cache
from .node_inputs import cache_device_for, cache_device_input, check_cache_device

NODE_ID = "OmniHooks.ApplyTeaCache"
NODE_TITLE = "Apply TeaCache"
RECOMMENDED = -1.0


@dataclass(frozen=True)
class TeaCacheSettings:
    """What Apply TeaCache resolved at execute time (deepcopy-safe; travels with the MODEL clone)."""

    rel_l1_thresh: float
    start_percent: float
    end_percent: float
    cache_device: str
    coefficients: tuple[float, ...]
    signal: str
    ret_steps: int
    model_label: str
    calibrate: bool = False
    notes: tuple[str, ...] = ()  # what the user should know about the choice 'auto' made


def variant_options() -> list[str]:
    return ["auto", *PUBLISHED, *(calibration_files.option(name) for name in calibration_files.list_names("teacache"))]


def resolve_coefficients(adapter: ModelAdapter, model_variant: str) -> TeaCacheCoefficients:
    """The coefficient set for this model and widget value; a clear error when none fits."""
    if model_variant == "auto":
        found = adapter.teacache_coefficients
        if found is None:
            raise ValueError(
                f"{NODE_TITLE}: no published TeaCache coefficients fit {adapter.describe()}. "
                + " ".join(adapter.notes)
                + " Choose a model_variant, or run 'TeaCache Calibrate' on this model and choose its file.")
        return found
    name = calibration_files.parse_option(model_variant)
    if name is not None:
        try:
            data = calibration_files.load("teacache", name)
        except ValueError as e:
            raise ValueError(f"{NODE_TITLE}: {e}") from None
        if data.get("family", adapter.family) != adapter.family:
            raise ValueError(f"{NODE_TITLE}: calibration {name!r} was made on a {data['family']} model, but this "
                             f"MODEL is {adapter.describe()}. Calibrate this model, or choose another variant.")
        return _calibrated(adapter, model_variant, name, data)
    found = PUBLISHED.get(model_variant)
    if found is None:
        raise ValueError(f"{NODE_TITLE}: unknown model_variant {model_variant!r}; choose one from the list")
    if found.family != adapter.family:
        raise ValueError(f"{NODE_TITLE}: model_variant {model_variant!r} is for {found.family} models, but this MODEL "
                         f"is {adapter.describe()}. Choose 'auto' or a {adapter.family} variant.")
    return found


def _calibrated(adapter: ModelAdapter, model_variant: str, name: str, data: dict) -> TeaCacheCoefficients:
    """The coefficient set of a calibration file's contents; a clear error for a malformed file."""
    def bad(what: str) -> ValueError:
        return ValueError(f"{NODE_TITLE}: calibration {name!r} ({calibration_files.directory('teacache')}) {what}; "
                          f"run TeaCache Calibrate again, or choose another variant.")

    coefficients = data.get("coefficients")
    if (not isinstance(coefficients, list) or len(coefficients) != 5
            or not all(isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c)
                       for c in coefficients)):
        raise bad(f"has no valid 'coefficients' (5 finite numbers expected, got {str(coefficients)[:80]})")
    signal = data.get("signal", "default")
    signals = {"default", *(c.signal for c in for_family(adapter.family))}
    if signal not in signals:
        raise bad(f"has signal {str(signal)[:40]!r}, which {adapter.family} models do not have "
                  f"(one of {sorted(signals)})")
    try:
        threshold = float(data.get("recommended_threshold", 0.2))
    except (TypeError, ValueError):
        raise bad("has a 'recommended_threshold' that is not a number") from None
    return TeaCacheCoefficients(key=model_variant, family=data.get("family", adapter.family),
                                coefficients=tuple(float(c) for c in coefficients), threshold=threshold,
                                signal=signal, note=f"calibrated: {name}")


class TeaCacheSession(CacheSession):
    """One sampling run of Apply TeaCache on one MODEL."""

    def __init__(self, patcher, cache: AppliedCache):
        settings: TeaCacheSettings = cache.settings
        super().__init__(cache=cache, stats=CacheRunStats(kind="teacache", model=settings.model_label,
                                                          threshold=settings.rel_l1_thresh,
                                                          notes=list(settings.notes)))
        self.patcher = patcher
        self.adapter = detect_adapter(patcher)
        self.config = TeaCacheConfig(
            rel_l1_thresh=settings.rel_l1_thresh, coefficients=settings.coefficients, ret_steps=settings.ret_steps,
            start_percent=settings.start_percent, end_percent=settings.end_percent,
            cache_device=cache_device_for(patcher, settings.cache_device), calibrate=settings.calibrate)
        self.run: TeaCacheRun | None = None
        self.calibration_pairs: list[tuple[float, float]] = []

    def install(self, diffusion_model: torch.nn.Module) -> None:
        stack = self.adapter.build_stack(diffusion_model)
        signal = self.adapter.build_modulated_input(diffusion_model, self.cache.settings.signal)
        self.run = apply_teacache_hook(stack, self.config, signal, self.stats)

    def begin_call(self, branches: list[str], labels: list[str], step: StepInfo) -> None:
        self.run.begin_call(CallContext(branches=branches, labels=labels, step=step.step, total_steps=step.total_steps))

    def end_call(self):
        return self.run.end_call() if self.run is not None else None

    def remove(self) -> None:
        if self.run is not None:
            self.stats.cache_bytes = max(self.stats.cache_bytes, self.run.cache_bytes())
            self.calibration_pairs.extend(self.run.calibration_pairs())
            self.run.remove()
        self.installed_on = None


def settings_for(model, rel_l1_thresh: float, start_percent: float, end_percent: float, cache_device: str,
                 model_variant: str, calibrate: bool = False) -> TeaCacheSettings:
    try:
        adapter = detect_adapter(model)
    except UnsupportedModelError as e:
        raise ValueError(f"{NODE_TITLE}: {e}") from None
    if calibrate:
        coefficients = TeaCacheCoefficients(key="calibrate", family=adapter.family,
                                             coefficients=(0.0, 0.0, 0.0, 1.0, 0.0), threshold=0.0)
    else:
        coefficients = resolve_coefficients(adapter, model_variant)
    check_cache_device(NODE_TITLE, cache_device)
    if not 0.0 <= start_percent <= end_percent <= 1.0:
        raise ValueError(f"{NODE_TITLE}: start_percent ({start_percent}) must not be above end_percent ({end_percent})")
    threshold = coefficients.threshold if rel_l1_thresh == RECOMMENDED else rel_l1_thresh
    if threshold < 0:
        raise ValueError(f"{NODE_TITLE}: rel_l1_thresh must be -1 (recommended) or >= 0, got {rel_l1_thresh}")
    return TeaCacheSettings(rel_l1_thresh=threshold, start_percent=start_percent, end_percent=end_percent,
                            cache_device=cache_device, coefficients=coefficients.coefficients,
                            signal=coefficients.signal, ret_steps=coefficients.ret_steps,
                            model_label=f"{adapter.variant}, {coefficients.key}", calibrate=calibrate,
                            notes=tuple(adapter.notes) if model_variant == "auto" and not calibrate else ())


class ApplyTeaCache(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID,
            display_name=f"{NODE_TITLE} (OmniHooks)",
            category="OmniHooks",
            description=("Skips the transformer blocks on steps where the model's timestep-modulated input has barely "
                         "changed, reusing the last computed residual. Detects the model; composes with offload and "
                         "sequence parallel; reports every decision."),
            inputs=[
                io.Model.Input("model", tooltip="A diffusion-transformer MODEL (Wan, Flux, HunyuanVideo, LTXV, "
                               "Qwen-Image, Lumina2, HiDream, Chroma)."),
                io.Float.Input("rel_l1_thresh", default=RECOMMENDED, min=-1.0, max=10.0, step=0.01,
                               tooltip="How much accumulated change to tolerate before computing again. -1 = the "
                               "published recommendation for the detected model (e.g. 0.08 Wan 2.1 T2V 1.3B, 0.2 "
                               "Wan 14B, 0.4 Flux dev). 0 = never skip (output identical to no node). Higher = "
                               "faster, less faithful."),
                io.Float.Input("start_percent", default=0.0, min=0.0, max=1.0, step=0.01,
                               tooltip="Caching starts at this fraction of the steps; earlier steps are always "
                               "computed (they set the composition)."),
                io.Float.Input("end_percent", default=1.0, min=0.0, max=1.0, step=0.01,
                               tooltip="Caching stops after this fraction of the steps; later steps are always "
                               "computed. The first and last steps are always computed."),
                cache_device_input(),
                io.Combo.Input("model_variant", options=variant_options(), default="auto",
                               tooltip="Which published coefficients to use. 'auto' picks them from the model's "
                               "class and size; choose one when the weights cannot tell (Wan I2V 720p vs 480p, "
                               "retention mode, HiDream dev/fast) or pick a calibration file."),
            ],
            outputs=[io.Model.Output(tooltip="The same MODEL with TeaCache attached for its sampling runs.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model, rel_l1_thresh: float, start_percent: float, end_percent: float, cache_device: str,
                model_variant: str) -> io.NodeOutput:
        settings = settings_for(model, rel_l1_thresh, start_percent, end_percent, cache_device, model_variant)
        cache = AppliedCache(kind="teacache", node_title=NODE_TITLE, node_id=cls.hidden.unique_id, settings=settings)
        return io.NodeOutput(attach_cache(model, cache, TeaCacheSession))
