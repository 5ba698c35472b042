"""Flux 2 (ComfyUI's ``Flux2``; comfy/ldm/flux/model.py: the ``Flux`` class built with ``global_modulation``).

The same forward as Flux (``nodes/families/flux.py``): ``double_blocks`` then ``single_blocks`` over
``cat(txt, img)``, then ``final_layer``; but no block owns a modulation: forward_orig computes it once per call
(``double_stream_modulation_img`` / ``_txt``, ``single_stream_modulation``) and passes each double block
``vec = ((img_mod1, img_mod2), (txt_mod1, txt_mod2))`` and each single block ``vec = mod``. The text is padded to 512
tokens by ComfyUI (``model_base.Flux2.extra_conds``) and the RoPE ids have four axes; the sequence plan is Flux's.

ComfyUI before 0.3.75 has no Flux 2: ``FluxParams`` there has no ``global_modulation`` and nothing matches.
"""
from __future__ import annotations

import comfy.ldm.flux.layers as flux_layers
import comfy.ldm.flux.model as flux_model
import torch

from ...omni_hooks.blockstack import StackSignal
from .base import DEFAULT_SIGNAL, ModelFamily, AutoChoice, Variant, call_arg
from .flux import IMG, flux_layout_attention_sites, flux_layout_sequence_plan, flux_layout_stack


def is_flux2(dm: torch.nn.Module) -> bool:
    """True for ComfyUI's Flux class built as Flux 2 (block modulation computed outside the blocks)."""
    return type(dm) is flux_model.Flux and bool(getattr(dm.params, "global_modulation", False))


def _modulated_input(dm: torch.nn.Module) -> StackSignal:
    def compute(block, args, kwargs, captured):
        # Flux's TeaCache signal, img_norm1(img) * (1 + scale) + shift, with the shared img_mod1 the forward passes
        (img_mod1, _), _ = call_arg(args, kwargs, "vec", 2)
        return flux_layers.apply_mod(block.img_norm1(IMG.get(args, kwargs)), 1 + img_mod1.scale, img_mod1.shift)
    return StackSignal(compute=compute)


def _matches(base_model: torch.nn.Module, dm: torch.nn.Module) -> bool:
    return is_flux2(dm) and len(dm.double_blocks) > 0 and hasattr(dm, "final_layer")


_NO_TEACACHE = ("no TeaCache coefficients are fitted for Flux 2 (vllm-omni's are Qwen-Image's, marked there as "
                "'need to be tuned'): run TeaCache Calibrate once on this model, then choose the calibration",)


def _variant(base_model: torch.nn.Module, dm: torch.nn.Module) -> Variant:
    size = f"hidden {dm.hidden_size}, {len(dm.double_blocks)}+{len(dm.single_blocks)} blocks"
    if not dm.params.guidance_embed:
        return Variant(f"Flux 2 without guidance embedding ({size})", teacache=AutoChoice(None, _NO_TEACACHE),
                       magcache=AutoChoice(None, (
                           "the published Flux 2 MagCache curve is for Flux 2 dev (guidance embedding, 28 steps): "
                           "run MagCache Calibrate once on this model, or choose 'flux2' to try it",)))
    return Variant(f"Flux 2 dev ({size})", teacache=AutoChoice(None, _NO_TEACACHE), magcache=AutoChoice("flux2", (
        "the Flux 2 curve (vllm-omni) was calibrated at 28 steps; at very different step counts run MagCache "
        "Calibrate",)))


FAMILY = ModelFamily(
    name="flux2", display_name="Flux 2", matches=_matches, resolve_variant=_variant,
    build_stack=flux_layout_stack, signals={DEFAULT_SIGNAL: _modulated_input},
    resident=("img_in", "time_in", "guidance_in", "txt_in", "final_layer", "double_stream_modulation_img",
              "double_stream_modulation_txt", "single_stream_modulation"),
    sequence_plan=flux_layout_sequence_plan, attention_sites=flux_layout_attention_sites,
    auto_keys={"magcache": frozenset({"flux2"})})
