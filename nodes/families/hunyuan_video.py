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

from ...omni_hooks.blockstack import StackSignal, TensorArg
from ...omni_hooks.sequence_parallel import SequenceParallelRefusedInput
from .base import (DEFAULT_SIGNAL, AutoChoice, Expectations, ForwardParameters, ModelFamily, Variant, call_arg,
                   pe_embedder_probe)
from .flux import (FLUX_LAYOUT_BLOCKS, flux_img_modulated, flux_layout_attention_sites, flux_layout_sequence_plan,
                   flux_layout_stack)

IMG = TensorArg("img", 0)


def _modulated_input(dm: torch.nn.Module) -> StackSignal:
    def compute(block, args, kwargs, captured):
        # modulation_dims_img is set for I2V with guiding_frame_index (vec then has one row per token range)
        return flux_img_modulated(block, IMG.get(args, kwargs), call_arg(args, kwargs, "vec", 2),
                                  call_arg(args, kwargs, "modulation_dims_img", 5))
    return StackSignal(compute=compute)


# Sequence parallelism: the Flux-layout plan, with the text at the rear (``flux_layout_sequence_plan``: the double
# blocks are flipped_img_txt). As ``img_in``'s output is split, forward_orig measures ``img_len`` on the shard, and
# the attention mask it builds over ``[image | text]`` (padded text tokens masked) is this rank's key mask, which the
# attention entry exchanges; the token refiner in ``txt_in`` attends locally over the whole text. Besides a
# ControlNet's ``control``, two inputs are refused at the call: ``guiding_frame_index`` (I2V "v2 (replace)": per-token
# modulation ranges over the whole sequence) and ``ref_latent`` (``img_in`` runs twice and the reference tokens are
# prepended apart).
def _refused(name: str, why: str) -> SequenceParallelRefusedInput:
    return SequenceParallelRefusedInput(f"Sequence Parallel: HunyuanVideo called with {name} is not supported ({why}); "
                                        f"fix: remove Sequence Parallel from this workflow, or sample without {name}")


def _sequence_plan(dm: torch.nn.Module) -> dict:
    plan = flux_layout_sequence_plan(dm)
    plan[""] = {**plan[""],
                "guiding_frame_index": _refused("guiding_frame_index", "the I2V 'v2 (replace)' conditioning modulates "
                                                                       "token ranges of the whole image sequence"),
                "ref_latent": _refused("ref_latent", "its reference tokens are embedded apart and prepended to the "
                                                     "image tokens")}
    return plan


def is_hunyuan_video15(dm: torch.nn.Module) -> bool:
    """True for a HunyuanVideo built as HunyuanVideo 1.5 (ComfyUI 0.3.75: a SigLIP ``vision_in_dim``), the
    hunyuan_video15 family."""
    return getattr(dm, "vision_in_dim", None) is not None


def _matches(base_model: torch.nn.Module, dm: torch.nn.Module) -> bool:
    return (isinstance(dm, hy_model.HunyuanVideo) and not is_hunyuan_video15(dm) and len(dm.double_blocks) > 0
            and hasattr(dm, "final_layer"))


def _variant(base_model: torch.nn.Module, dm: torch.nn.Module) -> Variant:
    if isinstance(base_model, comfy.model_base.HunyuanImage21) or len(dm.patch_size) != 3:
        refiner = isinstance(base_model, comfy.model_base.HunyuanImage21Refiner)
        return Variant(
            "HunyuanImage 2.1" + (" refiner" if refiner else ""),
            teacache=AutoChoice(None, ("no TeaCache coefficients are published for HunyuanImage 2.1: run "
                                       "TeaCache Calibrate once",)),
            magcache=AutoChoice(None, ("the HunyuanVideo curves do not fit HunyuanImage 2.1",)))
    resolution_note = ("the 'hunyuan_video' curve was calibrated at 720p; below 720p choose "
                       "'hunyuan_video_544p_official'")
    if isinstance(base_model, (comfy.model_base.HunyuanVideoI2V, comfy.model_base.HunyuanVideoSkyreelsI2V)):
        return Variant(
            "HunyuanVideo I2V" if isinstance(base_model, comfy.model_base.HunyuanVideoI2V)
            else "HunyuanVideo SkyReels I2V",
            teacache=AutoChoice("hunyuan_video", (
                "the HunyuanVideo coefficients were fitted on the T2V model; they are used for I2V as in "
                "welltop-cn/ComfyUI-TeaCache",)),
            magcache=AutoChoice("hunyuan_video", (
                resolution_note, "the MagCache curves were calibrated on HunyuanVideo T2V")))
    return Variant("HunyuanVideo T2V", teacache=AutoChoice("hunyuan_video"),
                   magcache=AutoChoice("hunyuan_video", (resolution_note,)))


FAMILY = ModelFamily(
    name="hunyuan_video", display_name="HunyuanVideo", matches=_matches, resolve_variant=_variant,
    build_stack=flux_layout_stack, signals={DEFAULT_SIGNAL: _modulated_input},
    resident=("img_in", "time_in", "vector_in", "guidance_in", "txt_in", "byt5_in", "time_r_in", "final_layer"),
    sequence_plan=_sequence_plan, attention_sites=flux_layout_attention_sites,
    auto_keys={"teacache": frozenset({"hunyuan_video"}), "magcache": frozenset({"hunyuan_video"})},
    expects=Expectations(
        blocks=FLUX_LAYOUT_BLOCKS,
        call=ForwardParameters(("x", "timestep", "context", "y", "txt_byt5", "guidance", "attention_mask",
                                "guiding_frame_index", "ref_latent", "disable_time_r", "control", "transformer_options",
                                "**kwargs")),
        plan_inputs={("pe_embedder", 0): pe_embedder_probe}))
