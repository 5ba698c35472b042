"""LTX-Video (comfy/ldm/lightricks/model.py: LTXVModel).

``_forward`` runs ``transformer_blocks`` (``block(x, context=, attention_mask=, timestep=, pe=, ...)`` -> x, updating
x in place with ``x += ...``) and then, inline, ``norm_out(x)``, the final scale/shift, ``proj_out`` and unpatchify.
``norm_out`` is the first module to receive the stack output, so it is the tail.

Note: this model's forward passes ``keyframe_idxs`` *after* ``transformer_options`` to the DIFFUSION_MODEL wrapper.
"""
from __future__ import annotations

import inspect

import comfy.ldm.common_dit
import comfy.ldm.lightricks.model as ltxv_model
import torch

from ...omni_hooks.blockstack import BlockStack, StackSignal, TensorArg, skip_returning
from ...omni_hooks.sequence_parallel import (SequenceParallelInput, SequenceParallelOutput,
                                             SequenceParallelRefusedInput, SequenceParallelSelfAttention)
from .base import DEFAULT_SIGNAL, AutoChoice, Expectations, ForwardParameters, ModelFamily, Variant, call_arg

X = TensorArg("x", 0)
NORM_INPUT = TensorArg("input", 0)  # norm_out(x): a LayerNorm called positionally

# inner_dim of the released checkpoints: 2B (0.9.x) and 13B (0.9.7+)
_SIZES = {2048: "2B", 4096: "13B"}


def _stack(dm: torch.nn.Module) -> BlockStack:
    # Blocks add into x in place: clone the head input.
    return BlockStack(blocks=list(dm.transformer_blocks), tail=dm.norm_out, head_hidden=X, tail_hidden=NORM_INPUT,
                      skip_block=skip_returning(X), clone_head_input=True)


def _modulated_input(dm: torch.nn.Module) -> StackSignal:
    def compute(block, args, kwargs, captured):
        # The block's first modulation: rms_norm(x) * (1 + scale_msa) + shift_msa from its scale_shift_table and the
        # (per-sample or per-token) timestep projection, as ali-vilab TeaCache4LTX-Video / welltop compute it.
        x = X.get(args, kwargs)
        timestep = call_arg(args, kwargs, "timestep", 3)
        table = block.scale_shift_table
        ada = table[None, None].to(device=x.device, dtype=x.dtype) + timestep.reshape(
            x.shape[0], timestep.shape[1], table.shape[0], -1)
        shift_msa, scale_msa = ada.unbind(dim=2)[:2]
        return comfy.ldm.common_dit.rms_norm(x) * (1 + scale_msa) + shift_msa
    return StackSignal(compute=compute)


# Sequence parallelism. _forward patchifies the latent, computes the RoPE table ``pe`` from the full pixel coordinates
# (keyframe indices, when given, are written into those coordinates first, so guide tokens get their positions before
# anything is split), embeds the tokens (``patchify_proj``) and runs the blocks. ``pe`` is, by host (see rope_spec):
# the pair (cos, sin), each [B, L, inner]; one rotation table [B, 1, L, inner/2, 2, 2]; or the pair (rotation table
# [B, L, heads, head_dim/2, 2, 2], split-layout flag), made by the model's own method.
# The tokens are split at ``patchify_proj``'s output; ``pe`` and the timestep projection (one row per sample, or one
# per token when a denoise mask gives per-token timesteps) are split at every block, before its caches (TeaCache's
# signal reads the timestep). Self-attention ``attn1`` is exchanged; cross-attention ``attn2`` to the text (with its
# mask) keeps the replicated text keys and runs locally. ``norm_out``'s output is gathered: the final per-token
# scale/shift and ``proj_out`` then run on the whole sequence, as unpatchify needs. Newer hosts pass the blocks a
# self-attention mask over the whole sequence for an LTXVAddGuide with a strength or an attention mask: refused.
_TOKENS_GROUP = "ltxv_tokens"
_GUIDE_MASK = "self_attention_mask"


def per_token(expected_dims: int, shard_group: str) -> SequenceParallelInput:
    """A block input with one value per video token in dim 1 (or one for all of them), split before any cache on the
    block, its length recorded for ``shard_group``."""
    return SequenceParallelInput(split_dim=1, expected_dims=expected_dims, auto_pad=True, shard_group=shard_group,
                                 outside_caches=True, broadcast_length_one=True)


def rope_spec(pe, shard_group: str):
    """The plan's spec for a RoPE table ``pe`` over the video tokens, in the layout of this host's RoPE function (a
    sample made as the model makes it), split as ``per_token``."""
    if isinstance(pe, torch.Tensor):  # one rotation table, the tokens in dim 2 (applied with Flux's apply_rope1)
        return SequenceParallelInput(split_dim=2, expected_dims=6, auto_pad=True, shard_group=shard_group,
                                     outside_caches=True)
    if isinstance(pe[1], torch.Tensor):  # (cos, sin)
        return [per_token(3, shard_group), per_token(3, shard_group)]
    return [per_token(6, shard_group), None]  # (rotation table, split-layout flag): the flag is left alone


def guide_mask_refusal(model: str) -> SequenceParallelRefusedInput:
    """The refusal of the blocks' guide self-attention mask (LTXVAddGuide with a strength or an attention_mask)."""
    return SequenceParallelRefusedInput(
        f"Sequence Parallel: {model} with an LTXVAddGuide whose strength is not 1 or that has an attention_mask "
        "is not supported (the guide's self-attention mask spans the whole token sequence); fix: set the guide's "
        "strength to 1 and leave its attention_mask unconnected, or remove Sequence Parallel from this workflow")


def _sequence_plan(dm: torch.nn.Module) -> dict:
    blocks = {"pe": rope_spec(_pe_probe(dm), _TOKENS_GROUP), "timestep": per_token(3, _TOKENS_GROUP)}
    if _GUIDE_MASK in inspect.signature(type(dm.transformer_blocks[0]).forward).parameters:
        blocks[_GUIDE_MASK] = guide_mask_refusal("LTX-Video")
    return {
        "patchify_proj": {0: SequenceParallelInput(split_dim=1, expected_dims=3, split_output=True, auto_pad=True)},
        "transformer_blocks.*": blocks,
        "transformer_blocks.*.attn1": SequenceParallelSelfAttention(),
        "norm_out": SequenceParallelOutput(gather_dim=1, expected_dims=3),
    }


def _pe_probe(dm: torch.nn.Module):
    """What the blocks' ``pe`` is: the RoPE table of two positions, made as _forward makes it (the model's own
    ``_prepare_positional_embeddings`` where it has one, else the module's ``precompute_freqs_cis``)."""
    coords = torch.zeros(1, 3, 2)
    if hasattr(dm, "_prepare_positional_embeddings"):
        return dm._prepare_positional_embeddings(coords, 25.0, torch.float32)
    return ltxv_model.precompute_freqs_cis(coords, dim=dm.inner_dim, out_dtype=torch.float32)


def _attention_sites(dm: torch.nn.Module) -> list[torch.nn.Module]:
    return [block.attn1 for block in dm.transformer_blocks]


def _matches(base_model: torch.nn.Module, dm: torch.nn.Module) -> bool:
    # exact class: newer hosts derive LTX-2's audio-video model (LTXAVModel) from it, with other blocks and inputs
    return type(dm) is ltxv_model.LTXVModel and len(dm.transformer_blocks) > 0


def _variant(base_model: torch.nn.Module, dm: torch.nn.Module) -> Variant:
    size = _SIZES.get(dm.inner_dim) or f"inner_dim {dm.inner_dim}"
    notes = () if size == "2B" else (
        f"the LTX-Video coefficients were fitted on LTX-Video 0.9.1 (2B); for this {size} model TeaCache Calibrate "
        "gives a better fit",)
    return Variant(f"LTX-Video {size}", teacache=AutoChoice("ltxv", notes), magcache=AutoChoice(None))


FAMILY = ModelFamily(
    name="ltxv", display_name="LTX-Video", matches=_matches, resolve_variant=_variant, build_stack=_stack,
    signals={DEFAULT_SIGNAL: _modulated_input},
    # scale_shift_table is a parameter of the model itself (the final modulation), not of a block
    resident=("patchify_proj", "adaln_single", "caption_projection", "scale_shift_table", "norm_out", "proj_out"),
    sequence_plan=_sequence_plan, attention_sites=_attention_sites,
    auto_keys={"teacache": frozenset({"ltxv"})},
    expects=Expectations(
        blocks={"transformer_blocks": ForwardParameters(
            ("x", "context", "attention_mask", "timestep", "pe", "transformer_options"),
            positions={"x": 0, "timestep": 3})},
        call=ForwardParameters(("x", "timestep", "context", "attention_mask", "frame_rate", "transformer_options",
                                "keyframe_idxs", "**kwargs")),
        plan_inputs={("transformer_blocks.*", "pe"): _pe_probe}))
