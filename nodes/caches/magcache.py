"""MagCache as a ``BlockStackCache``: its config, published curves, calibration file, and its two nodes (Apply
MagCache, MagCache Calibrate), each declaring its schema.

Same families, detection (``nodes.families``), run lifecycle (``nodes.features``), branch and batch handling and
per-run statistics as Apply TeaCache; one cache per MODEL (Apply TeaCache and Apply MagCache on one MODEL, in either
order, is an error naming both nodes).

Steps are the sampler's own: step t of T comes from the run's ``sample_sigmas``, so a sampler that runs only a
segment of a schedule (KSamplerAdvanced start/end, split sigmas) counts its segment from 0 and the curve is
interpolated to the segment's length. That is the Wan 2.2 A14B rule (see ``nodes/caches/magcache_curves.py``): each
expert's Apply MagCache takes its own part of the official curve, "(high noise)" or "(low noise)", and applies retention
and start/end to its own steps.

ComfyUI's own Wan 2.2 14B T2V template (20 steps, shift 5 since comfyui-workflow-templates 0.11, 8 before;
KSamplerAdvanced 0-10 on the high-noise model, 10-end on the low-noise one) fits that rule: its switch falls near the
noise level of the official 40-step calibration's (boundary sigma 0.875: the template's low-noise expert starts at
sigma 0.833 with shift 5, 0.889 with shift 8; the calibration's at 0.866, step 26 of 40 with shift 12), so
"(high noise)" (official steps 0-25) is resampled onto the high-noise expert's 10 steps and "(low noise)" (steps
26-39) onto the low-noise expert's 10; the I2V template (shift 8, switch at 10 of 20, sigma
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

from ...omni_hooks.magcache import MagCacheConfig, MagCacheRun, apply_mag_cache_hook, interleave
from ...omni_hooks.magcache.interp import COND, UNCOND, branch_base, split_interleaved
from . import calibration_files
from .base import AUTO, ApplyCacheNode, BlockStackCache, CacheCalibration, CacheSession, CalibrateCacheNode
from .inputs import (cache_device_input, cache_model_input, calibration_name_input, calibration_sampler_inputs,
                     CACHE_INPUTS, forecast_input, forward_budget_input, skip_correction_input, speedup_input,
                     speedup_trial_input, window_inputs)
from ..features import CATEGORY, ConfigInputs, display_name
from ..families import DetectedModel
from .magcache_curves import PUBLISHED, MagCacheCurve, for_family

NODE_ID = "OmniHooks.ApplyMagCache"
NODE_TITLE = "Apply MagCache"
CALIBRATE_NODE_ID = "OmniHooks.MagCacheCalibrate"
CALIBRATE_TITLE = "MagCache Calibrate"
KIND = "magcache"
log = logging.getLogger("OmniHooks")


@dataclass(frozen=True)
class ResolvedCurve:
    """A curve chosen for a model: a published one or a calibration file's, per branch kind."""

    key: str
    family: str
    curves: tuple[tuple[str, tuple[float, ...]], ...]
    note: str = ""


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


class MagCacheCalibration(CacheCalibration):
    """MagCache's calibration: the magnitude-ratio curve per step and branch, saved as a file."""

    min_steps = 4

    def check_file(self, name: str, data: dict) -> dict[str, list[float]]:
        """The per-branch curves of a calibration file; a clear error for a malformed one."""
        return _curves_from_file(name, data)

    def from_file(self, detected: DetectedModel, value: str, name: str, data: dict) -> ResolvedCurve:
        curves = _curves_from_file(name, data)
        return ResolvedCurve(key=value, family=data.get("family", detected.family.name),
                             curves=tuple((branch, tuple(values)) for branch, values in curves.items()))

    def collect(self, run: MagCacheRun) -> dict[str, dict[str, list[float]]]:
        return run.get_calibration_result()

    def file_contents(self, parts: list[dict[str, dict[str, list[float]]]], detected: DetectedModel) -> dict:
        result: dict[str, dict[str, list[float]]] = {}
        for part in parts:
            result.update(part)
        return {"family": detected.family.name, "variant": detected.variant, **calibration_data(result)}

    def describe(self, data: dict) -> str:
        return ", ".join(f"{label} {len(values)}" for label, values in data["mag_ratios"].items()) + " ratios"


class MagCache(BlockStackCache):
    """MagCache: skips the blocks while the accumulated error of the calibrated magnitude-ratio curve stays small."""

    kind = KIND
    title = NODE_TITLE
    variant_input = "curve"
    entries = "MagCache curves"
    calibrate_title = CALIBRATE_TITLE
    published = PUBLISHED
    config_inputs = ConfigInputs(MagCacheConfig, CACHE_INPUTS)
    calibration = MagCacheCalibration()
    calibrate_inputs = {"threshold": 0.0, "max_skip_steps": 0, "retention_ratio": 0.0, "start_percent": 0.0,
                        "end_percent": 1.0, "cache_device": "compute device"}

    def auto_key(self, detected: DetectedModel) -> str | None:
        key = detected.auto_choice(KIND).key
        if key is not None and detected.auto_choice(KIND).notes:
            log.info("OmniHooks %s: 'auto' chose the %r curve for %s. %s", NODE_TITLE, key, detected.describe(),
                     " ".join(detected.auto_choice(KIND).notes))
        return key

    def no_auto_fit(self, detected: DetectedModel) -> str:
        notes = self.auto_sentences(detected)
        if not for_family(detected.family.name):
            return (f"no MagCache curve is published for {detected.describe()} models. {notes}To use MagCache, "
                    f"{CALIBRATE_HINT}.")
        return (f"no published MagCache curve fits {detected.describe()}. {notes}Choose a {detected.family.name} "
                f"curve, or {CALIBRATE_HINT}.")

    def make_config(self, detected: DetectedModel, found: MagCacheCurve | ResolvedCurve | None,
                    tuning: dict[str, Any], shared: dict[str, Any]) -> MagCacheConfig:
        calibrate = found is None
        return MagCacheConfig(
            **tuning, mag_ratios=None if calibrate else {name: tuple(values) for name, values in found.curves},
            model_label=f"{detected.variant}, {'calibrate' if calibrate else found.key}",
            **{**shared, "notes": shared["notes"] + ((found.note,) if found is not None and found.note else ())})

    def build_run(self, session: CacheSession, diffusion_model: torch.nn.Module) -> MagCacheRun:
        return apply_mag_cache_hook(session.detected.build_stack(diffusion_model), session.config, session.stats)


MAGCACHE = MagCache()
FEATURE = MAGCACHE.feature()  # listed in nodes.features.FEATURE_MODULES


class ApplyMagCache(ApplyCacheNode):
    cache = MAGCACHE

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID, display_name=display_name(NODE_TITLE), category=CATEGORY,
            description="Skips the transformer blocks on steps where the calibrated growth of the model's residual "
                        "(its magnitude-ratio curve) says reusing the last computed residual costs little. Detects "
                        "the model; reports every decision. Wan 2.2 A14B: put one on each expert and choose the "
                        "curve's '(high noise)' / '(low noise)' part; each uses its own sampler's steps.",
            inputs=[
                cache_model_input(),
                io.Float.Input("threshold", default=MAGCACHE.config_inputs.default("threshold"), min=0.0, max=1.0,
                               step=0.01,
                               tooltip="How much accumulated error to tolerate before computing again (the sum of "
                               "|1 - product of ratios| since the last computed step). 0 = never skip (output "
                               "identical to no node). 0.06 is the safe default; 0.12-0.24 is faster and less "
                               "faithful."),
                io.Int.Input("max_skip_steps", display_name="K (max consecutive skips)",
                             default=MAGCACHE.config_inputs.default("max_skip_steps"), min=0, max=20,
                             tooltip="K: at most this many steps in a row reuse the residual before one is computed. "
                             "0 = never skip. 2-4 is typical (the MagCache scripts use 2-6)."),
                io.Float.Input("retention_ratio", default=MAGCACHE.config_inputs.default("retention_ratio"), min=0.0,
                               max=1.0, step=0.01,
                               tooltip="This fraction of the first steps is always computed (they set the "
                               "composition). Counted on this sampler's own steps, so for a Wan 2.2 expert it "
                               "is per phase."),
                *window_inputs(),
                cache_device_input(),
                io.Combo.Input("curve", options=MAGCACHE.variant_options(), default=AUTO,
                               tooltip="The magnitude-ratio curve. 'auto' picks the published one for the detected "
                               "model; choose one when the weights cannot tell (Wan I2V 720p vs 480p, "
                               "Qwen-Image-Edit, Wan 2.2 A14B '(high noise)' / '(low noise)' per expert), or a "
                               "'calibration: <name>' file from MagCache Calibrate (for models without a published "
                               "curve). Interpolated to your step count; a Wan 2.2 part to its own expert's steps "
                               "(ComfyUI's Wan 2.2 template, switch at step 10 of 20, fits the parts). On Flux, a run "
                               "whose conditioning carries reference latents (Kontext) uses Kontext's official curve."),
                forecast_input(),  # the optional inputs last: a saved workflow's widget values keep their positions
                forward_budget_input(),
                skip_correction_input(),
                speedup_input(),
            ],
            outputs=[io.Model.Output(tooltip="The same MODEL with MagCache attached for its sampling runs.")],
            hidden=[io.Hidden.unique_id])


class MagCacheCalibrate(CalibrateCacheNode):
    cache = MAGCACHE
    title = CALIBRATE_TITLE

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=CALIBRATE_NODE_ID, display_name=display_name(CALIBRATE_TITLE), category=CATEGORY,
            description="A KSampler that computes every step and records, per step and CFG branch, how the magnitude "
                        "of the transformer's residual changes from the previous step (mean ratio of per-token norms, "
                        "its spread and the cosine distance), then saves that curve under 'name'. Apply MagCache "
                        "lists it as 'calibration: <name>'. Use the sampler settings you will generate with.",
            inputs=[
                *calibration_sampler_inputs(
                    MagCacheCalibration.min_steps, steps_tooltip="Sampling steps; the curve gets one ratio per step "
                    "and branch (Apply MagCache interpolates it to other step counts).",
                    sampler_tooltip="The sampler you will generate with; one that evaluates the model once per step "
                    "(euler, ...) gives exactly one ratio per step."),
                calibration_name_input(KIND, "curve"),
                speedup_trial_input(),
            ],
            outputs=[io.Latent.Output(tooltip="The sampled latent (every step computed)."),
                     io.String.Output(display_name="curve", tooltip="The recorded curve as JSON: mag_ratios, std and "
                                      "cos_dist per branch, and the CFG-interleaved list.")],
            hidden=[io.Hidden.unique_id], is_output_node=True)


__all__ = ["ApplyMagCache", "MAGCACHE", "MagCache", "MagCacheCalibrate", "MagCacheCalibration", "calibration_data"]
