"""Diffusion models at any size, built from ComfyUI's own classes on the meta device: no memory, no weights.

For tests of what depends only on a model's classes and shapes (family detection, variant resolution, which modules
hold which weights) at the sizes of released checkpoints, which the tiny models cannot have. Nothing can run them.
Import only after ComfyUI's root is on ``sys.path`` (``tests/host/conftest.py`` puts it there).
"""
from __future__ import annotations

import torch

import comfy.model_detection
import comfy.model_patcher

from omnitest.host_config import unet_config_for_host


def build_on_meta(unet_config: dict) -> comfy.model_patcher.ModelPatcher:
    """The ModelPatcher ComfyUI would build for a checkpoint with this ``unet_config``, its weights on the meta
    device. ValueError when no ``comfy.supported_models`` class matches the config."""
    model_config = comfy.model_detection.model_config_from_unet_config(unet_config_for_host(unet_config))
    if model_config is None:
        raise ValueError(f"no comfy.supported_models class matches {unet_config}")
    model_config.set_inference_dtype(torch.bfloat16, None)
    model = model_config.get_model({}, "", device=torch.device("meta"))
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)
