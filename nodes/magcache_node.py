"""Apply MagCache: the node, its settings, and the per-run session that drives omni_hooks' MagCache.

Same families, detection (``nodes.adapters``), run lifecycle (``nodes.lifecycle``), branch and batch handling and
per-run statistics as Apply TeaCache; one cache per MODEL (Apply TeaCache and Apply MagCache on one MODEL, in either
order, is an error naming both nodes).

Steps are the sampler's own: step t of T comes from the run's ``sample_sigmas``, so a sampler that runs only a
segment of a schedule (KSamplerAdvanced start/end, split sigmas) counts its segment from 0 and the curve is
interpolated to the segment's length. That is the Wan 2.2 A14B rule (see ``nodes/magcache_curves.py``): each expert's
Apply MagCache takes its own part of the official curve, "(high noise)" or "(low noise)", and applies retention and
start/end to its own steps.

ComfyUI's own Wan 2.2 14B T2V template (20 steps, shift 8, KSamplerAdvanced 0-10 on the high-noise model, 10-end on
the low-noise one) fits that rule: its switch falls at the same noise level as the official 40-step calibration's
(boundary sigma 0.875: the template's low-noise expert starts at sigma 0.889, the calibration's at 0.866, step 26 of
40 with shift 12), so "(high noise)" (official steps 0-25) is resampled onto the high-noise expert's 10 steps and
"(low noise)" (steps 26-39) onto the low-noise expert's 10; the I2V template (shift 8, switch at 10 of 20, sigma
0.889 vs the I2V boundary 0.900) fits as well. As with any step count other than the calibrated one, nearest
interpolation keeps the per-step ratios of the finer calibration: with fewer steps per phase the accumulated error is
underestimated and more steps may be skipped than the threshold suggests (a lower threshold compensates).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from comfy_api.latest import io

from ..omni_hooks.magcache import CallContext, MagCacheConfig, MagCacheRun, MagCacheStrategy, apply_mag_cache_hook
from ..omni_hooks.magcache.interp import split_interleaved
from ..omni_hooks.stats import CacheRunStats
from . import calibration_files
from .adapters import ModelAdapter, UnsupportedModelError, detect_adapter
from .lifecycle import AppliedCache, CacheSession, StepInfo, attach_cache
from .magcache_curves import PUBLISHED, MagCacheCurve, for_family
from .node_inputs import cache_device_for, cache_device_input, check_cache_device

NODE_ID = "OmniHooks.ApplyMagCache"
NODE_TITLE = "Apply MagCache"
KIND = "magcache"
log = logging.getLogger("OmniHooks")


@dataclass(frozen=True)
class MagCacheSettings:
    """What Apply MagCache resolved at execute time (deepcopy-safe; travels with the MODEL clone)."""

    threshold: float
    max_skip_steps: int
    retention_ratio: float
    start_percent: float
    end_percent: float
    cache_device: str
    curves: tuple[tuple[str, tuple[float, ...]], ...]   # per branch kind ("default", "cond", "uncond")
    model_label: str
    calibrate: bool = False
    notes: tuple[str, ...] = ()  # what the user should know about the choice 'auto' made


def curve_options() -> list[str]:
    return ["auto", *PUBLISHED, *(calibration_files.option(name) for name in calibration_files.list_names(KIND))]


CALIBRATE_HINT = ("run 'MagCache Calibrate' once on this model (with the sampler settings you generate with) and "
                  "choose its calibration file as the curve")


def _curves_from_file(name: str, data: dict) -> dict[str, list[float]]:
    """The per-branch curves of a calibration file; a clear error for a malformed one."""
    def bad(what: str) -> ValueError:
        return ValueError(f"{NODE_TITLE}: calibration {name!r} ({calibration_files.directory(KIND)}) {what}; run "
                          f"MagCache Calibrate again, or choose another curve.")

    def numbers(values, where: str) -> list[float]:
        if (not isinstance(values, list) or not values
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                           for v in values)):
            raise bad(f"has no valid {where} (a non-empty list of finite non-negative numbers expected, got "
                      f"{str(values)[:80]})")
        return [float(v) for v in values]

    ratios = data.get("mag_ratios")
    if isinstance(ratios, dict):
        curves = {str(k): numbers(v, f"'mag_ratios.{k}'") for k, v in ratios.items()}
        if not curves:
            raise bad("has an empty 'mag_ratios'")
        return curves
    values = numbers(ratios, "'mag_ratios'")
    if data.get("layout") == "interleaved":
        if len(values) % 2:
            raise bad("has an interleaved 'mag_ratios' of odd length")
        return split_interleaved(values)
    return {"default": values}


def resolve_curve(adapter: ModelAdapter, curve: str) -> tuple[str, dict[str, list[float]]]:
    """(label, per-branch curves) for this model and widget value; a clear error when none fits."""
    if curve == "auto":
        key = adapter.magcache_key
        if key is None:
            notes = "".join(f"{n[0].upper()}{n[1:]}. " for n in adapter.magcache_notes)
            if not for_family(adapter.family):
                raise ValueError(f"{NODE_TITLE}: no MagCache curve is published for {adapter.describe()} models. "
                                 f"{notes}To use MagCache, {CALIBRATE_HINT}.")
            raise ValueError(f"{NODE_TITLE}: no published MagCache curve fits {adapter.describe()}. {notes}"
                             f"Choose a {adapter.family} curve, or {CALIBRATE_HINT}.")
        found = PUBLISHED[key]
        if adapter.magcache_notes:
            log.info("OmniHooks %s: 'auto' chose the %r curve for %s. %s", NODE_TITLE, key, adapter.describe(),
                     " ".join(adapter.magcache_notes))
        return key, {name: list(values) for name, values in found.curves}
    name = calibration_files.parse_option(curve)
    if name is not None:
        try:
            data = calibration_files.load(KIND, name)
        except ValueError as e:
            raise ValueError(f"{NODE_TITLE}: {e}") from None
        family = data.get("family", adapter.family)
        if family != adapter.family:
            raise ValueError(f"{NODE_TITLE}: calibration {name!r} was made on a {family} model, but this MODEL is "
                             f"{adapter.describe()}. Calibrate this model, or choose another curve.")
        return curve, _curves_from_file(name, data)
    found: MagCacheCurve | None = PUBLISHED.get(curve)
    if found is None:
        raise ValueError(f"{NODE_TITLE}: unknown curve {curve!r}; choose one from the list")
    if found.family != adapter.family:
        raise ValueError(f"{NODE_TITLE}: curve {curve!r} is for {found.family} models, but this MODEL is "
                         f"{adapter.describe()}. Choose 'auto' or a {adapter.family} curve.")
    return curve, {name: list(values) for name, values in found.curves}


def settings_for(model, threshold: float, max_skip_steps: int, retention_ratio: float, start_percent: float,
                 end_percent: float, cache_device: str, curve: str, calibrate: bool = False) -> MagCacheSettings:
    try:
        adapter = detect_adapter(model)
    except UnsupportedModelError as e:
        raise ValueError(f"{NODE_TITLE}: {e}") from None
    if calibrate:
        label, curves = "calibrate", {}
    else:
        label, curves = resolve_curve(adapter, curve)
    check_cache_device(NODE_TITLE, cache_device)
    if not 0.0 <= start_percent <= end_percent <= 1.0:
        raise ValueError(f"{NODE_TITLE}: start_percent ({start_percent}) must not be above end_percent ({end_percent})")
    settings = MagCacheSettings(
        threshold=float(threshold), max_skip_steps=int(max_skip_steps), retention_ratio=float(retention_ratio),
        start_percent=float(start_percent), end_percent=float(end_percent), cache_device=cache_device,
        curves=tuple((name, tuple(values)) for name, values in curves.items()),
        model_label=f"{adapter.variant}, {label}", calibrate=calibrate,
        notes=tuple(adapter.magcache_notes) if curve == "auto" and not calibrate else ())
    try:
        _config(settings, None)  # validate now, at execute time, rather than in the sampler
    except ValueError as e:
        raise ValueError(f"{NODE_TITLE}: {e}") from None
    return settings


def _config(settings: MagCacheSettings, cache_device: torch.device | None) -> MagCacheConfig:
    return MagCacheConfig(
        threshold=settings.threshold, max_skip_steps=settings.max_skip_steps,
        retention_ratio=settings.retention_ratio, start_percent=settings.start_percent,
        end_percent=settings.end_percent, cache_device=cache_device, calibrate=settings.calibrate,
        mag_ratios=None if settings.calibrate else {name: list(values) for name, values in settings.curves})


class MagCacheSession(CacheSession):
    """One sampling run of Apply MagCache (or MagCache Calibrate) on one MODEL."""

    def __init__(self, patcher, cache: AppliedCache):
        settings: MagCacheSettings = cache.settings
        super().__init__(cache=cache, stats=CacheRunStats(kind=KIND, model=settings.model_label,
                                                          threshold=settings.threshold,
                                                          notes=list(settings.notes)))
        self.patcher = patcher
        self.adapter = detect_adapter(patcher)
        self.config = _config(settings, cache_device_for(patcher, settings.cache_device))
        self.run: MagCacheRun | None = None
        self.calibration: dict[str, dict[str, list[float]]] = {}

    def install(self, diffusion_model: torch.nn.Module) -> None:
        strategy = MagCacheStrategy(name=self.adapter.family, build_stack=self.adapter.build_stack)
        self.run = apply_mag_cache_hook(diffusion_model, self.config, strategy, self.stats, implicit_calls=False)

    def begin_call(self, branches: list[str], labels: list[str], step: StepInfo) -> None:
        self.run.begin_call(CallContext(branches=branches, labels=labels, step=step.step, total_steps=step.total_steps))

    def end_call(self):
        return self.run.end_call() if self.run is not None else None

    def remove(self) -> None:
        if self.run is not None:
            self.stats.cache_bytes = max(self.stats.cache_bytes, self.run.cache_bytes())
            self.run.remove()
            self.calibration.update(self.run.get_calibration_result())
        self.installed_on = None


class ApplyMagCache(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID,
            display_name=f"{NODE_TITLE} (OmniHooks)",
            category="OmniHooks",
            description=("Skips the transformer blocks on steps where the calibrated growth of the model's residual "
                         "(its magnitude-ratio curve) says reusing the last computed residual costs little. Detects "
                         "the model; reports every decision. Wan 2.2 A14B: put one on each expert and choose the "
                         "curve's '(high noise)' / '(low noise)' part; each uses its own sampler's steps."),
            inputs=[
                io.Model.Input("model", tooltip="A diffusion-transformer MODEL (Wan, Flux, HunyuanVideo, LTXV, "
                               "Qwen-Image, Lumina2, HiDream, Chroma). Not one that already has Apply TeaCache."),
                io.Float.Input("threshold", default=0.06, min=0.0, max=1.0, step=0.01,
                               tooltip="How much accumulated error to tolerate before computing again (the sum of "
                               "|1 - product of ratios| since the last computed step). 0 = never skip (output "
                               "identical to no node). 0.06 is the safe default; 0.12-0.24 is faster and less "
                               "faithful."),
                io.Int.Input("max_skip_steps", display_name="K (max consecutive skips)", default=2, min=0, max=20,
                             tooltip="K: at most this many steps in a row reuse the residual before one is computed. "
                             "0 = never skip. 2-4 is typical (the MagCache scripts use 2-6)."),
                io.Float.Input("retention_ratio", default=0.2, min=0.0, max=1.0, step=0.01,
                               tooltip="This fraction of the first steps is always computed (they set the "
                               "composition). Counted on this sampler's own steps, so for a Wan 2.2 expert it "
                               "is per phase."),
                io.Float.Input("start_percent", default=0.0, min=0.0, max=1.0, step=0.01,
                               tooltip="Caching starts at this fraction of this sampler's steps; earlier steps are "
                               "always computed."),
                io.Float.Input("end_percent", default=1.0, min=0.0, max=1.0, step=0.01,
                               tooltip="Caching stops after this fraction of this sampler's steps; later steps are "
                               "always computed."),
                cache_device_input(),
                io.Combo.Input("curve", options=curve_options(), default="auto",
                               tooltip="The magnitude-ratio curve. 'auto' picks the published one for the detected "
                               "model; choose one when the weights cannot tell (Wan I2V 720p vs 480p, Flux Kontext, "
                               "Qwen-Image-Edit, Wan 2.2 A14B '(high noise)' / '(low noise)' per expert), or a "
                               "'calibration: <name>' file from MagCache Calibrate (for models without a "
                               "published curve). Interpolated to your step count; a Wan 2.2 part to its own expert's "
                               "steps (ComfyUI's Wan 2.2 template, switch at step 10 of 20, fits the parts)."),
            ],
            outputs=[io.Model.Output(tooltip="The same MODEL with MagCache attached for its sampling runs.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model, threshold: float, max_skip_steps: int, retention_ratio: float, start_percent: float,
                end_percent: float, cache_device: str, curve: str) -> io.NodeOutput:
        settings = settings_for(model, threshold, max_skip_steps, retention_ratio, start_percent, end_percent,
                                cache_device, curve)
        cache = AppliedCache(kind=KIND, node_title=NODE_TITLE, node_id=cls.hidden.unique_id, settings=settings)
        return io.NodeOutput(attach_cache(model, cache, MagCacheSession))


__all__ = ["ApplyMagCache", "MagCacheSession", "MagCacheSettings", "curve_options", "resolve_curve", "settings_for"]
