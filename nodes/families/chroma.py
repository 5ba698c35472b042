"""Chroma (comfy/ldm/chroma/model.py: Chroma); Chroma Radiance is not supported.

Flux's stack layout with Chroma's own blocks: ``double_blocks`` (``block(img=, txt=, vec=(img_mods, txt_mods), pe=,
...)`` -> (img, txt), updating ``img`` and ``txt`` in place with ``addcmul_``), ``img = cat((txt, img), 1)``,
``single_blocks`` (``block(img, vec=mod, ...)`` -> x, in place), text tokens sliced off, ``final_layer(img, vec=)``.
Blocks listed in ``skip_mmdit`` / ``skip_dit`` are never called, so they are left out of the stack.

Chroma Radiance (a subclass) has no ``final_layer``: its stack output goes through a per-patch NeRF head that
reshapes it, so there is no module whose input is the stack output with the head input's shape.
"""
from __future__ import annotations

import comfy.ldm.chroma.model as chroma_model
import torch

from ...omni_hooks.blockstack import BlockStack, StackSignal, TensorArg, skip_returning
from .base import (DEFAULT_SIGNAL, AutoChoice, Expectations, ForwardParameters, ModelFamily, Variant, call_arg,
                   pe_embedder_probe, skip_by_type)
from .flux import flux_layout_attention_sites, flux_layout_sequence_plan

IMG = TensorArg("img", 0)
TXT = TensorArg("txt", 1)
X = TensorArg("x", 0)


def _stack(dm: torch.nn.Module) -> BlockStack:
    skip_mmdit = set(getattr(dm, "skip_mmdit", []) or [])
    skip_dit = set(getattr(dm, "skip_dit", []) or [])
    blocks = [b for i, b in enumerate(dm.double_blocks) if i not in skip_mmdit]
    blocks += [b for i, b in enumerate(dm.single_blocks) if i not in skip_dit]
    # Double blocks update img in place (`img.addcmul_`): the head input must be cloned before they run.
    return BlockStack(blocks=blocks, tail=dm.final_layer, head_hidden=IMG, tail_hidden=X, clone_head_input=True,
                      skip_block=skip_by_type(_skip_rules_by_own_block_classes(dm)))


def _skip_rules_by_own_block_classes(dm: torch.nn.Module) -> dict:
    """The skip rule of each block class the model's own ``double_blocks`` and ``single_blocks`` hold: Chroma's
    blocks are classes of comfy/ldm/chroma/layers.py on some hosts and Flux's (built without modulation) on others.
    ValueError when one class is in both lists (its blocks would return different things)."""
    double = {type(block) for block in dm.double_blocks}
    single = {type(block) for block in dm.single_blocks}
    if double & single:
        raise ValueError(f"{type(dm).__name__}: block classes {sorted(c.__name__ for c in double & single)} are both "
                         "double and single blocks")
    return {**{cls: skip_returning(IMG, TXT) for cls in double}, **{cls: skip_returning(X) for cls in single}}


def _modulated_input(dm: torch.nn.Module) -> StackSignal:
    def compute(block, args, kwargs, captured):
        # vec = ((img_mod1, img_mod2), (txt_mod1, txt_mod2)), slices of the Approximator output for this block
        img_mod1 = call_arg(args, kwargs, "vec", 3)[0][0]
        return torch.addcmul(img_mod1.shift, 1 + img_mod1.scale, block.img_norm1(IMG.get(args, kwargs)))
    return StackSignal(compute=compute)


def _matches(base_model: torch.nn.Module, dm: torch.nn.Module) -> bool:
    if type(dm) is not chroma_model.Chroma:  # excludes ChromaRadiance (see the module docstring)
        return False
    skip_mmdit = set(getattr(dm, "skip_mmdit", []) or [])
    return hasattr(dm, "final_layer") and not all(i in skip_mmdit for i in range(len(dm.double_blocks)))


def _variant(base_model: torch.nn.Module, dm: torch.nn.Module) -> Variant:
    return Variant("Chroma", magcache=AutoChoice("chroma"), teacache=AutoChoice(None, (
        "no TeaCache coefficients are published for Chroma (ali-vilab/TeaCache#72): run TeaCache Calibrate once on "
        "this model and choose its calibration file",)))


FAMILY = ModelFamily(
    name="chroma", display_name="Chroma", matches=_matches, resolve_variant=_variant, build_stack=_stack,
    signals={DEFAULT_SIGNAL: _modulated_input},
    # blocks listed in skip_mmdit / skip_dit are never called: they are neither in the stack nor resident
    resident=("img_in", "txt_in", "distilled_guidance_layer", "final_layer"),
    # Chroma's forward has Flux's modules and names (img_in, pe_embedder, double/single blocks, final_layer): the same
    # plan; blocks in skip_mmdit / skip_dit carry hooks that never run
    sequence_plan=flux_layout_sequence_plan, attention_sites=flux_layout_attention_sites,
    auto_keys={"magcache": frozenset({"chroma"})},
    # model_base.Chroma subclasses model_base.Flux (ldm.chroma.model.Chroma and ldm.flux.model.Flux are unrelated
    # classes today): Chroma is tried first so that no future subclassing lets Flux's matcher take it
    detect_before=("flux",),
    # Chroma's blocks have taken ``vec`` before and after ``pe``: it is read by name only
    expects=Expectations(
        blocks={"double_blocks": ForwardParameters(("img", "txt", "pe", "vec", "attn_mask", "transformer_options"),
                                                   positions={"img": 0, "txt": 1}),
                "single_blocks": ForwardParameters(("x", "pe", "vec", "attn_mask", "transformer_options"),
                                                   positions={"x": 0})},
        call=ForwardParameters(("x", "timestep", "context", "guidance", "control", "transformer_options", "**kwargs")),
        plan_inputs={("pe_embedder", 0): pe_embedder_probe}))
