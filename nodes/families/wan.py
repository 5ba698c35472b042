"""Wan 2.1 / 2.2 (comfy/ldm/wan/model.py): blocks(x, e=e0, freqs, context, ...) -> x, then head(x, e).

Detected: ``WanModel`` and its subclasses except ``WanModel_S2V`` (its forward injects audio between the blocks). The
variants told apart: Wan 2.2 TI2V, VACE, I2V, and the T2V layout (Wan 2.1 T2V and the Wan 2.2 A14B experts).
"""
from __future__ import annotations

import sys

import comfy.ldm.wan.model as wan
import comfy.model_base
import torch

from ...omni_hooks.blockstack import BlockStack, StackSignal, TensorArg, skip_returning
from ...omni_hooks.sequence_parallel import SequenceParallelInput, SequenceParallelOutput, SequenceParallelSelfAttention
from .base import DEFAULT_SIGNAL, AutoChoice, Expectations, ForwardParameters, ModelFamily, Variant

X = TensorArg("x", 0)

# Sizes of the released checkpoints (Wan-Video/Wan2.1 and Wan2.2 configs): dim -> size name.
_T2V_SIZES = {1536: "1.3B", 5120: "14B"}
_TI2V_5B_DIM = 3072
_I2V_IN_CHANNELS = 36  # latent 16 + mask 4 + image latent 16: Wan 2.1 I2V and the Wan 2.2 I2V A14B experts


def _stack(dm: torch.nn.Module) -> BlockStack:
    # VACE adds hints to x in place between blocks (`x += c_skip * strength`), so keep our own copy of the head input.
    return BlockStack(blocks=list(dm.blocks), tail=dm.head, head_hidden=X, tail_hidden=X,
                      skip_block=skip_returning(X), clone_head_input=isinstance(dm, wan.VaceWanModel))


def _time_embedding(dm: torch.nn.Module) -> StackSignal:
    # default-mode coefficients were fitted on the time embedding e, the input of time_projection
    return StackSignal(compute=lambda block, args, kwargs, captured: captured, capture=dm.time_projection)


def _time_projection(dm: torch.nn.Module) -> StackSignal:
    # retention-mode coefficients were fitted on e0, the 6-way time projection each block receives as `e`
    return StackSignal(compute=lambda block, args, kwargs, captured: kwargs["e"] if "e" in kwargs else args[1])


# Sequence parallelism. Wan makes its tokens inside forward_orig (patch embedding, flatten) and passes them with the
# rotary table `freqs` ([1, L, 1, D/2, 2, 2]) to every block: the tokens are split at the first block, before its
# caches (the block stack starts there), the rotary table at every block, and the head's output [B, L, C·p] is
# gathered before unpatchify. Self-attention runs image-only (`blocks.*.self_attn`); cross-attention to the text keeps
# its replicated keys and runs locally. Classes whose forward adds full-length tensors between the blocks (VACE
# hints, the S2V / Animate / HuMo / Camera subclasses) are refused.
_ROPE_GROUP = "wan_rope"


def _sequence_plan(dm: torch.nn.Module) -> dict:
    if type(dm) is not wan.WanModel:
        raise ValueError(f"Sequence Parallel: {type(dm).__name__} is not supported (its forward adds full-length "
                         "inputs between the blocks); supported: WanModel (Wan 2.1/2.2 T2V, I2V, FLF2V)")
    return {
        "blocks.0": {"x": SequenceParallelInput(split_dim=1, expected_dims=3, auto_pad=True, outside_caches=True)},
        "blocks.*": {"freqs": SequenceParallelInput(split_dim=1, expected_dims=6, auto_pad=True,
                                                    shard_group=_ROPE_GROUP)},
        "blocks.*.self_attn": SequenceParallelSelfAttention(),
        "head": SequenceParallelOutput(gather_dim=1, expected_dims=3),
    }


def _freqs_probe(dm: torch.nn.Module) -> torch.Tensor:
    """The blocks' ``freqs``: the rotary table of a one-frame 2x2 latent, from the method forward makes it with."""
    return dm.rope_encode(1, 2, 2, device=torch.device("cpu"), dtype=torch.float32)


def _attention_sites(dm: torch.nn.Module) -> list[torch.nn.Module]:
    return [block.self_attn for block in dm.blocks]


# WanModel subclasses whose blocks or head the stack does not describe (refused in _refused.py); the modules exist
# only on newer ComfyUI, and a model of them can only exist once its module is imported
_NOT_WAN_STACKS = (("comfy.ldm.wan.model_animate2", "WanAnimate2Model"), ("comfy.ldm.wan.ar_model", "CausalWanModel"),
                   ("comfy.ldm.wan.model_wandancer", "WanDancerModel"))


def _matches(base_model: torch.nn.Module, dm: torch.nn.Module) -> bool:
    other = tuple(getattr(sys.modules.get(module), name) for module, name in _NOT_WAN_STACKS
                  if hasattr(sys.modules.get(module), name))
    return (isinstance(dm, wan.WanModel) and not isinstance(dm, (wan.WanModel_S2V, *other))
            and hasattr(dm, "head"))


def _a14b_note(what: str, key: str) -> str:
    return (f"{what}: choose '{key} (high noise)' on the high-noise model and '{key} (low noise)' on the low-noise "
            f"one (each expert's Apply MagCache uses its own part of the official curve)")


_I2V_RESOLUTION_NOTE = "I2V 480p and 720p have the same weights; 480p coefficients are used unless you choose 720p"


def _variant(base_model: torch.nn.Module, dm: torch.nn.Module) -> Variant:
    size = _T2V_SIZES.get(dm.dim)
    size_label = size or f"dim {dm.dim}"
    if isinstance(base_model, comfy.model_base.WAN22):
        if dm.dim == _TI2V_5B_DIM:
            magcache = AutoChoice("wan2.2_ti2v_5B",
                                  ("for image-to-video with Wan 2.2 TI2V 5B choose 'wan2.2_ti2v_5B_i2v'",))
        else:
            magcache = AutoChoice(None, (
                f"no published MagCache curve for a Wan 2.2 TI2V model with dim {dm.dim}",))
        return Variant(f"Wan 2.2 TI2V (dim {dm.dim})", magcache=magcache, teacache=AutoChoice(
            None, ("no TeaCache coefficients are published for Wan 2.2 TI2V 5B: run TeaCache Calibrate once",)))
    if isinstance(dm, wan.VaceWanModel):
        return Variant(
            f"Wan 2.1 VACE {size_label}",
            teacache=AutoChoice(f"wan2.1_t2v_{size}" if size else None,
                                ("VACE uses the T2V coefficients of its size (VACE is built on Wan 2.1 T2V)",)),
            magcache=AutoChoice(f"wan2.1_vace_{size}" if size else None))
    if dm.model_type == "i2v" or getattr(dm, "img_emb", None) is not None:
        if size == "14B":
            return Variant(
                "Wan 2.1 I2V 14B", teacache=AutoChoice("wan2.1_i2v_480p_14B", (_I2V_RESOLUTION_NOTE,)),
                magcache=AutoChoice("wan2.1_i2v_480p_14B", (
                    "I2V 480p and 720p have the same weights; the 480p curve is used unless you choose "
                    "'wan2.1_i2v_720p_14B'",)))
        return Variant(f"Wan 2.1 I2V {size_label}", teacache=AutoChoice(None, (_I2V_RESOLUTION_NOTE,)),
                       magcache=AutoChoice(None))
    if size is None:
        return Variant(f"Wan T2V {size_label}", magcache=AutoChoice(None), teacache=AutoChoice(
            None, ("the published Wan T2V coefficients are for dim "
                   + " and ".join(f"{dim} ({name})" for dim, name in _T2V_SIZES.items())
                   + f"; this model has dim {dm.dim}",)))
    if size == "1.3B":
        return Variant("Wan T2V 1.3B", teacache=AutoChoice("wan2.1_t2v_1.3B"),
                       magcache=AutoChoice("wan2.1_t2v_1.3B"))
    # 14B with the T2V layout: Wan 2.1 T2V 14B, or a Wan 2.2 A14B expert (same shape, high/low noise cannot be told)
    teacache = AutoChoice("wan2.1_t2v_14B", (
        "Wan 2.2 A14B experts have the Wan 2.1 14B shape; no Wan 2.2 coefficients are published, so the Wan 2.1 14B "
        "ones are used (as in kijai/ComfyUI-WanVideoWrapper)",))
    if dm.patch_embedding.weight.shape[1] == _I2V_IN_CHANNELS:
        # image channels but no CLIP image embedding: a Wan 2.2 I2V A14B expert
        magcache = AutoChoice(None, (_a14b_note("this looks like a Wan 2.2 I2V A14B expert", "wan2.2_i2v_14B"),))
    else:
        magcache = AutoChoice("wan2.1_t2v_14B", (_a14b_note(
            "Wan 2.2 T2V A14B experts have the Wan 2.1 14B shape, so the Wan 2.1 T2V 14B curve is used unless you "
            "choose; for an A14B expert", "wan2.2_t2v_14B"),))
    return Variant("Wan T2V 14B", teacache=teacache, magcache=magcache)


FAMILY = ModelFamily(
    name="wan", display_name="Wan 2.1/2.2", matches=_matches, resolve_variant=_variant, build_stack=_stack,
    signals={DEFAULT_SIGNAL: _time_embedding, "ret": _time_projection},
    resident=("patch_embedding", "text_embedding", "time_embedding", "time_projection", "head",
              "img_emb",                                      # I2V / FLF2V CLIP image projection
              "ref_conv",                                     # Fun reference image
              "vace_patch_embedding", "vace_blocks",          # VACE hints, added between the blocks
              "control_adapter",                              # Camera
              "audio_proj",                                   # HuMo
              "pose_patch_embedding", "motion_encoder", "face_encoder", "face_adapter",   # Animate
              "patch_embedding_pose", "patch_embedding_mask"),                            # SCAIL, SCAIL 2
    sequence_plan=_sequence_plan, attention_sites=_attention_sites,
    auto_keys={"teacache": frozenset({"wan2.1_t2v_1.3B", "wan2.1_t2v_14B", "wan2.1_i2v_480p_14B"}),
                         "magcache": frozenset({"wan2.1_t2v_1.3B", "wan2.1_t2v_14B", "wan2.1_i2v_480p_14B",
                                                "wan2.1_vace_1.3B", "wan2.1_vace_14B", "wan2.2_ti2v_5B"})},
    expects=Expectations(
        blocks={"blocks": ForwardParameters(("x", "e", "freqs", "context", "context_img_len", "transformer_options"),
                                            positions={"x": 0, "e": 1})},
        call=ForwardParameters(("x", "timestep", "context", "clip_fea", "time_dim_concat", "transformer_options",
                                "**kwargs")),
        plan_inputs={("blocks.*", "freqs"): _freqs_probe}))
