"""Flux dev / schnell / Kontext / Fill (comfy/ldm/flux/model.py: Flux).

forward_orig runs ``double_blocks`` (``block(img=, txt=, vec=, pe=, attn_mask=, transformer_options=)`` -> (img, txt)),
then ``img = cat((txt, img), 1)`` through ``single_blocks`` (``block(img, vec=, ...)`` -> img), slices the text
tokens off and calls ``final_layer(img, vec)``. The head's ``img`` and the tail's ``img`` have the same tokens (Kontext
reference tokens are appended to ``img`` before the stack and are still there at the tail).
"""
from __future__ import annotations

import comfy.ldm.flux.layers as flux_layers
import comfy.ldm.flux.model as flux_model
import torch

from ...omni_hooks.blockstack import BlockStack, StackSignal, TensorArg, skip_returning
from ...omni_hooks.sequence_parallel import (
    ReplicatedTokens,
    SequenceParallelInput,
    SequenceParallelOutput,
    SequenceParallelPartialInput,
    SequenceParallelRefusedInput,
    SequenceParallelSelfAttention,
)
from .base import (DEFAULT_SIGNAL, AutoChoice, Expectations, ForwardParameters, ModelFamily, Variant, call_arg,
                   pe_embedder_probe, skip_by_type)

IMG = TensorArg("img", 0)
TXT = TensorArg("txt", 1)
X = TensorArg("x", 0)  # single blocks and final_layer take the image stream as their first argument


def flux_img_modulated(block: torch.nn.Module, img: torch.Tensor, vec: torch.Tensor, modulation_dims=None
                       ) -> torch.Tensor:
    """The TeaCache signal of a Flux-layout double block: ``img_norm1(img) * (1 + img_mod1.scale) + img_mod1.shift``.

    Exactly the first modulation the block computes (ali-vilab TeaCache4FLUX, welltop ComfyUI-TeaCache), from the
    block's own ``img_mod`` and ``img_norm1``. ``apply_mod`` only writes in place into the fresh norm output.
    """
    img_mod1, _ = block.img_mod(vec)
    return flux_layers.apply_mod(block.img_norm1(img), 1 + img_mod1.scale, img_mod1.shift, modulation_dims)


def flux_layout_stack(dm: torch.nn.Module) -> BlockStack:
    """Flux-layout double blocks then single blocks, then ``final_layer`` (Flux, HunyuanVideo)."""
    # Single blocks add in place (`x += ...`) and ControlNet adds into `img` after each double block in place (on a
    # skipped call that `img` is the head input itself), so the head input is cloned.
    return BlockStack(blocks=[*dm.double_blocks, *dm.single_blocks], tail=dm.final_layer, head_hidden=IMG,
                      tail_hidden=X, clone_head_input=True,
                      skip_block=skip_by_type({flux_layers.DoubleStreamBlock: skip_returning(IMG, TXT),
                                               flux_layers.SingleStreamBlock: skip_returning(X)}))


def _modulated_input(dm: torch.nn.Module) -> StackSignal:
    def compute(block, args, kwargs, captured):
        return flux_img_modulated(block, IMG.get(args, kwargs), call_arg(args, kwargs, "vec", 2))
    return StackSignal(compute=compute)


# Sequence parallelism (Flux, Chroma, and HunyuanVideo, whose forward has the same modules and names with the text
# after the image). forward_orig embeds the image tokens (``img_in``) and makes the RoPE table ``pe`` [B, 1, text +
# image, D/2, 2, 2] from the text and image ids (``pe_embedder``) before any block; both are split where they are made:
# the image tokens (Kontext reference tokens included) into one shard per rank, the table's image part alike with its
# text part whole. Double blocks attend ``[txt | img shard]`` from two streams (the text length is their ``txt``);
# single blocks attend ``x = cat(txt, img shard)`` (the text length is x minus the shard); double blocks built with
# ``flipped_img_txt`` (HunyuanVideo) put the text at the rear of all three instead. ``final_layer``'s output
# [B, L, C·p·p] is gathered before unpatchify. The cached stack (double blocks .. final_layer) sees this rank's shard.
# A ControlNet's ``control`` residuals (full sequence, added between the blocks) are refused at the call.
_ROPE_GROUP = "flux_rope"


def flux_layout_sequence_plan(dm: torch.nn.Module) -> dict:
    """The sequence plan of a Flux-layout model whose forward calls ``img_in``, ``pe_embedder`` (ids ``[txt | img]``),
    ``double_blocks`` (``block(img=, txt=, pe=, ...)``, attention over ``[txt | img]``), ``single_blocks``
    (``block(x, pe=, ...)``, x = ``[txt | img]``) and ``final_layer`` (Flux, Chroma); with double blocks built with
    ``flipped_img_txt`` all three are ``[img | txt]`` (HunyuanVideo). ValueError when only some blocks are flipped."""
    flipped = [i for i, block in enumerate(dm.double_blocks) if getattr(block, "flipped_img_txt", False)]
    if flipped and len(flipped) != len(dm.double_blocks):
        raise ValueError(f"Sequence Parallel: {type(dm).__name__} has double blocks with and without flipped_img_txt "
                         f"(flipped: {flipped}); the Flux-layout plan needs one text position for every block")
    text = "rear" if flipped else "front"
    return {
        "": {"control": SequenceParallelRefusedInput(
            f"Sequence Parallel: {type(dm).__name__} with a ControlNet is not supported (its residuals cover the "
            "whole image sequence and are added between the blocks); fix: remove Sequence Parallel or the ControlNet "
            "from this workflow")},
        "img_in": {0: SequenceParallelInput(split_dim=1, expected_dims=3, split_output=True, auto_pad=True)},
        "pe_embedder": {0: SequenceParallelPartialInput(
            split_dim=2, expected_dims=6, split_output=True, auto_pad=True, shard_group=_ROPE_GROUP,
            text_len_source=ReplicatedTokens("ids", dim=1, beside="sequence"), text_position=text)},
        "double_blocks.*": SequenceParallelSelfAttention(joint_tokens="txt", joint_position=text),
        "single_blocks.*": SequenceParallelSelfAttention(joint_tokens=ReplicatedTokens("x"), joint_position=text),
        "final_layer": SequenceParallelOutput(gather_dim=1, expected_dims=3),
    }


def flux_layout_attention_sites(dm: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks ``flux_layout_sequence_plan`` marks as self-attention sites: every double and single block."""
    return [*dm.double_blocks, *dm.single_blocks]


#: The Flux-layout blocks as the code above calls and reads them (Flux, HunyuanVideo).
FLUX_LAYOUT_BLOCKS = {
    "double_blocks": ForwardParameters(
        ("img", "txt", "vec", "pe", "attn_mask", "modulation_dims_img", "modulation_dims_txt", "transformer_options"),
        positions={"img": 0, "txt": 1, "vec": 2, "modulation_dims_img": 5}),
    "single_blocks": ForwardParameters(("x", "vec", "pe", "attn_mask", "modulation_dims", "transformer_options"),
                                       positions={"x": 0}),
}


def _matches(base_model: torch.nn.Module, dm: torch.nn.Module) -> bool:
    # exact class: ControlNetFlux subclasses Flux but is never a MODEL's diffusion model; Flux 2 (the same class with
    # global_modulation: no modulation in the blocks) is the flux2 family
    return (type(dm) is flux_model.Flux and not getattr(dm.params, "global_modulation", False)
            and len(dm.double_blocks) > 0 and hasattr(dm, "final_layer"))


def _variant(base_model: torch.nn.Module, dm: torch.nn.Module) -> Variant:
    if not dm.params.guidance_embed:
        # No coefficients are published for schnell (a 1-4 step model: with the first and last step always
        # computed there is almost nothing to skip). The dev polynomial is not silently reused.
        return Variant(
            "Flux schnell (no guidance embedding)",
            teacache=AutoChoice(None, (
                "no TeaCache coefficients are published for Flux schnell or other models without guidance "
                "embedding; choose 'flux' to use the Flux dev coefficients, or run TeaCache Calibrate",)),
            magcache=AutoChoice(None, (
                "no MagCache curve is published for Flux schnell or other models without guidance embedding: "
                "choose 'flux', or run MagCache Calibrate",)))
    variant = "Flux dev"
    if dm.params.in_channels != 16:
        variant += f" (in_channels {dm.params.in_channels}: Fill/Depth/Canny)"
    return Variant(
        variant,
        teacache=AutoChoice("flux", (
            "Flux Kontext has the same weights shape as Flux dev: a run whose conditioning carries reference "
            "latents (Kontext's) uses the 'flux-kontext' coefficients and their 0.2-0.9 window",),
            with_reference="flux-kontext"),
        magcache=AutoChoice("flux", (
            "Flux Kontext has the same weights shape as Flux dev: a run whose conditioning carries reference "
            "latents (Kontext's) uses the 'flux_kontext_official' curve (choose 'flux_kontext', ComfyUI-MagCache's "
            "20-step curve, if you prefer it)",), with_reference="flux_kontext_official"))


FAMILY = ModelFamily(
    name="flux", display_name="Flux (dev, schnell, Kontext)", matches=_matches, resolve_variant=_variant,
    build_stack=flux_layout_stack, signals={DEFAULT_SIGNAL: _modulated_input},
    resident=("img_in", "time_in", "vector_in", "guidance_in", "txt_in", "final_layer"),
    sequence_plan=flux_layout_sequence_plan, attention_sites=flux_layout_attention_sites,
    auto_keys={"teacache": frozenset({"flux"}), "magcache": frozenset({"flux"})},
    expects=Expectations(
        blocks=FLUX_LAYOUT_BLOCKS,
        call=ForwardParameters(("x", "timestep", "context", "y", "guidance", "ref_latents", "control",
                                "transformer_options", "**kwargs")),
        plan_inputs={("pe_embedder", 0): pe_embedder_probe}))
