"""Model detection: from the diffusion model's class and config, never from a file name."""
from __future__ import annotations

import torch

from . import wan
from .base import ModelAdapter, UnsupportedModelError

_DETECTORS = [wan.detect]
SUPPORTED_FAMILIES = "Wan 2.1/2.2"


def detect_adapter(patcher) -> ModelAdapter:
    """The adapter for a ComfyUI MODEL (ModelPatcher); UnsupportedModelError naming the model class otherwise."""
    base_model = patcher.model
    dm = getattr(base_model, "diffusion_model", None)
    if isinstance(dm, torch.nn.Module):
        for detect in _DETECTORS:
            adapter = detect(base_model, dm)
            if adapter is not None:
                return adapter
    name = type(dm).__name__ if dm is not None else type(base_model).__name__
    raise UnsupportedModelError(
        f"{name} ({type(base_model).__name__}) is not a diffusion transformer this pack supports. "
        f"Supported families: {SUPPORTED_FAMILIES}.")


__all__ = ["ModelAdapter", "UnsupportedModelError", "detect_adapter", "SUPPORTED_FAMILIES"]
