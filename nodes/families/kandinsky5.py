"""Kandinsky 5 video and image (ComfyUI's ``Kandinsky5`` / ``Kandinsky5Image``; comfy/ldm/kandinsky5/model.py:
``Kandinsky5``, ComfyUI 0.33).

``forward_orig`` embeds the text and runs it through ``text_transformer_blocks`` (outside the stack: they see only
the text and the time), patchifies the latent into ``visual_embed`` [B, T, H, W, D], flattens it to [B, N, D] and
runs ``visual_transformer_blocks`` (``block(visual_embed, text_embed, time_embed, freqs=...)`` -> visual_embed; self
attention over the video tokens, cross attention to the text). It then reshapes the tokens back to the grid and calls
``out_layer(visual_embed, time_embed)``, the tail: its input is read and written as the [B, N, D] tokens
(``GridTokens``), so a residual has the head input's shape.

Sequence Parallel: none. The stack's output is reshaped to the latent grid inside the forward, between the last block
and the final layer, where there is no module to gather split tokens back at.

ComfyUI before 0.33 has no Kandinsky 5: the class is probed from its module only when that module is loaded.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import comfy.model_base
import torch

from ...omni_hooks.blockstack import ArgsKwargs, BlockStack, TensorArg, skip_returning
from ...omni_hooks.teacache import ModulatedInput
from .base import Expectations, ForwardParameters, ModelFamily, Variant, calibrate_first, call_arg

VISUAL = TensorArg("visual_embed", 0)
_MODULE = "comfy.ldm.kandinsky5.model"
# model_dim of the released video checkpoints (Kandinsky 5.0 Video Lite 2B, Pro 19B); the image model is 2560
_VIDEO_SIZES = {1792: "Lite", 4096: "Pro"}

@dataclass(frozen=True)
class GridTokens:
    """A [B, T, H, W, D] grid argument read as its [B, T*H*W, D] tokens (and written back as the grid)."""

    name: str
    index: int

    def get(self, args: tuple, kwargs: dict) -> torch.Tensor:
        return TensorArg(self.name, self.index).get(args, kwargs).flatten(1, -2)

    def replace(self, args: tuple, kwargs: dict, value: torch.Tensor) -> ArgsKwargs:
        where = TensorArg(self.name, self.index)
        return where.replace(args, kwargs, value.reshape(where.get(args, kwargs).shape))


def _model_module():
    return sys.modules.get(_MODULE)


def _stack(dm: torch.nn.Module) -> BlockStack:
    # the blocks return new tensors (addcmul), so the head input needs no copy
    return BlockStack(blocks=list(dm.visual_transformer_blocks), tail=dm.out_layer, head_hidden=VISUAL,
                      tail_hidden=GridTokens("visual_embed", 0), skip_block=skip_returning(VISUAL),
                      clone_head_input=False)


def _modulated_input(dm: torch.nn.Module, signal: str) -> ModulatedInput:
    k5 = _model_module()

    def compute(block, args, kwargs, captured):
        # the first block's self-attention input: norm(x) * (1 + scale) + shift from its visual modulation of the
        # time embedding, with the model's own functions (the input TeaCache measures on Wan and HunyuanVideo)
        x = VISUAL.get(args, kwargs)
        time_embed = call_arg(args, kwargs, "time_embed", 2)
        self_attn_params = torch.chunk(block.visual_modulation(time_embed), 3, dim=-1)[0]
        shift, scale, _gate = k5.get_shift_scale_gate(self_attn_params)
        return k5.apply_scale_shift_norm(block.self_attention_norm, x, scale, shift)
    return ModulatedInput(compute=compute)


def _matches(base_model: torch.nn.Module, dm: torch.nn.Module) -> bool:
    cls = getattr(_model_module(), "Kandinsky5", ())
    return isinstance(dm, cls) and len(dm.visual_transformer_blocks) > 0


def _variant(base_model: torch.nn.Module, dm: torch.nn.Module) -> Variant:
    image = isinstance(base_model, getattr(comfy.model_base, "Kandinsky5Image", ()))
    name = ("Kandinsky 5 image" if image else
            f"Kandinsky 5 video {_VIDEO_SIZES.get(dm.model_dim) or f'(model_dim {dm.model_dim})'}")
    return calibrate_first(name, "Kandinsky 5")


FAMILY = ModelFamily(
    name="kandinsky5", display_name="Kandinsky 5 (video and image)", matches=_matches, resolve_variant=_variant,
    build_stack=_stack, build_modulated_input=_modulated_input,
    # the text side (its own blocks, outside the stack), the embeddings and the final layer
    resident=("time_embeddings", "text_embeddings", "pooled_text_embeddings", "visual_embeddings",
              "text_transformer_blocks", "out_layer"),
    sequence_refusal=("its block stack's output is reshaped to the latent grid inside the forward, between the last "
                      "block and the final layer, where split tokens cannot be gathered back; the caches and CPU "
                      "Offload work on it"),
    expects=Expectations(
        blocks={"visual_transformer_blocks": ForwardParameters(
            ("visual_embed", "text_embed", "time_embed", "freqs", "transformer_options"),
            positions={"visual_embed": 0, "time_embed": 2})},
        call=ForwardParameters(("x", "timestep", "context", "y", "time_dim_replace", "transformer_options",
                                "**kwargs"))))
