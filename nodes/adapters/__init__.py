"""Model detection: from the diffusion model's class and config, never from a file name."""
from __future__ import annotations

import torch

from . import chroma, flux, hidream, hunyuan_video, lumina2, ltxv, qwen_image, wan
from .base import ModelAdapter, UnsupportedModelError

# Each detector checks the diffusion model's own class (model_base.Chroma subclasses model_base.Flux, but
# ldm.chroma.model.Chroma and ldm.flux.model.Flux are unrelated classes); Chroma still goes before Flux so that no
# future subclassing can let the Flux detector shadow it.
_DETECTORS = [wan.detect, chroma.detect, flux.detect, hunyuan_video.detect, ltxv.detect, qwen_image.detect,
              lumina2.detect, hidream.detect]
SUPPORTED_FAMILIES = ("Wan 2.1/2.2, Flux (dev, schnell, Kontext), Chroma, HunyuanVideo, LTX-Video, Qwen-Image, "
                      "Lumina Image 2.0, HiDream-I1")


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
