"""MagCache as a ``BlockStackCache``: its settings, published curves, calibration file, and its two nodes (Apply
MagCache, MagCache Calibrate).

Same families, detection (``nodes.families``), run lifecycle (``nodes.features``), branch and batch handling and
per-run statistics as Apply TeaCache; one cache per MODEL (Apply TeaCache and Apply MagCache on one MODEL, in either
order, is an error naming both nodes).

Steps are the sampler's own: step t of T comes from the run's ``sample_sigmas``, so a sampler that runs only a
segment of a schedule (KSamplerAdvanced start/end, split sigmas) counts its segment from 0 and the curve is
interpolated to the segment's length. That is the Wan 2.2 A14B rule (see ``nodes/caches/magcache_curves.py``): each expert's
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
from typing import Any

import torch
from comfy_api.latest import io

from ...omni_hooks.few_step import FewStepRule
from ...omni_hooks.magcache import MagCacheConfig, MagCacheRun, MagCacheStrategy, apply_mag_cache_hook, interleave
from ...omni_hooks.magcache.interp import COND, UNCOND, branch_base, split_interleaved
from . import calibration_files
from .base import (ApplyCacheNode, BlockStackCache, CacheSession, CalibrateCacheNode, percent_window_inputs,
                   register_cache)
from .inputs import forecast_order
from ..families import DetectedModel
from .magcache_curves import PUBLISHED, MagCacheCurve, for_family

NODE_ID = "OmniHooks.ApplyMagCache"
NODE_TITLE = "Apply MagCache"
CALIBRATE_NODE_ID = "OmniHooks.MagCacheCalibrate"
CALIBRATE_TITLE = "MagCache Calibrate"
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
    forecast_order: int | str = 0


@dataclass(frozen=True)
class ResolvedCurve:
    """A curve chosen for a model: a published one or a calibration file's, per branch kind."""

    key: str
    family: str
    curves: tuple[tuple[str, tuple[float, ...]], ...]


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


def _config(settings: MagCacheSettings, cache_device: torch.device | None) -> MagCacheConfig:
    return MagCacheConfig(
        threshold=settings.threshold, max_skip_steps=settings.max_skip_steps,
        retention_ratio=settings.retention_ratio, start_percent=settings.start_percent,
        end_percent=settings.end_percent, cache_device=cache_device, calibrate=settings.calibrate,
        forecast_order=settings.forecast_order, few_step=FewStepRule(),
        mag_ratios=None if settings.calibrate else {name: list(values) for name, values in settings.curves})


def _rounded(values: list[float]) -> list[float]:
    return [round(float(v), 5) for v in values]


def calibration_data(result: dict[str, dict[str, list[float]]]) -> dict:
    """The file contents for a run's per-branch calibration result (only the first cond and uncond entries)."""
    branches = {label: lists for label, lists in result.items() if label == branch_base(label)}
    if not branches:
        raise ValueError(f"{CALIBRATE_TITLE}: the sampler made no model call that could be measured (did it run?)")
    data = {
        "kind": KIND,
        "layout": "per branch",
        "calibrated_steps": max(len(lists["ratios"]) for lists in branches.values()),
        "mag_ratios": {label: _rounded(lists["ratios"]) for label, lists in branches.items()},
        "std": {label: _rounded(lists["stds"]) for label, lists in branches.items()},
        "cos_dist": {label: _rounded(lists["cos_dists"]) for label, lists in branches.items()},
    }
    ratios = data["mag_ratios"]
    if COND in ratios and UNCOND in ratios and len(ratios[COND]) == len(ratios[UNCOND]):
        data["interleaved"] = interleave(ratios)  # [c0, u0, c1, u1, ...], the layout the MagCache scripts print
    return data


class MagCache(BlockStackCache):
    """MagCache: skips the blocks while the accumulated error of the calibrated magnitude-ratio curve stays small."""

    kind = KIND
    apply_node_id = NODE_ID
    apply_title = NODE_TITLE
    apply_description = ("Skips the transformer blocks on steps where the calibrated growth of the model's residual "
                         "(its magnitude-ratio curve) says reusing the last computed residual costs little. Detects "
                         "the model; reports every decision. Wan 2.2 A14B: put one on each expert and choose the "
                         "curve's '(high noise)' / '(low noise)' part; each uses its own sampler's steps.")
    calibrate_node_id = CALIBRATE_NODE_ID
    calibrate_title = CALIBRATE_TITLE
    calibrate_description = ("A KSampler that computes every step and records, per step and CFG branch, how the "
                             "magnitude of the transformer's residual changes from the previous step (mean ratio of "
                             "per-token norms, its spread and the cosine distance), then saves that curve under "
                             "'name'. Apply MagCache lists it as 'calibration: <name>'. Use the sampler settings you "
                             "will generate with.")
    variant_input = "curve"
    variant_tooltip = ("The magnitude-ratio curve. 'auto' picks the published one for the detected model; choose "
                       "one when the weights cannot tell (Wan I2V 720p vs 480p, Flux Kontext, Qwen-Image-Edit, Wan "
                       "2.2 A14B '(high noise)' / '(low noise)' per expert), or a 'calibration: <name>' file from "
                       "MagCache Calibrate (for models without a published curve). Interpolated to your step count; "
                       "a Wan 2.2 part to its own expert's steps (ComfyUI's Wan 2.2 template, switch at step 10 of "
                       "20, fits the parts).")
    published = PUBLISHED
    calibrate_tuning = {"threshold": 0.0, "max_skip_steps": 0, "retention_ratio": 0.0, "start_percent": 0.0,
                        "end_percent": 1.0, "cache_device": "compute device"}
    min_calibration_steps = 4
    calibration_noun = "curve"
    calibration_steps_tooltip = ("Sampling steps; the curve gets one ratio per step and branch (Apply MagCache "
                                 "interpolates it to other step counts).")
    calibration_sampler_tooltip = ("The sampler you will generate with; one that evaluates the model once per step "
                                   "(euler, ...) gives exactly one ratio per step.")
    calibration_output = "curve"
    calibration_output_tooltip = ("The recorded curve as JSON: mag_ratios, std and cos_dist per branch, and the "
                                  "CFG-interleaved list.")

    def auto_key(self, adapter: DetectedModel) -> str | None:
        key = adapter.recommendation(KIND).key
        if key is not None and adapter.recommendation(KIND).notes:
            log.info("OmniHooks %s: 'auto' chose the %r curve for %s. %s", NODE_TITLE, key, adapter.describe(),
                     " ".join(adapter.recommendation(KIND).notes))
        return key

    def no_auto_fit(self, adapter: DetectedModel) -> str:
        notes = "".join(f"{n[0].upper()}{n[1:]}. " for n in adapter.recommendation(KIND).notes)
        if not for_family(adapter.family):
            return (f"no MagCache curve is published for {adapter.describe()} models. {notes}To use MagCache, "
                    f"{CALIBRATE_HINT}.")
        return (f"no published MagCache curve fits {adapter.describe()}. {notes}Choose a {adapter.family} curve, or "
                f"{CALIBRATE_HINT}.")

    def check_file(self, name: str, data: dict) -> dict[str, list[float]]:
        """The per-branch curves of a calibration file; a clear error for a malformed one."""
        return _curves_from_file(name, data)

    def from_file(self, adapter: DetectedModel, value: str, name: str, data: dict) -> ResolvedCurve:
        curves = _curves_from_file(name, data)
        return ResolvedCurve(key=value, family=data.get("family", adapter.family),
                             curves=tuple((branch, tuple(values)) for branch, values in curves.items()))

    def tuning_inputs(self) -> list[io.Input]:
        return [
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
            *percent_window_inputs(),
        ]

    def make_settings(self, adapter: DetectedModel, found: MagCacheCurve | ResolvedCurve | None,
                      tuning: dict[str, Any], auto: bool) -> MagCacheSettings:
        calibrate = found is None
        start, end = float(tuning["start_percent"]), float(tuning["end_percent"])
        settings = MagCacheSettings(
            threshold=float(tuning["threshold"]), max_skip_steps=int(tuning["max_skip_steps"]),
            retention_ratio=float(tuning["retention_ratio"]), start_percent=start, end_percent=end,
            cache_device=tuning["cache_device"], curves=() if calibrate else found.curves,
            model_label=f"{adapter.variant}, {'calibrate' if calibrate else found.key}", calibrate=calibrate,
            notes=tuple(adapter.recommendation(KIND).notes) if auto else (), forecast_order=forecast_order(tuning))
        _config(settings, None)  # validate now, at execute time, rather than in the sampler
        return settings

    def build_run(self, session: CacheSession, diffusion_model: torch.nn.Module) -> MagCacheRun:
        adapter = session.adapter
        strategy = MagCacheStrategy(name=adapter.family, build_stack=adapter.build_stack)
        return apply_mag_cache_hook(diffusion_model, _config(session.settings, session.cache_device), strategy,
                                    session.stats, implicit_calls=False)

    def collect_calibration(self, run: MagCacheRun) -> dict[str, dict[str, list[float]]]:
        return run.get_calibration_result()

    def calibration_file(self, parts: list[dict[str, dict[str, list[float]]]], adapter: DetectedModel) -> dict:
        result: dict[str, dict[str, list[float]]] = {}
        for part in parts:
            result.update(part)
        return {"family": adapter.family, "variant": adapter.variant, **calibration_data(result)}

    def describe_calibration(self, data: dict) -> str:
        return ", ".join(f"{label} {len(values)}" for label, values in data["mag_ratios"].items()) + " ratios"


MAGCACHE = register_cache(MagCache())


class ApplyMagCache(ApplyCacheNode):
    cache = MAGCACHE


class MagCacheCalibrate(CalibrateCacheNode):
    cache = MAGCACHE


__all__ = ["ApplyMagCache", "MAGCACHE", "MagCache", "MagCacheCalibrate", "MagCacheSettings", "calibration_data"]
