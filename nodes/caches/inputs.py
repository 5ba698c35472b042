"""Inputs and steps the cache nodes share: the cache-device choice, and the KSampler-like calibration run."""
from __future__ import annotations

import comfy.patcher_extension as pe
import comfy.samplers
import nodes as comfy_nodes  # ComfyUI's nodes.py (this pack's own nodes/ package is only imported relatively)
import torch
from comfy_api.latest import io

from ...omni_hooks.forecast import AUTO
from . import calibration_files
from ..features import RUN_KEY, AppliedFeature, FeatureSession, RunSession, attach_feature

CACHE_DEVICES = ["compute device", "offload device"]


def cache_device_input() -> io.Combo.Input:
    return io.Combo.Input("cache_device", options=CACHE_DEVICES, default=CACHE_DEVICES[0],
                          tooltip="Where the cached residuals live. 'offload device' (usually system RAM) saves VRAM "
                          "for long videos at the cost of a copy per reused step.")


def check_cache_device(node_title: str, value: str) -> None:
    # ComfyUI 0.3.64 does not validate V3 combo values at /prompt, so the node does
    if value not in CACHE_DEVICES:
        raise ValueError(f"{node_title}: unknown cache_device {value!r}; choose one of {CACHE_DEVICES}")


def cache_device_for(patcher, value: str) -> torch.device | None:
    """The device cached tensors go to; None keeps them where they were computed."""
    return torch.device(patcher.offload_device) if value == "offload device" else None


FORECAST_ORDERS = {"off": 0, "1st order": 1, "2nd order": 2, "auto": AUTO}


def forecast_input() -> io.Combo.Input:
    """Optional, so that a saved workflow (or API prompt) without it loads and keeps plain reuse."""
    return io.Combo.Input("forecast", options=list(FORECAST_ORDERS), default="off", optional=True,
                          tooltip="What a skipped step adds instead of running the blocks. 'off': the residual of "
                          "the last computed step (plain reuse). '1st order' / '2nd order': the residual "
                          "extrapolated to this step's sigma from the last 2 / 3 computed steps (finite "
                          "differences, as TaylorSeer), which stays faithful at higher thresholds, so fewer steps "
                          "are computed for the same quality; keeps 2 / 3 residuals per branch in memory. 'auto': "
                          "per branch and skipped step, whichever of reuse, 1st and 2nd order has best predicted the "
                          "steps this run computed (never worse than 'off' in the benchmarks); keeps 4 residuals "
                          "per branch.")


def forecast_order(tuning: dict) -> int | str:
    """The order the ``forecast`` input asks for (absent: 'off'); ValueError for an unknown value."""
    value = tuning.get("forecast", "off")
    if value not in FORECAST_ORDERS:  # ComfyUI 0.3.64 does not validate V3 combo values at /prompt
        raise ValueError(f"unknown forecast {value!r}; choose one of {list(FORECAST_ORDERS)}")
    return FORECAST_ORDERS[value]


def calibration_sampler_inputs(min_steps: int, steps_tooltip: str, cfg_tooltip: str,
                               sampler_tooltip: str) -> list[io.Input]:
    """KSampler's inputs for a calibrate node, in KSampler's order."""
    return [
        io.Model.Input("model", tooltip="The MODEL to calibrate (without a cache node)."),
        io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True,
                     tooltip="The random seed used for creating the noise."),
        io.Int.Input("steps", default=30, min=min_steps, max=10000, tooltip=steps_tooltip),
        io.Float.Input("cfg", default=5.0, min=0.0, max=100.0, step=0.1, round=0.01, tooltip=cfg_tooltip),
        io.Combo.Input("sampler_name", options=comfy.samplers.KSampler.SAMPLERS, tooltip=sampler_tooltip),
        io.Combo.Input("scheduler", options=comfy.samplers.KSampler.SCHEDULERS,
                       tooltip="The scheduler you will generate with."),
        io.Conditioning.Input("positive", tooltip="A representative positive prompt."),
        io.Conditioning.Input("negative", tooltip="A representative negative prompt."),
        io.Latent.Input("latent_image", tooltip="A latent of the size you will generate at."),
    ]


def validate_calibration_name(node_title: str, name: str | None) -> bool | str:
    """For a calibrate node's ``validate_inputs`` (at /prompt): True, or the message naming the node.

    A linked ``name`` (a primitive or any node that outputs a STRING) has no value yet at /prompt: ComfyUI passes
    None, which passes here; ``calibration_name`` checks the real value at execute time.
    """
    if name is None:
        return True
    try:
        calibration_files.check_name(name)
    except ValueError as e:
        return f"{node_title}: {e}"
    return True


def calibration_name(node_title: str, name: object) -> str:
    """The checked calibration name at execute time; ``ValueError`` naming the node otherwise."""
    try:
        return calibration_files.check_name(name)
    except ValueError as e:
        raise calibration_files.CalibrationFileError(f"{node_title}: {e}") from None


def sample_calibrating(model, feature: AppliedFeature, seed: int, steps: int, cfg: float, sampler_name: str,
                       scheduler: str, positive, negative, latent_image) -> tuple[dict, list[FeatureSession]]:
    """Run the KSampler node's own path (same noise, progress bar with previews) with ``feature`` attached.

    Returns the LATENT and the feature's sessions, one per sampling run, closed (read what they recorded).
    """
    sessions: list[FeatureSession] = []

    def keep_sessions(executor, *args, **kwargs):
        # runs inside the lifecycle's OUTER_SAMPLE wrapper, so the run's sessions exist already
        run: RunSession = executor.class_obj.model_options["transformer_options"][RUN_KEY]
        sessions.extend(s for s in run.sessions if s.feature == feature)
        return executor(*args, **kwargs)

    calibrating = attach_feature(model, feature)
    calibrating.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, "omni_hooks.calibrate", keep_sessions)
    (latent,) = comfy_nodes.common_ksampler(calibrating, seed, steps, cfg, sampler_name, scheduler, positive,
                                            negative, latent_image)
    return latent, sessions
