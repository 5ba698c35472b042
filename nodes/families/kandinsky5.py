"""Kandinsky 5 video and image (ComfyUI's ``Kandinsky5`` / ``Kandinsky5Image``; comfy/ldm/kandinsky5/model.py:
``Kandinsky5``, ComfyUI 0.33).

``forward_orig`` embeds the text and runs it through ``text_transformer_blocks`` (outside the stack: they see only
the text and the time), patchifies the latent into ``visual_embed`` [B, T, H, W, D], flattens it to [B, N, D] and
runs ``visual_transformer_blocks`` (``block(visual_embed, text_embed, time_embed, freqs=...)`` -> visual_embed; self
attention over the video tokens, cross attention to the text). It then reshapes the tokens back to the grid and calls
``out_layer(visual_embed, time_embed)``. No module receives the tokens as the blocks made them, so the stack's last
block is its own tail (``ReturnedHidden``): a cache stores and reuses the residual of that block's output.

Sequence Parallel: the tokens are split at the first visual block, before its caches (the stack starts there), the
RoPE table ``freqs`` [1, N, 1, D/2, 2, 2] at every visual block, and the last visual block's output is gathered
before the forward reshapes it to the grid, after its caches (which see, store and reuse this rank's shard: the
gather is ``outside_caches``). Self-attention of the visual blocks is exchanged; their cross-attention to the text
keeps the text keys every rank holds and runs locally. The text blocks run whole on every rank: their
self-attention is over the text only (its own 1-D RoPE table ``freqs_text``), which every rank holds. Video and
image (one latent frame) split alike; a token count the world size does not divide pads the last shard.

ComfyUI before 0.33 has no Kandinsky 5: the class is probed from its module only when that module is loaded.
"""
from __future__ import annotations

import sys

import comfy.model_base
import torch

from ...omni_hooks.blockstack import BlockStack, ReturnedHidden, StackSignal, TensorArg, skip_returning
from ...omni_hooks.sequence_parallel import SequenceParallelInput, SequenceParallelOutput, SequenceParallelSelfAttention
from .base import (DEFAULT_SIGNAL, Expectations, ForwardParameters, ModelFamily, Variant, call_arg,
                   nothing_published)

VISUAL = TensorArg("visual_embed", 0)
_MODULE = "comfy.ldm.kandinsky5.model"
# model_dim of the released video checkpoints (Kandinsky 5.0 Video Lite 2B, Pro 19B); the image model is 2560
_VIDEO_SIZES = {1792: "Lite", 4096: "Pro"}


def _model_module():
    return sys.modules.get(_MODULE)


def _stack(dm: torch.nn.Module) -> BlockStack:
    # the blocks return new tensors (addcmul), so the head input needs no copy
    blocks = list(dm.visual_transformer_blocks)
    return BlockStack(blocks=blocks, tail=blocks[-1], head_hidden=VISUAL, tail_hidden=ReturnedHidden(),
                      skip_block=skip_returning(VISUAL), clone_head_input=False)


def _modulated_input(dm: torch.nn.Module) -> StackSignal:
    k5 = _model_module()

    def compute(block, args, kwargs, captured):
        # the first block's self-attention input: norm(x) * (1 + scale) + shift from its visual modulation of the
        # time embedding, with the model's own functions (the input TeaCache measures on Wan and HunyuanVideo)
        x = VISUAL.get(args, kwargs)
        time_embed = call_arg(args, kwargs, "time_embed", 2)
        self_attn_params = torch.chunk(block.visual_modulation(time_embed), 3, dim=-1)[0]
        shift, scale, _gate = k5.get_shift_scale_gate(self_attn_params)
        return k5.apply_scale_shift_norm(block.self_attention_norm, x, scale, shift)
    return StackSignal(compute=compute)


_ROPE_GROUP = "kandinsky5_rope"


def _sequence_plan(dm: torch.nn.Module) -> dict:
    split_tokens = {"visual_embed": SequenceParallelInput(split_dim=1, expected_dims=3, auto_pad=True,
                                                          outside_caches=True)}
    # both before the caches: one block's split specs must agree on it, and a model of one block takes both at once
    split_table = {"freqs": SequenceParallelInput(split_dim=1, expected_dims=6, auto_pad=True, shard_group=_ROPE_GROUP,
                                                  outside_caches=True)}
    gather_tokens = SequenceParallelOutput(gather_dim=1, expected_dims=3, outside_caches=True)
    last = len(dm.visual_transformer_blocks) - 1
    if last == 0:  # one spec per module id: the only block takes the split, and "*" names it for the gather
        blocks = {"visual_transformer_blocks.0": {**split_tokens, **split_table},
                  "visual_transformer_blocks.*": gather_tokens}
    else:
        blocks = {"visual_transformer_blocks.0": split_tokens, "visual_transformer_blocks.*": split_table,
                  f"visual_transformer_blocks.{last}": gather_tokens}
    return {**blocks, "visual_transformer_blocks.*.self_attention": SequenceParallelSelfAttention()}


def _freqs_probe(dm: torch.nn.Module) -> torch.Tensor:
    """The visual blocks' ``freqs``: the RoPE table of a one-frame 2x2-patch latent, made by the model's own method."""
    return dm.rope_encode_3d(1, 4, 4, device=torch.device("cpu"), dtype=torch.float32)


def _attention_sites(dm: torch.nn.Module) -> list[torch.nn.Module]:
    return [block.self_attention for block in dm.visual_transformer_blocks]


def _matches(base_model: torch.nn.Module, dm: torch.nn.Module) -> bool:
    cls = getattr(_model_module(), "Kandinsky5", ())
    return isinstance(dm, cls) and len(dm.visual_transformer_blocks) > 0


def _variant(base_model: torch.nn.Module, dm: torch.nn.Module) -> Variant:
    image = isinstance(base_model, getattr(comfy.model_base, "Kandinsky5Image", ()))
    name = ("Kandinsky 5 image" if image else
            f"Kandinsky 5 video {_VIDEO_SIZES.get(dm.model_dim) or f'(model_dim {dm.model_dim})'}")
    return nothing_published(name, "Kandinsky 5")


FAMILY = ModelFamily(
    name="kandinsky5", display_name="Kandinsky 5 (video and image)", matches=_matches, resolve_variant=_variant,
    build_stack=_stack, signals={DEFAULT_SIGNAL: _modulated_input},
    # the text side (its own blocks, outside the stack), the embeddings and the final layer
    resident=("time_embeddings", "text_embeddings", "pooled_text_embeddings", "visual_embeddings",
              "text_transformer_blocks", "out_layer"),
    sequence_plan=_sequence_plan, attention_sites=_attention_sites,
    expects=Expectations(
        blocks={"visual_transformer_blocks": ForwardParameters(
            ("visual_embed", "text_embed", "time_embed", "freqs", "transformer_options"),
            positions={"visual_embed": 0, "time_embed": 2})},
        call=ForwardParameters(("x", "timestep", "context", "y", "time_dim_replace", "transformer_options",
                                "**kwargs")),
        plan_inputs={("visual_transformer_blocks.*", "freqs"): _freqs_probe,
                     ("visual_transformer_blocks.0", "freqs"): _freqs_probe}))
