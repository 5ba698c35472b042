"""TeaCache as a ``BlockStackCache``: its settings, published polynomials, calibration file, and its two nodes
(Apply TeaCache, TeaCache Calibrate)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from comfy_api.latest import io

from ...omni_hooks.few_step import FewStepRule
from ...omni_hooks.teacache import TeaCacheConfig, TeaCacheRun, apply_teacache_hook, fit_coefficients
from . import calibration_files
from .base import (ApplyCacheNode, BlockStackCache, CacheSession, CalibrateCacheNode, percent_window_inputs,
                   register_cache)
from .inputs import forecast_order
from .teacache_coefficients import PUBLISHED, TeaCacheCoefficients, for_family
from ..families import DetectedModel

KIND = "teacache"
NODE_ID = "OmniHooks.ApplyTeaCache"
NODE_TITLE = "Apply TeaCache"
CALIBRATE_NODE_ID = "OmniHooks.TeaCacheCalibrate"
CALIBRATE_TITLE = "TeaCache Calibrate"
RECOMMENDED = -1.0
IDENTITY = (0.0, 0.0, 0.0, 1.0, 0.0)  # calibration runs measure the raw relative change


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
    forecast_order: int | str = 0

    @property
    def threshold(self) -> float:
        return self.rel_l1_thresh


def _bad_file(name: str, what: str) -> ValueError:
    return ValueError(f"{NODE_TITLE}: calibration {name!r} ({calibration_files.directory(KIND)}) {what}; "
                      f"run TeaCache Calibrate again, or choose another variant.")


MIN_CALIBRATION_STEPS = 8


class TeaCache(BlockStackCache):
    """TeaCache: skips the blocks while the polynomial-rescaled change of the modulated input stays small."""

    kind = KIND
    apply_node_id = NODE_ID
    apply_title = NODE_TITLE
    apply_description = ("Skips the transformer blocks on steps where the model's timestep-modulated input has barely "
                         "changed, reusing the last computed residual. Detects the model; reports every decision.")
    calibrate_node_id = CALIBRATE_NODE_ID
    calibrate_title = CALIBRATE_TITLE
    calibrate_description = ("A KSampler that computes every step and records how much the model's modulated input "
                             "and its block-stack output change from step to step, then fits TeaCache's polynomial "
                             "and saves it under 'name'. Apply TeaCache lists it as 'calibration: <name>'. Use the "
                             "sampler settings you will generate with; more steps and prompts give a better fit.")
    variant_input = "model_variant"
    variant_tooltip = ("Which published coefficients to use. 'auto' picks them from the model's class and size; "
                       "choose one when the weights cannot tell (Wan I2V 720p vs 480p, retention mode, HiDream "
                       "dev/fast) or pick a calibration file.")
    published = PUBLISHED
    calibrate_tuning = {"rel_l1_thresh": 0.0, "start_percent": 0.0, "end_percent": 1.0,
                        "cache_device": "compute device"}
    min_calibration_steps = MIN_CALIBRATION_STEPS
    calibration_noun = "fitted coefficients"
    calibration_steps_tooltip = (f"Sampling steps; each step gives one calibration point per branch (at least "
                                 f"{MIN_CALIBRATION_STEPS}).")
    calibration_sampler_tooltip = "The sampler you will generate with."
    calibration_output = "coefficients"
    calibration_output_tooltip = "The fitted polynomial and its data, as JSON."

    def no_auto_fit(self, adapter: DetectedModel) -> str:
        return (f"no published TeaCache coefficients fit {adapter.describe()}. "
                + " ".join(adapter.recommendation(KIND).notes)
                + " Choose a model_variant, or run 'TeaCache Calibrate' on this model and choose its file.")

    def check_file(self, name: str, data: dict) -> tuple[float, ...]:
        """The five finite coefficients of a calibration file; a clear error for a malformed file."""
        coefficients = data.get("coefficients")
        if (not isinstance(coefficients, list) or len(coefficients) != 5
                or not all(isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c)
                           for c in coefficients)):
            raise _bad_file(name, f"has no valid 'coefficients' (5 finite numbers expected, got "
                                  f"{str(coefficients)[:80]})")
        return tuple(float(c) for c in coefficients)

    def from_file(self, adapter: DetectedModel, value: str, name: str, data: dict) -> TeaCacheCoefficients:
        """The coefficient set of a calibration file's contents; a clear error for a malformed file."""
        coefficients = self.check_file(name, data)
        signal = data.get("signal", "default")
        signals = {"default", *(c.signal for c in for_family(adapter.family))}
        if signal not in signals:
            raise _bad_file(name, f"has signal {str(signal)[:40]!r}, which {adapter.family} models do not have "
                                  f"(one of {sorted(signals)})")
        try:
            threshold = float(data.get("recommended_threshold", 0.2))
        except (TypeError, ValueError):
            raise _bad_file(name, "has a 'recommended_threshold' that is not a number") from None
        return TeaCacheCoefficients(key=value, family=data.get("family", adapter.family), coefficients=coefficients,
                                    threshold=threshold, signal=signal, note=f"calibrated: {name}")

    def tuning_inputs(self) -> list[io.Input]:
        return [
            io.Float.Input("rel_l1_thresh", default=RECOMMENDED, min=-1.0, max=10.0, step=0.01,
                           tooltip="How much accumulated change to tolerate before computing again. -1 = the "
                           "published recommendation for the detected model (e.g. 0.08 Wan 2.1 T2V 1.3B, 0.2 "
                           "Wan 14B, 0.4 Flux dev). 0 = never skip (output identical to no node). Higher = "
                           "faster, less faithful."),
            *percent_window_inputs(" The first and last steps are always computed."),
        ]

    def make_settings(self, adapter: DetectedModel, found: TeaCacheCoefficients | None, tuning: dict[str, Any],
                      auto: bool) -> TeaCacheSettings:
        calibrate = found is None
        if calibrate:
            found = TeaCacheCoefficients(key="calibrate", family=adapter.family, coefficients=IDENTITY,
                                         threshold=0.0)
        rel_l1_thresh = tuning["rel_l1_thresh"]
        threshold = found.threshold if rel_l1_thresh == RECOMMENDED else rel_l1_thresh
        if threshold < 0:
            raise ValueError(f"rel_l1_thresh must be -1 (recommended) or >= 0, got {rel_l1_thresh}")
        return TeaCacheSettings(rel_l1_thresh=threshold, start_percent=tuning["start_percent"],
                                end_percent=tuning["end_percent"], cache_device=tuning["cache_device"],
                                coefficients=found.coefficients, signal=found.signal, ret_steps=found.ret_steps,
                                model_label=f"{adapter.variant}, {found.key}", calibrate=calibrate,
                                notes=tuple(adapter.recommendation(KIND).notes) if auto else (),
                                forecast_order=forecast_order(tuning))

    def build_run(self, session: CacheSession, diffusion_model: torch.nn.Module) -> TeaCacheRun:
        settings: TeaCacheSettings = session.settings
        config = TeaCacheConfig(rel_l1_thresh=settings.rel_l1_thresh, coefficients=settings.coefficients,
                                ret_steps=settings.ret_steps, start_percent=settings.start_percent,
                                end_percent=settings.end_percent, cache_device=session.cache_device,
                                calibrate=settings.calibrate, forecast_order=settings.forecast_order,
                                few_step=FewStepRule())
        stack = session.adapter.build_stack(diffusion_model)
        signal = session.adapter.build_modulated_input(diffusion_model, settings.signal)
        return apply_teacache_hook(stack, config, signal, session.stats)

    def collect_calibration(self, run: TeaCacheRun) -> list[tuple[float, float]]:
        return run.calibration_pairs()

    def calibration_file(self, parts: list[list[tuple[float, float]]], adapter: DetectedModel) -> dict:
        pairs = [pair for part in parts for pair in part]
        coefficients = fit_coefficients(pairs)
        return {
            "kind": KIND,
            "family": adapter.family,
            "variant": adapter.variant,
            "signal": "default",
            "coefficients": coefficients,
            "points": len(pairs),
            "input_change_range": [min(p[0] for p in pairs), max(p[0] for p in pairs)],
            "output_change_range": [min(p[1] for p in pairs), max(p[1] for p in pairs)],
        }

    def describe_calibration(self, data: dict) -> str:
        return f"fitted {data['coefficients']} from {data['points']} points"


TEACACHE = register_cache(TeaCache())


class ApplyTeaCache(ApplyCacheNode):
    cache = TEACACHE


class TeaCacheCalibrate(CalibrateCacheNode):
    cache = TEACACHE


__all__ = ["ApplyTeaCache", "TEACACHE", "TeaCache", "TeaCacheCalibrate", "TeaCacheSettings"]
