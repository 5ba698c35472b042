"""Wan 2.1 / 2.2 (comfy/ldm/wan/model.py): blocks(x, e=e0, freqs, context, ...) -> x, then head(x, e)."""
from __future__ import annotations

import comfy.ldm.wan.model as wan
import comfy.model_base
import torch

from ...omni_hooks.blockstack import BlockStack, TensorArg, skip_returning
from ...omni_hooks.teacache import ModulatedInput
from .base import ModelAdapter

X = TensorArg("x", 0)

# Sizes of the released checkpoints (Wan-Video/Wan2.1 and Wan2.2 configs): dim -> size name.
_T2V_SIZES = {1536: "1.3B", 5120: "14B"}


def _stack(dm: torch.nn.Module) -> BlockStack:
    # VACE adds hints to x in place between blocks (`x += c_skip * strength`), so keep our own copy of the head input.
    return BlockStack(blocks=list(dm.blocks), tail=dm.head, head_hidden=X, tail_hidden=X,
                      skip_block=skip_returning(X), clone_head_input=isinstance(dm, wan.VaceWanModel))


def _modulated_input(dm: torch.nn.Module, signal: str) -> ModulatedInput:
    if signal == "ret":
        # retention-mode coefficients were fitted on e0, the 6-way time projection each block receives as `e`
        return ModulatedInput(compute=lambda block, args, kwargs, captured: kwargs["e"] if "e" in kwargs else args[1])
    # default-mode coefficients were fitted on the time embedding e, the input of time_projection
    return ModulatedInput(compute=lambda block, args, kwargs, captured: captured, capture=dm.time_projection)


def detect(base_model: torch.nn.Module, dm: torch.nn.Module) -> ModelAdapter | None:
    if not isinstance(dm, wan.WanModel):
        return None
    if isinstance(dm, wan.WanModel_S2V) or not hasattr(dm, "head"):
        return None
    size = _T2V_SIZES.get(dm.dim)
    notes: list[str] = []
    key = None
    if isinstance(base_model, comfy.model_base.WAN22):
        variant = f"Wan 2.2 TI2V (dim {dm.dim})"
        notes.append("no TeaCache coefficients are published for Wan 2.2 TI2V 5B: run TeaCache Calibrate once")
    elif isinstance(dm, wan.VaceWanModel):
        variant = f"Wan 2.1 VACE {size or f'dim {dm.dim}'}"
        key = f"wan2.1_t2v_{size}" if size else None
        notes.append("VACE uses the T2V coefficients of its size (VACE is built on Wan 2.1 T2V)")
    elif dm.model_type == "i2v" or getattr(dm, "img_emb", None) is not None:
        variant = f"Wan 2.1 I2V {size or f'dim {dm.dim}'}"
        key = "wan2.1_i2v_480p_14B" if size == "14B" else None
        notes.append("I2V 480p and 720p have the same weights; 480p coefficients are used unless you choose 720p")
    else:
        variant = f"Wan T2V {size or f'dim {dm.dim}'}"
        key = f"wan2.1_t2v_{size}" if size else None
        if size == "14B":
            notes.append("Wan 2.2 A14B experts have the Wan 2.1 14B shape; no Wan 2.2 coefficients are published, "
                         "so the Wan 2.1 14B ones are used (as in kijai/ComfyUI-WanVideoWrapper)")
    if key is None and not notes:
        notes.append(f"no published TeaCache coefficients for a Wan model with dim {dm.dim}: choose a model variant "
                     "or run TeaCache Calibrate")
    return ModelAdapter(family="wan", variant=variant, build_stack=_stack, build_modulated_input=_modulated_input,
                        teacache_key=key, notes=notes)
