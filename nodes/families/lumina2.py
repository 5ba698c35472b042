"""Lumina Image 2.0 (comfy/ldm/lumina/model.py: NextDiT).

``_forward`` runs ``patchify_and_embed`` (its ``context_refiner`` / ``noise_refiner`` layers are the same block class
but are not part of the cached stack), then ``layers`` (``layer(x, mask, freqs_cis, adaln_input, ...)`` -> x, out of
place) over the joint ``[caption | image]`` sequence, then ``final_layer(x, adaln_input)``.

Two published signals, each matching the polynomial fitted on it:
  * ``default`` - the time embedding ``t`` (= ``adaln_input``), what welltop-cn/ComfyUI-TeaCache measures and fitted
    its ``lumina_2`` coefficients on;
  * ``modulated`` - ``layers[0]``'s first modulation ``attention_norm1(x) * (1 + scale_msa)``, what ali-vilab
    TeaCache4Lumina2 measures (``layers[0].norm1(input_to_main_loop, temb)``) for ``lumina2_official_v1``.
"""
from __future__ import annotations

import comfy.ldm.lumina.model as lumina_model
import torch

from ...omni_hooks.blockstack import BlockStack, StackSignal, TensorArg, skip_returning
from .base import DEFAULT_SIGNAL, AutoChoice, Expectations, ForwardParameters, ModelFamily, Variant

X = TensorArg("x", 0)
ADALN = TensorArg("adaln_input", 3)


def lumina_stack(dm: torch.nn.Module) -> BlockStack:
    """``layers`` then ``final_layer`` of a NextDiT (Lumina 2, Z-Image)."""
    # Out-of-place blocks and no ControlNet path: the head input is never modified, no clone needed.
    return BlockStack(blocks=list(dm.layers), tail=dm.final_layer, head_hidden=X, tail_hidden=X,
                      skip_block=skip_returning(X), clone_head_input=False)


def _time_embedding(dm: torch.nn.Module) -> StackSignal:
    return StackSignal(compute=lambda block, args, kwargs, captured: ADALN.get(args, kwargs))


def _first_modulation(dm: torch.nn.Module) -> StackSignal:
    def compute(block, args, kwargs, captured):
        scale_msa = block.adaLN_modulation(ADALN.get(args, kwargs)).chunk(4, dim=1)[0]
        return lumina_model.modulate(block.attention_norm1(X.get(args, kwargs)), scale_msa)
    return StackSignal(compute=compute)


#: A NextDiT's signals (Lumina 2, Z-Image): ``adaln_input``, and "modulated", layers[0]'s first modulation.
LUMINA_SIGNALS = {DEFAULT_SIGNAL: _time_embedding, "modulated": _first_modulation}


def is_z_image(dm: torch.nn.Module) -> bool:
    """True for a NextDiT built as Z-Image (ComfyUI 0.3.75's ``z_image_modulation``): modulated blocks whose
    ``adaLN_modulation`` is one Linear, without Lumina 2's SiLU."""
    if not isinstance(dm, lumina_model.NextDiT) or len(dm.layers) == 0 or not dm.layers[0].modulation:
        return False
    return not isinstance(dm.layers[0].adaLN_modulation[0], torch.nn.SiLU)


def _matches(base_model: torch.nn.Module, dm: torch.nn.Module) -> bool:
    return (isinstance(dm, lumina_model.NextDiT) and len(dm.layers) > 0 and bool(dm.layers[0].modulation)
            and not is_z_image(dm))


def _variant(base_model: torch.nn.Module, dm: torch.nn.Module) -> Variant:
    return Variant(f"Lumina Image 2.0 (dim {dm.dim})", magcache=AutoChoice(None), teacache=AutoChoice(
        "lumina_2", ("the welltop 'lumina_2' and the official ali-vilab 'lumina2_official_v1' coefficients disagree; "
                     "'lumina_2' is used unless you choose the other",)))


FAMILY = ModelFamily(
    name="lumina2", display_name="Lumina Image 2.0", matches=_matches, resolve_variant=_variant,
    build_stack=lumina_stack, signals=LUMINA_SIGNALS,
    resident=("x_embedder", "t_embedder", "cap_embedder", "noise_refiner", "context_refiner", "norm_final",
              "final_layer"),
    auto_keys={"teacache": frozenset({"lumina_2"})},
    expects=Expectations(
        blocks={"layers": ForwardParameters(("x", "x_mask", "freqs_cis", "adaln_input", "transformer_options"),
                                            positions={"x": 0, "adaln_input": 3})},
        call=ForwardParameters(("x", "timesteps", "context", "num_tokens", "attention_mask", "**kwargs"))))
