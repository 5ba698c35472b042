"""A hand-written ``unet_config`` completed for the host it runs on, by the host itself.

Newer ComfyUI releases add required fields to a family's params dataclass (``FluxParams.txt_ids_dims``,
``ChromaParams.vec_in_dim``, ``HunyuanVideoParams.meanflow_sum``, ...) that ``comfy.model_detection`` fills in from a
checkpoint's keys. A config written for an older host lacks them. Each field the host's dataclass requires (no default)
and the config does not set takes the value the host's own ``model_detection.detect_unet_config`` gives the model's
weights: the model is built once on the meta device with those fields as ``None`` (no memory, no weights), and
detection reads its state-dict keys and shapes. A feature the tiny model has no weights for is detected off; a field
that is a family's fixed layout (Flux 2's ``txt_ids_dims``) gets the family's value. Nothing is switched on the
ComfyUI version, and a release that adds another such field needs no change here.
"""
from __future__ import annotations

import dataclasses
import importlib

import torch

#: image_model -> (module, name) of the params dataclass its diffusion model is built from
PARAMS_DATACLASS: dict[str, tuple[str, str]] = {
    "flux": ("comfy.ldm.flux.model", "FluxParams"),
    "flux2": ("comfy.ldm.flux.model", "FluxParams"),
    "chroma": ("comfy.ldm.chroma.model", "ChromaParams"),
    "chroma_radiance": ("comfy.ldm.chroma_radiance.model", "ChromaRadianceParams"),
    "hunyuan_video": ("comfy.ldm.hunyuan_video.model", "HunyuanVideoParams"),
}


def missing_required_fields(unet_config: dict) -> list[str]:
    """The fields the host's params dataclass for this config's ``image_model`` requires and the config lacks."""
    entry = PARAMS_DATACLASS.get(unet_config.get("image_model"))
    if entry is None:
        return []
    try:
        params = getattr(importlib.import_module(entry[0]), entry[1])
    except (ImportError, AttributeError):  # a family this host does not have
        return []
    return [f.name for f in dataclasses.fields(params) if f.name not in unet_config
            and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


def unet_config_for_host(unet_config: dict) -> dict:
    """A copy of ``unet_config`` plus every ``missing_required_fields`` field, valued as the host's model detection
    values it for a checkpoint with this config's weights. RuntimeError when the host cannot say."""
    import comfy.model_detection

    config = dict(unet_config)
    missing = missing_required_fields(config)
    if not missing:
        return config
    probe = comfy.model_detection.model_config_from_unet_config({**config, **dict.fromkeys(missing)})
    if probe is None:
        raise RuntimeError(f"no comfy.supported_models class matches {config}")
    meta = torch.device("meta")
    weights = probe.get_model({}, "", device=meta).diffusion_model.state_dict()
    detected = comfy.model_detection.detect_unet_config(weights, "") or {}
    undetected = [name for name in missing if name not in detected]
    if undetected:
        raise RuntimeError(f"this ComfyUI requires {undetected} for image_model {config['image_model']!r} and its "
                           "model detection does not set them for the tiny model's weights: add them to the config")
    config.update({name: detected[name] for name in missing})
    return config
