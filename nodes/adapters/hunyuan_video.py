"""HunyuanVideo T2V / I2V (and HunyuanImage 2.1, same class) - comfy/ldm/hunyuan_video/model.py: HunyuanVideo.

forward_orig runs Flux's ``DoubleStreamBlock`` (``flipped_img_txt``; ``block(img=, txt=, vec=, pe=, attn_mask=,
modulation_dims_img=, modulation_dims_txt=, ...)`` -> (img, txt)), then ``img = cat((img, txt), 1)`` through Flux's
``SingleStreamBlock`` (``block(img, vec=, ...)`` -> x, in place), keeps the first ``img_len`` tokens and calls
``final_layer(img, vec, modulation_dims=)``.

With ``ref_latent`` (HunyuanVideo I2V "v2" conditioning) the reference tokens are prepended to ``img`` before the
stack and cut off before ``final_layer``, so the tail's image stream is shorter than the head's. Nothing special is
done for it: the hook library sees the shape mismatch, computes such calls fully and reports a warning.
"""
from __future__ import annotations

import comfy.ldm.hunyuan_video.model as hy_model
import comfy.model_base
import torch

from ...omni_hooks.blockstack import TensorArg
from ...omni_hooks.teacache import ModulatedInput
from .base import ModelAdapter, call_arg
from .flux import flux_img_modulated, flux_layout_stack

IMG = TensorArg("img", 0)


def _modulated_input(dm: torch.nn.Module, signal: str) -> ModulatedInput:
    def compute(block, args, kwargs, captured):
        # modulation_dims_img is set for I2V with guiding_frame_index (vec then has one row per token range)
        return flux_img_modulated(block, IMG.get(args, kwargs), call_arg(args, kwargs, "vec", 2),
                                  call_arg(args, kwargs, "modulation_dims_img", 5))
    return ModulatedInput(compute=compute)


def detect(base_model: torch.nn.Module, dm: torch.nn.Module) -> ModelAdapter | None:
    if not isinstance(dm, hy_model.HunyuanVideo):
        return None
    if not len(dm.double_blocks) or not hasattr(dm, "final_layer"):
        return None
    notes: list[str] = []
    key = "hunyuan_video"
    magcache_key, magcache_notes = "hunyuan_video", ["the 'hunyuan_video' curve was calibrated at 720p; below 720p "
                                                     "choose 'hunyuan_video_544p_official'"]
    if isinstance(base_model, comfy.model_base.HunyuanImage21) or len(dm.patch_size) != 3:
        variant = "HunyuanImage 2.1" + (" refiner" if isinstance(base_model, comfy.model_base.HunyuanImage21Refiner)
                                        else "")
        key = None
        notes.append("no TeaCache coefficients are published for HunyuanImage 2.1: run TeaCache Calibrate once")
        magcache_key, magcache_notes = None, ["the HunyuanVideo curves do not fit HunyuanImage 2.1"]
    elif isinstance(base_model, (comfy.model_base.HunyuanVideoI2V, comfy.model_base.HunyuanVideoSkyreelsI2V)):
        variant = "HunyuanVideo I2V" if isinstance(base_model, comfy.model_base.HunyuanVideoI2V) \
            else "HunyuanVideo SkyReels I2V"
        notes.append("the HunyuanVideo coefficients were fitted on the T2V model; they are used for I2V as in "
                     "welltop-cn/ComfyUI-TeaCache")
        magcache_notes.append("the MagCache curves were calibrated on HunyuanVideo T2V")
    else:
        variant = "HunyuanVideo T2V"
    return ModelAdapter(family="hunyuan_video", variant=variant, build_stack=flux_layout_stack,
                        build_modulated_input=_modulated_input, teacache_key=key, notes=notes,
                        magcache_key=magcache_key, magcache_notes=magcache_notes)
