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


def _a14b_note(what: str, key: str) -> str:
    return (f"{what}: choose '{key} (high noise)' on the high-noise model and '{key} (low noise)' on the low-noise "
            f"one (each expert's Apply MagCache uses its own part of the official curve)")


def _magcache_curve(base_model: torch.nn.Module, dm: torch.nn.Module, size: str | None
                    ) -> tuple[str | None, list[str]]:
    """The published MagCache curve (nodes/magcache_curves.py) for this Wan model, and notes for the user."""
    if isinstance(base_model, comfy.model_base.WAN22):
        if dm.dim == 3072:  # Wan 2.2 TI2V 5B
            return "wan2.2_ti2v_5B", ["for image-to-video with Wan 2.2 TI2V 5B choose 'wan2.2_ti2v_5B_i2v'"]
        return None, [f"no published MagCache curve for a Wan 2.2 TI2V model with dim {dm.dim}"]
    if isinstance(dm, wan.VaceWanModel):
        return (f"wan2.1_vace_{size}", []) if size else (None, [])
    if dm.model_type == "i2v" or getattr(dm, "img_emb", None) is not None:
        if size == "14B":
            return "wan2.1_i2v_480p_14B", ["I2V 480p and 720p have the same weights; the 480p curve is used unless "
                                           "you choose 'wan2.1_i2v_720p_14B'"]
        return None, []
    if size == "14B" and dm.patch_embedding.weight.shape[1] == 36:
        # image channels but no CLIP image embedding: the Wan 2.2 I2V A14B experts (high/low noise cannot be told)
        return None, [_a14b_note("this looks like a Wan 2.2 I2V A14B expert", "wan2.2_i2v_14B")]
    if size is None:
        return None, []
    notes = [_a14b_note("Wan 2.2 T2V A14B experts have the Wan 2.1 14B shape, so the Wan 2.1 T2V 14B curve is used "
                        "unless you choose; for an A14B expert", "wan2.2_t2v_14B")] if size == "14B" else []
    return f"wan2.1_t2v_{size}", notes


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
    magcache_key, magcache_notes = _magcache_curve(base_model, dm, size)
    return ModelAdapter(family="wan", variant=variant, build_stack=_stack, build_modulated_input=_modulated_input,
                        teacache_key=key, notes=notes, magcache_key=magcache_key, magcache_notes=magcache_notes)
