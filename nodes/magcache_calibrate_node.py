"""MagCache Calibrate: sample once with every step computed, record the residual's magnitude-ratio curve per branch,
and save it as a named calibration file that Apply MagCache offers as a curve."""
from __future__ import annotations

import json
import logging

from comfy_api.latest import io

from ..omni_hooks.magcache import interleave
from ..omni_hooks.magcache.interp import COND, UNCOND, branch_base
from . import calibration_files
from .adapters import detect_adapter
from .lifecycle import AppliedCache
from .node_inputs import calibration_sampler_inputs, sample_calibrating, validate_calibration_name
from .magcache_node import KIND, MagCacheSession, settings_for

NODE_ID = "OmniHooks.MagCacheCalibrate"
NODE_TITLE = "MagCache Calibrate"
MIN_STEPS = 4
log = logging.getLogger("OmniHooks")


def _rounded(values: list[float]) -> list[float]:
    return [round(float(v), 5) for v in values]


def calibration_data(result: dict[str, dict[str, list[float]]]) -> dict:
    """The file contents for a run's per-branch calibration result (only the first cond and uncond entries)."""
    branches = {label: lists for label, lists in result.items() if label == branch_base(label)}
    if not branches:
        raise ValueError(f"{NODE_TITLE}: the sampler made no model call that could be measured (did it run?)")
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


class MagCacheCalibrate(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID,
            display_name=f"{NODE_TITLE} (OmniHooks)",
            category="OmniHooks",
            description=("A KSampler that computes every step and records, per step and CFG branch, how the magnitude "
                         "of the transformer's residual changes from the previous step (mean ratio of per-token norms, "
                         "its spread and the cosine distance), then saves that curve under 'name'. Apply MagCache "
                         "lists it as 'calibration: <name>'. Use the sampler settings you will generate with."),
            inputs=[
                *calibration_sampler_inputs(
                    MIN_STEPS, steps_tooltip="Sampling steps; the curve gets one ratio per step and branch (Apply "
                    "MagCache interpolates it to other step counts).",
                    cfg_tooltip="Classifier-free guidance scale; above 1 calibrates cond and uncond curves.",
                    sampler_tooltip="The sampler you will generate with; one that evaluates the model once per "
                    "step (euler, ...) gives exactly one ratio per step."),
                io.String.Input("name", default="my-model",
                                tooltip="File name for the curve (letters, digits, space . _ -); saved in ComfyUI's "
                                "user directory under omni_hooks/magcache/. An existing file of that name is "
                                "replaced."),
            ],
            outputs=[
                io.Latent.Output(tooltip="The sampled latent (every step computed)."),
                io.String.Output(display_name="curve",
                                 tooltip="The recorded curve as JSON: mag_ratios, std and cos_dist per branch, and "
                                 "the CFG-interleaved list."),
            ],
            hidden=[io.Hidden.unique_id],
            is_output_node=True,
        )

    @classmethod
    def validate_inputs(cls, name: str = "") -> bool | str:
        # Only ``name``: with **kwargs ComfyUI would skip the min/max checks of every other input.
        return validate_calibration_name(NODE_TITLE, name)

    @classmethod
    def execute(cls, model, seed: int, steps: int, cfg: float, sampler_name: str, scheduler: str, positive,
                negative, latent_image, name: str) -> io.NodeOutput:
        name = calibration_files.check_name(name)
        adapter = detect_adapter(model)
        settings = settings_for(model, 0.0, 0, 0.0, 0.0, 1.0, "compute device", "auto", calibrate=True)
        cache = AppliedCache(kind=KIND, node_title=NODE_TITLE, node_id=cls.hidden.unique_id, settings=settings)
        latent, sessions = sample_calibrating(model, cache, MagCacheSession, seed, steps, cfg, sampler_name,
                                              scheduler, positive, negative, latent_image)
        result: dict[str, dict[str, list[float]]] = {}
        for session in sessions:
            result.update(session.calibration)
        data = {"family": adapter.family, "variant": adapter.variant, **calibration_data(result),
                "sampler": {"steps": steps, "cfg": cfg, "sampler_name": sampler_name, "scheduler": scheduler}}
        path = calibration_files.save(KIND, name, data)
        lengths = ", ".join(f"{label} {len(values)}" for label, values in data["mag_ratios"].items())
        log.info("OmniHooks %s: recorded %s ratios on %s, saved to %s", NODE_TITLE, lengths, adapter.describe(), path)
        text = json.dumps(data, indent=1)
        return io.NodeOutput(latent, text, ui={"text": [f"saved {path.name}: {lengths} ratios"]})
