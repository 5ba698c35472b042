"""TeaCache Calibrate: sample once with every step computed, fit the rescale polynomial, save it as a named file."""
from __future__ import annotations

import json
import logging

import comfy.samplers
import nodes as comfy_nodes  # ComfyUI's nodes.py (this pack's own nodes/ package is only imported relatively)
from comfy_api.latest import io

from ..omni_hooks.teacache import fit_coefficients
from . import calibration_files
from .adapters import detect_adapter
from .lifecycle import AppliedCache, attach_cache
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
                io.Model.Input("model", tooltip="The MODEL to calibrate (without a cache node)."),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True,
                             tooltip="The random seed used for creating the noise."),
                io.Int.Input("steps", default=30, min=MIN_STEPS, max=10000,
                             tooltip=f"Sampling steps; each step gives one calibration point per branch "
                             f"(at least {MIN_STEPS})."),
                io.Float.Input("cfg", default=5.0, min=0.0, max=100.0, step=0.1, round=0.01,
                               tooltip="Classifier-free guidance scale; above 1 calibrates cond and uncond."),
                io.Combo.Input("sampler_name", options=comfy.samplers.KSampler.SAMPLERS,
                               tooltip="The sampler you will generate with."),
                io.Combo.Input("scheduler", options=comfy.samplers.KSampler.SCHEDULERS,
                               tooltip="The scheduler you will generate with."),
                io.Conditioning.Input("positive", tooltip="A representative positive prompt."),
                io.Conditioning.Input("negative", tooltip="A representative negative prompt."),
                io.Latent.Input("latent_image", tooltip="A latent of the size you will generate at."),
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
        try:
            calibration_files.check_name(name)
        except ValueError as e:
            return f"{NODE_TITLE}: {e}"
        return True

    @classmethod
    def execute(cls, model, seed: int, steps: int, cfg: float, sampler_name: str, scheduler: str, positive,
                negative, latent_image, name: str) -> io.NodeOutput:
        name = calibration_files.check_name(name)
        adapter = detect_adapter(model)
        settings = settings_for(model, 0.0, 0.0, 1.0, "compute device", "auto", calibrate=True)
        sessions: list[TeaCacheSession] = []

        def session_factory(patcher, cache):
            session = TeaCacheSession(patcher, cache)
            sessions.append(session)
            return session

        cache = AppliedCache(kind="teacache", node_title=NODE_TITLE, node_id=cls.hidden.unique_id, settings=settings)
        calibrating = attach_cache(model, cache, session_factory)
        (latent,) = comfy_nodes.common_ksampler(calibrating, seed, steps, cfg, sampler_name, scheduler, positive,
                                                negative, latent_image)
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
