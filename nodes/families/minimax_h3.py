"""MiniMax-H3, audio and video (ComfyUI's ``MiniMaxH3``; comfy/ldm/minimax/model.py: ``MiniMaxH3Model``, ComfyUI 0.33).

``_forward`` packs ONE sequence without a batch dimension, ``h`` [S, hidden]: the text (refined by ``token_refiner``
once per sampling run, in ``extra_conds``), then the keyframe or reference rows, then the target audio, then the
target video (``PackedLayout.segments``). It embeds the timesteps once (``t_emb``, one row per distinct timestep and
modality) and runs ``blocks``: ``block(h, t_emb, mod_segments, rope_freqs, transformer_options=)`` -> h, where
``mod_segments`` lists ``(start, stop, mod row)`` spans of the sequence, each modulated with its own row. Every block
adds its gated attention and MLP outputs to ``h`` in place and returns it. Then ``final_layer(h, t_emb, video_seg,
audio_seg)`` (the tail) reads the video and audio spans. The caches store one residual over the whole packed
sequence, text and conditioning rows included, so they decide on video and audio together (as for LTX-2).

Sequence Parallel: none (``sequence_refusal``).

ComfyUI before 0.33 has no MiniMax-H3: the class is probed from its module only when that module is loaded, so
nothing matches there.
"""
from __future__ import annotations

import sys

import torch

from ...omni_hooks.blockstack import BlockStack, StackSignal, TensorArg, skip_returning
from .base import (DEFAULT_SIGNAL, Expectations, ForwardParameters, ModelFamily, Variant, call_arg,
                   nothing_published)

_MODULE = "comfy.ldm.minimax.model"
X = TensorArg("x", 0)  # the packed sequence [S, hidden] a block receives and returns, and final_layer receives
# hidden_size of the released checkpoint (ComfyUI's class defaults: 50 blocks)
_RELEASED_HIDDEN = 5376


def _model_module():
    return sys.modules.get(_MODULE)


def _stack(dm: torch.nn.Module) -> BlockStack:
    # the blocks add their outputs into x in place (_mod_gate), so the head input is cloned before they run
    return BlockStack(blocks=list(dm.blocks), tail=dm.final_layer, head_hidden=X, tail_hidden=X,
                      skip_block=skip_returning(X), clone_head_input=True)


def _modulated_input(dm: torch.nn.Module) -> StackSignal:
    mm = _model_module()

    def compute(block, args, kwargs, captured):
        # The first block's self-attention input: norm1(x) scaled and shifted segment by segment with the block's
        # own adaLN rows of the timestep embedding, by the model's own _mod_scale_shift (the input TeaCache measures
        # on Wan, HunyuanVideo and LTX-Video), over the whole packed sequence.
        x = X.get(args, kwargs)
        shift, scale = block.adaln_proj(call_arg(args, kwargs, "t_emb", 1))[:2]
        return mm._mod_scale_shift(block.norm1(x), shift, scale, call_arg(args, kwargs, "mod_segments", 2))
    return StackSignal(compute=compute)


def _matches(base_model: torch.nn.Module, dm: torch.nn.Module) -> bool:
    cls = getattr(_model_module(), "MiniMaxH3Model", ())
    return isinstance(dm, cls) and len(dm.blocks) > 0


def _variant(base_model: torch.nn.Module, dm: torch.nn.Module) -> Variant:
    name = "MiniMax-H3" if dm.hidden_size == _RELEASED_HIDDEN else f"MiniMax-H3 (hidden {dm.hidden_size})"
    if dm.use_adaln_curves:
        name += ", adaLN curve form"
    return nothing_published(name, "MiniMax-H3", "a calibration measures the video and the audio together")


FAMILY = ModelFamily(
    name="minimax_h3", display_name="MiniMax-H3 (audio and video)", matches=_matches, resolve_variant=_variant,
    build_stack=_stack, signals={DEFAULT_SIGNAL: _modulated_input},
    # the patch and text projections, the text refiner, the timestep embedding (a time embedder, or the curve table
    # of the curve-form checkpoints), the rotary frequencies and the final layer with both output heads
    resident=("video_patch_proj", "audio_patch_proj", "condition_proj", "token_refiner", "time_embedder",
              "adaln_t_table", "rope", "final_layer"),
    sequence_refusal=("its blocks take one packed sequence of text, reference, audio and video tokens that is "
                      "modulated span by span at absolute token positions, and its final layer reads the audio and "
                      "video spans at absolute positions, so a token split would cut the spans both address; the "
                      "caches and CPU Offload work on it"),
    expects=Expectations(
        blocks={"blocks": ForwardParameters(("x", "t_emb", "mod_segments", "rope_freqs", "transformer_options"),
                                            positions={"x": 0, "t_emb": 1, "mod_segments": 2})},
        call=ForwardParameters(("x", "timestep", "context", "transformer_options", "minimax_payload", "denoise_mask",
                                "audio_denoise_mask", "**kwargs"))))
