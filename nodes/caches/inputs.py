"""Inputs and steps the cache nodes share, for the schemas each node declares inline: the MODEL, the start/end
window, the cache-device choice and the forecast of an Apply node; the KSampler inputs and the file name of a
Calibrate node; and the KSampler-like calibration run."""
from __future__ import annotations

import comfy.patcher_extension as pe
import comfy.samplers
import nodes as comfy_nodes  # ComfyUI's nodes.py (this pack's own nodes/ package is only imported relatively)
import torch
from comfy_api.latest import io

from ...omni_hooks.caching.config import MAX_SPEEDUP, StackCacheConfig
from ...omni_hooks.caching.forecast import AUTO
from ...omni_hooks.caching.speedup import (FORECAST, SKIP_CORRECTION, TRIAL_CORRECTIONS, TRIAL_MARGIN_DB, TRIAL_ORDERS,
                                           TRIAL_SPEEDUPS, pair_words)
from . import calibration_files
from ..families import model_input
from ..features import RUN_KEY, AppliedFeature, ConfigInput, ConfigInputs, FeatureSession, SamplingRun, attach_feature

CACHE_DEVICES = ["compute device", "offload device"]

def cache_model_input() -> io.Model.Input:
    """An Apply node's ``model`` input."""
    return model_input(" Not one that already has another cache.")


def window_inputs(end_note: str = "", default_note: str = "") -> list[io.Input]:
    """start_percent / end_percent, which every cache has (checked by its ``StackCacheConfig``)."""
    return [
        io.Float.Input("start_percent", default=SHARED_INPUTS.default("start_percent"), min=0.0, max=1.0,
                       step=0.01,
                       tooltip="Caching starts at this fraction of this sampler's steps; earlier steps are always "
                       f"computed (they set the composition).{default_note}"),
        io.Float.Input("end_percent", default=SHARED_INPUTS.default("end_percent"), min=0.0, max=1.0,
                       step=0.01,
                       tooltip=f"Caching stops after this fraction of this sampler's steps; later steps are always "
                       f"computed.{end_note}{default_note}"),
    ]


def cache_device_input() -> io.Combo.Input:
    """``cache_device``: its first option, "compute device", is the config's default (None)."""
    return io.Combo.Input("cache_device", options=CACHE_DEVICES, default=SHARED_INPUTS.default("cache_device"),
                          tooltip="Where the cached residuals live. 'offload device' (usually system RAM) saves VRAM "
                          "for long videos at the cost of a copy per reused step.")


def cache_device_for(value: str, model) -> torch.device | None:
    """The device the ``cache_device`` input names for ``model`` (a ModelPatcher): its offload device, or None (keep
    cached tensors where they were computed). ValueError for an unknown value (ComfyUI 0.3.64 does not validate V3
    combo values at /prompt, so the node does)."""
    if value not in CACHE_DEVICES:
        raise ValueError(f"unknown cache_device {value!r}; choose one of {CACHE_DEVICES}")
    return torch.device(model.offload_device) if value == "offload device" else None


FORECAST_ORDERS = {"off": 0, "1st order": 1, "2nd order": 2, "auto": AUTO}


def forecast_input() -> io.Combo.Input:
    """Optional, so that a saved workflow (or API prompt) without it loads and keeps plain reuse (the config's
    default order)."""
    return io.Combo.Input("forecast", options=list(FORECAST_ORDERS), default=SHARED_INPUTS.default("forecast"),
                          optional=True,
                          tooltip="What a skipped step adds instead of running the blocks. 'off': the residual of "
                          "the last computed step (plain reuse). '1st order' / '2nd order': the residual "
                          "extrapolated to this step's sigma from the last 2 / 3 computed steps (finite "
                          "differences, as TaylorSeer), which stays faithful at higher thresholds, so fewer steps "
                          "are computed for the same quality; keeps 2 / 3 residuals per branch in memory. 'auto': "
                          "per branch and skipped step, whichever of reuse, 1st and 2nd order, TaylorSeer's Taylor "
                          "step and a Chebyshev fit over the last 4 computed steps (as Spectrum fits) is expected "
                          "to err least at this step, from how each predicted the steps this run computed, counting "
                          "errors that point the same way step after step as adding up (never worse than 'off' in "
                          "the benchmarks' means with a threshold; under a forward budget '1st order' was better, "
                          "by up to 9 dB); keeps 5 residuals per branch. With '1st order' and 'auto', "
                          "TeaCache computes sooner where the forecast has recently erred more than usual.")


def forward_budget_input() -> io.Int.Input:
    """Optional and last, so that a saved workflow (or API prompt) without it loads and keeps its threshold policy."""
    return io.Int.Input("forward_budget", display_name="forward budget (steps to compute)",
                        default=SHARED_INPUTS.default("forward_budget"), min=0,
                        max=10000, optional=True,
                        tooltip="Compute about this many of the sampler's steps (0 = off: the threshold alone "
                        "decides). The cache places them where they matter most for the final image: from this "
                        "model's calibration file (how fast its output changes along the schedule; without one, "
                        "in proportion to the schedule's sigma steps), the first and last steps always included, "
                        "usually most of the last steps. A threshold above 0 can still bring the next planned step "
                        "forward (at most half its gap) where its change reaches the threshold; on the Wan "
                        "benchmark models that only cost quality, so set it to 0 to leave the placement to the plan. "
                        "'1st order' is the forecast to pair it with. A predictable speed-up: steps / budget. With a "
                        "budget, the few-step rule, MagCache's retention and K give way to the plan; steps outside "
                        "the start/end window still compute and count.")


def skip_correction_input() -> io.Float.Input:
    """Optional and last, so that a saved workflow (or API prompt) without it loads and runs as before."""
    return io.Float.Input("skip_correction", display_name="skip correction (euler)",
                          default=SHARED_INPUTS.default("skip_correction"), min=0.0, max=1.0, step=0.05,
                          optional=True,
                          tooltip="0 = off. After skipped steps, the next computed step also corrects what they "
                          "added to the latent: by this fraction of the difference between the residuals they used "
                          "and the interpolation between the two computed steps around them. No model call, one "
                          "more tensor per branch. 0.5 gained quality at most settings on the Wan benchmark models "
                          "(see the README); it needs the sampler 'euler', with any other sampler nothing is "
                          "corrected and the statistics say so (the speed-up also corrects 'uni_pc', 'dpmpp_2m' "
                          "and 'res_multistep').")


#: a fresh node's speed-up (the widget's default: 15 of 30 steps, 54-78 dB in the benchmarks). A saved workflow or
#: API prompt without the input keeps the config's 0 (no speed-up: the threshold and the other inputs decide, as when
#: it was saved; web/saved_workflows.js does the same for a workflow saved in the page)
FRESH_SPEEDUP = 2.0


#: the widget option that names the value a workflow saved without the input gets (read by web/saved_workflows.js)
SAVED_WITHOUT = "omnihooks_saved_without"


def speedup_input() -> io.Float.Input:
    """Optional and last, so that a saved workflow (or API prompt) without it loads and keeps what it did: the page
    sets it to 0 in a workflow saved without it (``SAVED_WITHOUT``), the executor leaves it out of such a prompt."""
    widget = io.Float.Input("speedup", display_name="speed-up (x; 0 = threshold)", default=FRESH_SPEEDUP, min=0.0,
                            max=MAX_SPEEDUP, step=0.25, optional=True,
                            tooltip="How much faster the run should be: 2 computes 1 in 2 steps, 3.75 computes 8 of "
                            "30. The cache chooses the rest: which steps to compute (where this model's calibration, "
                            "made with the sampler you generate with, says they matter most for that sampler; without "
                            "one, by the schedule), the forecast for the skipped ones ('1st order') and the skip "
                            "correction (0.5, with euler, uni_pc, dpmpp_2m and res_multistep), the choice that did "
                            "best overall in the benchmarks at 2x to 3.75x. The threshold, forecast, forward budget "
                            "and skip correction inputs are then not used and must stay at their defaults. 0 = off: "
                            "the threshold decides, as in the original TeaCache and MagCache nodes, with those "
                            "inputs. A run of 8 steps or fewer computes at least as many steps as the few-step rule "
                            "keeps (5 of 8).")
    widget.extra_dict[SAVED_WITHOUT] = SHARED_INPUTS.default("speedup")
    return widget


def forecast_order(value: str) -> int | str:
    """The order the ``forecast`` input's ``value`` asks for; ValueError for an unknown value."""
    if value not in FORECAST_ORDERS:  # ComfyUI 0.3.64 does not validate V3 combo values at /prompt
        raise ValueError(f"unknown forecast {value!r}; choose one of {list(FORECAST_ORDERS)}")
    return FORECAST_ORDERS[value]


#: every Apply node's inputs that set a config field of another name or form (``ConfigInputs``): a released input keeps
#: its name, and its default is the config field's
CACHE_INPUTS = {
    "rel_l1_thresh": "threshold",
    "forecast": ConfigInput("forecast_order", lambda value, model: forecast_order(value),
                            lambda order: next(name for name, o in FORECAST_ORDERS.items() if o == order)),
    "cache_device": ConfigInput("cache_device", cache_device_for,
                                lambda device: CACHE_DEVICES[0 if device is None else 1]),
}
#: the inputs every Apply node has, over the config fields every cache shares
SHARED_INPUTS = ConfigInputs(StackCacheConfig, CACHE_INPUTS)


def speedup_trial_input() -> io.Boolean.Input:
    """A Calibrate node's ``try_speedups``: optional and last, so that a calibration workflow (or API prompt) saved
    without it loads and saves the file it did (the page sets it off in a workflow saved without it:
    ``SAVED_WITHOUT``)."""
    widget = io.Boolean.Input("try_speedups", display_name="try the speed-up's forecasts", default=True,
                              optional=True,
                              tooltip="After the calibration run, run the speed-up at "
                              f"{', '.join(f'{s:g}x' for s in TRIAL_SPEEDUPS)} with each forecast and skip "
                              f"correction ({', '.join(pair_words(*p) for p in zip(TRIAL_ORDERS, TRIAL_CORRECTIONS))}) "
                              "on the same inputs (together about 4 times as many steps as the calibration run; the "
                              "pair without the correction only with a sampler that takes it) and save how close "
                              "each came to this run. A speed-up on this calibration then takes the pair "
                              f"that came {TRIAL_MARGIN_DB:g} dB or more closer at the tried speed-up nearest its own "
                              f"(else {pair_words(FORECAST, SKIP_CORRECTION)} with skip correction "
                              f"{SKIP_CORRECTION:g}). Off: the speed-up always takes that pair.")
    widget.extra_dict[SAVED_WITHOUT] = False
    return widget


def calibration_name_input(kind: str, what: str) -> io.String.Input:
    """A Calibrate node's ``name``: the file ``what`` (its contents, in words) is saved under."""
    return io.String.Input("name", default="my-model", tooltip=(
        f"File name for the {what} (letters, digits, space . _ -); saved in ComfyUI's user directory under "
        f"omni_hooks/{kind}/. An existing file of that name is replaced."))


def calibration_sampler_inputs(min_steps: int, steps_tooltip: str, sampler_tooltip: str,
                               cfg_tooltip: str = "Classifier-free guidance scale; above 1 calibrates the cond and "
                               "uncond branches.") -> list[io.Input]:
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
        # runs inside the lifecycle's OUTER_SAMPLE wrapper, so the sampling run's sessions exist already
        sampling_run: SamplingRun = executor.class_obj.model_options["transformer_options"][RUN_KEY]
        sessions.extend(s for s in sampling_run.sessions if s.feature == feature)
        return executor(*args, **kwargs)

    calibrating = attach_feature(model, feature)
    calibrating.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, "omni_hooks.calibrate", keep_sessions)
    (latent,) = comfy_nodes.common_ksampler(calibrating, seed, steps, cfg, sampler_name, scheduler, positive,
                                            negative, latent_image)
    return latent, sessions


def sample_with(model, feature: AppliedFeature, seed: int, steps: int, cfg: float, sampler_name: str, scheduler: str,
                positive, negative, latent_image) -> dict:
    """The LATENT of the KSampler node's own path with ``feature`` attached to a clone of ``model``."""
    (latent,) = comfy_nodes.common_ksampler(attach_feature(model, feature), seed, steps, cfg, sampler_name, scheduler,
                                            positive, negative, latent_image)
    return latent
