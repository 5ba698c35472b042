"""HunyuanVideo 1.5 and its distilled super-resolution model (ComfyUI's ``HunyuanVideo15`` and
``HunyuanVideo15_SR_Distilled``; comfy/ldm/hunyuan_video/model.py: ``HunyuanVideo`` built with ``vision_in_dim``).

The forward is HunyuanVideo's (``nodes/families/hunyuan_video.py``): Flux's ``flipped_img_txt`` double blocks (the
released models have no single blocks), text at the rear, ``final_layer``. What 1.5 adds lives on the text side:
a cond-type embedding, the ByT5 glyph tokens and (image-to-video) the SigLIP ``vision_in`` tokens are prepended to
the text, so the sequence plan, the stack and the TeaCache signal are HunyuanVideo's. The SR model takes the
low-resolution latent as 66 extra input channels and a mean-flow ``time_r_in`` embedding.

ComfyUI before 0.3.75 has no HunyuanVideo 1.5: its HunyuanVideo has no ``vision_in_dim`` and nothing matches.
"""
from __future__ import annotations

import comfy.ldm.hunyuan_video.model as hy_model
import comfy.model_base
import torch

from .base import ModelFamily, AutoChoice, Variant
from .flux import flux_layout_attention_sites, flux_layout_stack
from .hunyuan_video import FAMILY as HUNYUAN_VIDEO, is_hunyuan_video15


def _matches(base_model: torch.nn.Module, dm: torch.nn.Module) -> bool:
    return (isinstance(dm, hy_model.HunyuanVideo) and is_hunyuan_video15(dm) and len(dm.double_blocks) > 0
            and hasattr(dm, "final_layer"))


def _variant(base_model: torch.nn.Module, dm: torch.nn.Module) -> Variant:
    # the class exists only on ComfyUI >= 0.3.75; isinstance(x, ()) is False
    sr_class = getattr(comfy.model_base, "HunyuanVideo15_SR_Distilled", ())
    if isinstance(base_model, sr_class):
        calibrate = ("no {what} are published for the HunyuanVideo 1.5 super-resolution model: run {node} once on "
                     "it (it is step-distilled: with few steps the caches keep the first and last steps and skip "
                     "little)")
        return Variant("HunyuanVideo 1.5 super-resolution (distilled)",
                       teacache=AutoChoice(None, (calibrate.format(what="TeaCache coefficients",
                                                                   node="TeaCache Calibrate"),)),
                       magcache=AutoChoice(None, (calibrate.format(what="MagCache curves",
                                                                   node="MagCache Calibrate"),)))
    return Variant(
        "HunyuanVideo 1.5",
        teacache=AutoChoice(None, unpublished="HunyuanVideo 1.5"),
        magcache=AutoChoice("hunyuan_video1.5", (
            "the 'hunyuan_video1.5' curve was calibrated at 20 steps with CFG; above 20 steps choose "
            "'hunyuan_video1.5_40steps'; for the CFG- or step-distilled checkpoints run MagCache Calibrate",)))


FAMILY = ModelFamily(
    name="hunyuan_video15", display_name="HunyuanVideo 1.5 (and its super-resolution model)", matches=_matches,
    resolve_variant=_variant, build_stack=flux_layout_stack,
    signals=HUNYUAN_VIDEO.signals,
    resident=(*HUNYUAN_VIDEO.resident, "vision_in", "cond_type_embedding"),
    sequence_plan=HUNYUAN_VIDEO.sequence_plan, attention_sites=flux_layout_attention_sites,
    auto_keys={"magcache": frozenset({"hunyuan_video1.5"})})
