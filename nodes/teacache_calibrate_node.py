"""TeaCache Calibrate: sample once with every step computed, fit the rescale polynomial, save it as a named file."""
from __future__ import annotations

import json
import logging

from comfy_api.latest import io

from ..omni_hooks.teacache import fit_coefficients
from . import calibration_files
from .adapters import detect_adapter
from .lifecycle import AppliedCache
from .node_inputs import calibration_sampler_inputs, sample_calibrating, validate_calibration_name
from .teacache_node import TeaCacheSession, settings_for

NODE_ID = "OmniHooks.TeaCacheCalibrate"
NODE_TITLE = "TeaCache Calibrate"
MIN_STEPS = 8
log = logging.getLogger("OmniHooks")


class TeaCacheCalibrate(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID,
            display_name=f"{NODE_TITLE} (OmniHooks)",
            category="OmniHooks",
            description=("A KSampler that computes every step and records how much the model's modulated input and its "
                         "block-stack output change from step to step, then fits TeaCache's polynomial and saves it "
                         "under 'name'. Apply TeaCache lists it as 'calibration: <name>'. Use the sampler settings "
                         "you will generate with; more steps and prompts give a better fit."),
            inputs=[
                *calibration_sampler_inputs(
                    MIN_STEPS, steps_tooltip=f"Sampling steps; each step gives one calibration point per branch "
                    f"(at least {MIN_STEPS}).",
                    cfg_tooltip="Classifier-free guidance scale; above 1 calibrates cond and uncond.",
                    sampler_tooltip="The sampler you will generate with."),
                io.String.Input("name", default="my-model",
                                tooltip="File name for the fitted coefficients (letters, digits, space . _ -); "
                                "saved in ComfyUI's user directory under omni_hooks/teacache/. An existing file "
                                "of that name is replaced."),
            ],
            outputs=[
                io.Latent.Output(tooltip="The sampled latent (every step computed)."),
                io.String.Output(display_name="coefficients",
                                 tooltip="The fitted polynomial and its data, as JSON."),
            ],
            hidden=[io.Hidden.unique_id],
            is_output_node=True,
        )

    @classmethod
    def validate_inputs(cls, name: str = "") -> bool | str:
        # Only ``name``: with **kwargs ComfyUI would skip the min/max checks of every other input and repeat this
        # message once per input.
        return validate_calibration_name(NODE_TITLE, name)

    @classmethod
    def execute(cls, model, seed: int, steps: int, cfg: float, sampler_name: str, scheduler: str, positive,
                negative, latent_image, name: str) -> io.NodeOutput:
        name = calibration_files.check_name(name)
        adapter = detect_adapter(model)
        settings = settings_for(model, 0.0, 0.0, 1.0, "compute device", "auto", calibrate=True)
        cache = AppliedCache(kind="teacache", node_title=NODE_TITLE, node_id=cls.hidden.unique_id, settings=settings)
        latent, sessions = sample_calibrating(model, cache, TeaCacheSession, seed, steps, cfg, sampler_name,
                                              scheduler, positive, negative, latent_image)
        pairs = [p for s in sessions for p in s.calibration_pairs]
        try:
            coefficients = fit_coefficients(pairs)
        except ValueError as e:
            raise ValueError(f"{NODE_TITLE}: {e}") from None
        data = {
            "kind": "teacache",
            "family": adapter.family,
            "variant": adapter.variant,
            "signal": "default",
            "coefficients": coefficients,
            "points": len(pairs),
            "input_change_range": [min(p[0] for p in pairs), max(p[0] for p in pairs)],
            "output_change_range": [min(p[1] for p in pairs), max(p[1] for p in pairs)],
            "sampler": {"steps": steps, "cfg": cfg, "sampler_name": sampler_name, "scheduler": scheduler},
        }
        path = calibration_files.save("teacache", name, data)
        log.info("OmniHooks %s: fitted %s from %d points, saved to %s", NODE_TITLE, coefficients, len(pairs), path)
        text = json.dumps(data, indent=1)
        return io.NodeOutput(latent, text, ui={"text": [f"saved {path.name}: {coefficients}"]})
