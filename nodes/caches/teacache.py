"""TeaCache as a ``BlockStackCache``: its config, published polynomials, calibration file, and its two nodes
(Apply TeaCache, TeaCache Calibrate), each declaring its schema."""
from __future__ import annotations

import math
from typing import Any

import torch
from comfy_api.latest import io

from ...omni_hooks.teacache.config import DEFAULT_RECOMMENDED_THRESHOLD, RECOMMENDED_SPEEDUP
from ...omni_hooks.teacache import (TeaCacheConfig, TeaCacheRun, apply_teacache_hook, fit_coefficients,
                                    recommended_threshold)
from . import calibration_files
from .base import AUTO, ApplyCacheNode, BlockStackCache, CacheCalibration, CacheSession, CalibrateCacheNode
from .inputs import (cache_device_input, cache_model_input, calibration_name_input, calibration_sampler_inputs,
                     CACHE_INPUTS, SHARED_INPUTS, forecast_input, forward_budget_input, skip_correction_input,
                     speedup_input, speedup_trial_input, window_inputs)
from ..features import CATEGORY, ConfigInputs, display_name
from .teacache_coefficients import PUBLISHED, TeaCacheCoefficients
from ..families import DEFAULT_SIGNAL, DetectedModel

KIND = "teacache"
NODE_ID = "OmniHooks.ApplyTeaCache"
NODE_TITLE = "Apply TeaCache"
CALIBRATE_NODE_ID = "OmniHooks.TeaCacheCalibrate"
CALIBRATE_TITLE = "TeaCache Calibrate"
IDENTITY = (0.0, 0.0, 0.0, 1.0, 0.0)  # calibration runs measure the raw relative change


def _bad_file(name: str, what: str) -> ValueError:
    return ValueError(f"{NODE_TITLE}: calibration {name!r} ({calibration_files.directory(KIND)}) {what}; "
                      f"run TeaCache Calibrate again, or choose another variant.")


MIN_CALIBRATION_STEPS = 8


def lacks_signal(detected: DetectedModel, signal: str) -> str:
    """Why coefficients fitted on ``signal`` cannot run on this model: its family does not offer that signal."""
    return (f"{detected.describe()} does not offer the signal {signal!r} these coefficients were fitted on (its "
            f"family offers {', '.join(sorted(detected.family.signals))}). Choose another model_variant, or run "
            f"{CALIBRATE_TITLE} on this model and choose its file.")


def published_window(found: TeaCacheCoefficients, start: float, end: float) -> dict[str, float]:
    """The caching window of a run with ``found``: the user's start_percent / end_percent where set (another value
    than the config's default, 0 / 1), the published window of ``found`` otherwise (Flux Kontext 0.2-0.9, ...); the
    user's two values where combining them would leave no window."""
    default_start, default_end = (SHARED_INPUTS.default(name) for name in ("start_percent", "end_percent"))
    window = (start if start != default_start else found.start_percent,
              end if end != default_end else found.end_percent)
    if window[0] > window[1]:
        window = (start, end)
    return {"start_percent": window[0], "end_percent": window[1]}


class TeaCacheCalibration(CacheCalibration):
    """TeaCache's calibration: (input change, output change) pairs per step, fitted to a polynomial in a file."""

    min_steps = MIN_CALIBRATION_STEPS

    def check_file(self, name: str, data: dict) -> tuple[float, ...]:
        """The five finite coefficients of a calibration file; a clear error for a malformed file."""
        coefficients = data.get("coefficients")
        if (not isinstance(coefficients, list) or len(coefficients) != 5
                or not all(isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c)
                           for c in coefficients)):
            raise _bad_file(name, f"has no valid 'coefficients' (5 finite numbers expected, got "
                                  f"{str(coefficients)[:80]})")
        return tuple(float(c) for c in coefficients)

    def from_file(self, detected: DetectedModel, value: str, name: str, data: dict) -> TeaCacheCoefficients:
        """The coefficient set of a calibration file's contents; a clear error for a malformed file."""
        coefficients = self.check_file(name, data)
        signal = data.get("signal", DEFAULT_SIGNAL)
        signals = detected.family.signals
        if signal not in signals:
            raise _bad_file(name, f"has signal {str(signal)[:40]!r}, which {detected.family.name} models do not have "
                                  f"(one of {sorted(signals)})")
        try:
            threshold = float(data.get("recommended_threshold", DEFAULT_RECOMMENDED_THRESHOLD))
        except (TypeError, ValueError):
            raise _bad_file(name, "has a 'recommended_threshold' that is not a number") from None
        return TeaCacheCoefficients(key=value, family=data.get("family", detected.family.name),
                                    coefficients=coefficients,
                                    threshold=threshold, signal=signal, source=f"calibration file {name}")

    def collect(self, run: TeaCacheRun) -> list[list[tuple[float, float]]]:
        return run.calibration_series()

    def file_contents(self, parts: list[list[list[tuple[float, float]]]], detected: DetectedModel) -> dict:
        series = [branch for part in parts for branch in part]
        pairs = [pair for branch in series for pair in branch]
        coefficients = fit_coefficients(pairs)
        return {
            "kind": KIND,
            "family": detected.family.name,
            "variant": detected.variant,
            "signal": DEFAULT_SIGNAL,
            "coefficients": coefficients,
            "recommended_threshold": recommended_threshold(coefficients, series),
            "points": len(pairs),
            "input_change_range": [min(p[0] for p in pairs), max(p[0] for p in pairs)],
            "output_change_range": [min(p[1] for p in pairs), max(p[1] for p in pairs)],
        }

    def describe(self, data: dict) -> str:
        return (f"fitted {data['coefficients']} from {data['points']} points; rel_l1_thresh -1 uses its recommended "
                f"{data['recommended_threshold']:g} (about {RECOMMENDED_SPEEDUP:g}x fewer steps on this run)")


class TeaCache(BlockStackCache):
    """TeaCache: skips the blocks while the polynomial-rescaled change of the modulated input stays small."""

    kind = KIND
    title = NODE_TITLE
    variant_input = "model_variant"
    entries = "TeaCache coefficients"
    calibrate_title = CALIBRATE_TITLE
    published = PUBLISHED
    config_inputs = ConfigInputs(TeaCacheConfig, CACHE_INPUTS)
    calibration = TeaCacheCalibration()
    calibrate_inputs = {"rel_l1_thresh": 0.0, "start_percent": 0.0, "end_percent": 1.0,
                        "cache_device": "compute device"}

    def no_auto_fit(self, detected: DetectedModel) -> str:
        return (f"no published TeaCache coefficients fit {detected.describe()}. {self.auto_sentences(detected)}"
                "Choose a model_variant, or run 'TeaCache Calibrate' on this model and choose its file.")

    def make_config(self, detected: DetectedModel, found: TeaCacheCoefficients | None, tuning: dict[str, Any],
                    shared: dict[str, Any]) -> TeaCacheConfig:
        calibrate = found is None
        if calibrate:
            found = TeaCacheCoefficients(key="calibrate", family=detected.family.name, coefficients=IDENTITY,
                                         threshold=0.0)
        if found.signal not in detected.family.signals:
            raise ValueError(f"coefficients {found.key!r}: {lacks_signal(detected, found.signal)}")
        return TeaCacheConfig(**tuning, recommended_threshold=found.threshold, coefficients=found.coefficients,
                              ret_steps=found.ret_steps, signal=found.signal,
                              model_label=f"{detected.variant}, {found.key}",
                              **{**shared, **published_window(found, shared["start_percent"], shared["end_percent"])})

    def build_run(self, session: CacheSession, diffusion_model: torch.nn.Module) -> TeaCacheRun:
        config: TeaCacheConfig = session.config
        stack = session.detected.build_stack(diffusion_model)
        signal = session.detected.family.signals.get(config.signal)
        if signal is None:  # make_config refuses such coefficients; a config built for another model could not run
            raise ValueError(f"{session.feature.describe()}: {lacks_signal(session.detected, config.signal)}")
        return apply_teacache_hook(stack, config, signal(diffusion_model), session.stats)


TEACACHE = TeaCache()
FEATURE = TEACACHE.feature()  # listed in nodes.features.FEATURE_MODULES


class ApplyTeaCache(ApplyCacheNode):
    cache = TEACACHE

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID, display_name=display_name(NODE_TITLE), category=CATEGORY,
            description="Skips the transformer blocks on steps where the model's timestep-modulated input has barely "
                        "changed, reusing the last computed residual. Detects the model; reports every decision.",
            inputs=[
                cache_model_input(),
                io.Float.Input("rel_l1_thresh", default=TEACACHE.config_inputs.default("rel_l1_thresh"), min=-1.0,
                               max=10.0, step=0.01,
                               tooltip="How much accumulated change to tolerate before computing again. -1 = the "
                               "published recommendation for the detected model (e.g. 0.08 Wan 2.1 T2V 1.3B, 0.2 "
                               "Wan 14B, 0.4 Flux dev). 0 = never skip (output identical to no node). Higher = "
                               "faster, less faithful."),
                *window_inputs(" The first and last steps are always computed.",
                               default_note=" Left at its default, the published window of the chosen "
                               "coefficients applies (Flux Kontext 0.2-0.9, Lumina 2 from 0.2, HiDream full from "
                               "0.1, HiDream fast to 0.9); any other value is yours."),
                cache_device_input(),
                io.Combo.Input("model_variant", options=TEACACHE.variant_options(), default=AUTO,
                               tooltip="Which published coefficients to use. 'auto' picks them from the model's "
                               "class and size; choose one when the weights cannot tell (Wan I2V 720p vs 480p, "
                               "retention mode, HiDream dev/fast) or pick a calibration file. On Flux, a run whose "
                               "conditioning carries reference latents (Kontext) uses Kontext's coefficients."),
                forecast_input(),  # the optional inputs last: a saved workflow's widget values keep their positions
                forward_budget_input(),
                skip_correction_input(),
                speedup_input(),
            ],
            outputs=[io.Model.Output(tooltip="The same MODEL with TeaCache attached for its sampling runs.")],
            hidden=[io.Hidden.unique_id])


class TeaCacheCalibrate(CalibrateCacheNode):
    cache = TEACACHE
    title = CALIBRATE_TITLE

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=CALIBRATE_NODE_ID, display_name=display_name(CALIBRATE_TITLE), category=CATEGORY,
            description="A KSampler that computes every step and records how much the model's modulated input and "
                        "its block-stack output change from step to step, then fits TeaCache's polynomial and saves "
                        "it under 'name'. Apply TeaCache lists it as 'calibration: <name>'. Use the sampler settings "
                        "you will generate with; more steps and prompts give a better fit.",
            inputs=[
                *calibration_sampler_inputs(
                    MIN_CALIBRATION_STEPS, steps_tooltip=f"Sampling steps; each step gives one calibration point per "
                    f"branch (at least {MIN_CALIBRATION_STEPS}).",
                    sampler_tooltip="The sampler you will generate with."),
                calibration_name_input(KIND, "fitted coefficients"),
                speedup_trial_input(),
            ],
            outputs=[io.Latent.Output(tooltip="The sampled latent (every step computed)."),
                     io.String.Output(display_name="coefficients",
                                      tooltip="The fitted polynomial and its data, as JSON.")],
            hidden=[io.Hidden.unique_id], is_output_node=True)


__all__ = ["ApplyTeaCache", "TEACACHE", "TeaCache", "TeaCacheCalibrate", "TeaCacheCalibration"]
