"""Qwen-Image / Qwen-Image-Edit (comfy/ldm/qwen_image/model.py: QwenImageTransformer2DModel).

``_forward`` runs ``transformer_blocks`` (``block(hidden_states=, encoder_hidden_states=, encoder_hidden_states_mask=,
temb=, image_rotary_emb=, ...)`` -> **(encoder_hidden_states, hidden_states)**, out of place), then
``norm_out(hidden_states, temb)`` and ``proj_out``. Edit reference latents are appended to ``hidden_states`` before
the stack and are still there at ``norm_out``. Newer hosts modulate the reference tokens with timestep zero when the
reference method is "index_timestep_zero" (the blocks then get ``timestep_zero_index``, the first reference token,
and ``temb`` for twice the batch).
"""
from __future__ import annotations

import inspect

import comfy.ldm.qwen_image.model as qwen_model
import torch

from ...omni_hooks.blockstack import BlockStack, StackSignal, TensorArg, skip_returning
from ...omni_hooks.sequence_parallel import (
    SequenceParallelInput,
    SequenceParallelOutput,
    SequenceParallelPartialInput,
    SequenceParallelRefusedInput,
    SequenceParallelSelfAttention,
)
from .base import (DEFAULT_SIGNAL, AutoChoice, Expectations, ForwardParameters, ModelFamily, Variant, call_arg,
                   pe_embedder_probe)

HIDDEN = TensorArg("hidden_states", 0)
ENCODER = TensorArg("encoder_hidden_states", 1)
X = TensorArg("x", 0)  # norm_out(hidden_states, temb)


def _stack(dm: torch.nn.Module) -> BlockStack:
    # Blocks are out of place, but ControlNet adds into the block output in place (`hidden_states[:, :n] += add`);
    # on a skipped call that tensor is the head input itself, so the head input is cloned.
    return BlockStack(blocks=list(dm.transformer_blocks), tail=dm.norm_out, head_hidden=HIDDEN, tail_hidden=X,
                      skip_block=skip_returning(ENCODER, HIDDEN), clone_head_input=True)


def _modulated_input(dm: torch.nn.Module) -> StackSignal:
    def compute(block, args, kwargs, captured):
        # img_norm1(hidden) * (1 + scale1) + shift1 from block 0's img_mod(temb), as vllm-omni's Qwen-Image extractor,
        # by the block's own _modulate (with the reference tokens' timestep-zero modulation where the host has it)
        temb = call_arg(args, kwargs, "temb", 3)
        img_mod1 = block.img_mod(temb).chunk(2, dim=-1)[0]
        zero_index = kwargs.get(_TIMESTEP_ZERO)
        extra = () if zero_index is None else (zero_index,)
        return block._modulate(block.img_norm1(HIDDEN.get(args, kwargs)), img_mod1, *extra)[0]
    return StackSignal(compute=compute)


# Sequence parallelism. _forward embeds the image tokens (Edit reference tokens appended) and passes them with the text
# stream and the RoPE table ``image_rotary_emb`` [B, text + image, 1, D/2, 2, 2] (or [B, 1, text + image, D/2, 2, 2]:
# see attention_is_heads_first) to every block: the image tokens are split at the first block, before its caches (the
# block stack starts there), the table's image part at every block (its text part, ``encoder_hidden_states``' length,
# kept whole). Each block's ``attn`` attends ``[text | image shard]``; ``proj_out``'s output [B, L, p·p·C] (narrower
# than norm_out's) is gathered before unpatchify.
_ROPE_GROUP = "qwen_image_rope"
_TIMESTEP_ZERO = "timestep_zero_index"


def blocks_take_timestep_zero_index() -> bool:
    """Whether this host's blocks modulate the Edit reference tokens with timestep zero (``timestep_zero_index``)."""
    return _TIMESTEP_ZERO in inspect.signature(qwen_model.QwenImageTransformerBlock.forward).parameters


def attention_is_heads_first() -> bool:
    """Whether this host's Qwen-Image attention works on [B, heads, L, D] and rotates with Flux's ``apply_rope1``
    (its module imports it), so that ``image_rotary_emb`` is [B, 1, L, D/2, 2, 2] with the tokens in dim 2, rather
    than [B, L, 1, D/2, 2, 2] with the tokens in dim 1."""
    return hasattr(qwen_model, "apply_rope1")


def _sequence_plan(dm: torch.nn.Module) -> dict:
    blocks = {"image_rotary_emb": SequenceParallelPartialInput(
        split_dim=2 if attention_is_heads_first() else 1, expected_dims=6, auto_pad=True, shard_group=_ROPE_GROUP,
        text_len_source="encoder_hidden_states", text_len_dim=1)}
    if blocks_take_timestep_zero_index():
        # an index into the whole image sequence: on a shard it would modulate the wrong tokens
        blocks[_TIMESTEP_ZERO] = SequenceParallelRefusedInput(
            "Sequence Parallel: Qwen-Image-Edit with the reference latents method 'index_timestep_zero' is not "
            "supported (the reference tokens are modulated by their position in the whole image sequence); fix: "
            "choose another reference latents method, or remove Sequence Parallel from this workflow")
    return {
        "transformer_blocks.0": {"hidden_states": SequenceParallelInput(split_dim=1, expected_dims=3, auto_pad=True,
                                                                        outside_caches=True)},
        "transformer_blocks.*": blocks,
        "transformer_blocks.*.attn": SequenceParallelSelfAttention(joint_tokens="encoder_hidden_states"),
        "proj_out": SequenceParallelOutput(gather_dim=1, expected_dims=3),
    }


def _attention_sites(dm: torch.nn.Module) -> list[torch.nn.Module]:
    return [block.attn for block in dm.transformer_blocks]


def _matches(base_model: torch.nn.Module, dm: torch.nn.Module) -> bool:
    # exact class: QwenImageControlNetModel subclasses it
    return (type(dm) is qwen_model.QwenImageTransformer2DModel and len(dm.transformer_blocks) > 0
            and hasattr(dm, "norm_out"))


def _variant(base_model: torch.nn.Module, dm: torch.nn.Module) -> Variant:
    return Variant(
        "Qwen-Image",
        teacache=AutoChoice("qwen_image", (
            "Qwen-Image and Qwen-Image-Edit have the same weights shape; the coefficients (vllm-omni) were fitted on "
            "Qwen-Image",)),
        magcache=AutoChoice("qwen_image", (
            "Qwen-Image and Qwen-Image-Edit have the same weights shape: for Edit choose 'qwen_image_edit_official'; "
            "'qwen_image_official' is the official 50-step Qwen-Image curve",)))


FAMILY = ModelFamily(
    name="qwen_image", display_name="Qwen-Image", matches=_matches, resolve_variant=_variant, build_stack=_stack,
    signals={DEFAULT_SIGNAL: _modulated_input},
    resident=("img_in", "txt_norm", "txt_in", "time_text_embed", "norm_out", "proj_out"),
    sequence_plan=_sequence_plan, attention_sites=_attention_sites,
    auto_keys={"teacache": frozenset({"qwen_image"}), "magcache": frozenset({"qwen_image"})},
    expects=Expectations(
        blocks={"transformer_blocks": ForwardParameters(
            ("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "temb", "image_rotary_emb",
             "transformer_options"),
            positions={"hidden_states": 0, "encoder_hidden_states": 1, "temb": 3})},
        # 'guidance' (unused by the model) left the call in newer hosts; the pack never read it
        call=ForwardParameters(("x", "timestep", "context", "attention_mask", "ref_latents", "transformer_options",
                                "**kwargs")),
        plan_inputs={("transformer_blocks.*", "image_rotary_emb"): pe_embedder_probe}))
