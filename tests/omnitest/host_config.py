"""A hand-written ``unet_config`` completed for the host it runs on: newer ComfyUI made some model features required
arguments of a family's params dataclass. Each such field is added, with the value that leaves the feature off, only
where the host's dataclass declares it (probed, not switched on the ComfyUI version)."""
from __future__ import annotations

import dataclasses
import importlib

#: image_model -> (module, params dataclass, {field: value that leaves the feature off})
FEATURES_OFF: dict[str, tuple[str, str, dict]] = {
    "hunyuan_video": ("comfy.ldm.hunyuan_video.model", "HunyuanVideoParams",
                      {"use_cond_type_embedding": False, "vision_in_dim": None}),
}


def unet_config_for_host(unet_config: dict) -> dict:
    """A copy of ``unet_config`` plus each ``FEATURES_OFF`` field its family's params dataclass declares on this
    host and the config does not set."""
    config = dict(unet_config)
    entry = FEATURES_OFF.get(config.get("image_model"))
    if entry is not None:
        module, name, off = entry
        declared = {f.name for f in dataclasses.fields(getattr(importlib.import_module(module), name))}
        config.update({key: value for key, value in off.items() if key in declared and key not in config})
    return config
