"""LTX-2, audio and video (ComfyUI's ``LTXAV``; comfy/ldm/lightricks/av_model.py: ``LTXAVModel``, ComfyUI 0.33).

``_process_transformer_blocks`` runs ``transformer_blocks``: ``block((vx, ax), v_context=, a_context=, v_timestep=,
a_timestep=, v_pe=, a_pe=, ...)`` -> ``(vx, ax)``, each block updating both streams in place (video and audio
self-attention, text cross-attention, audio-to-video and video-to-audio cross-attention, feed-forwards). Then
``_process_output`` sends the video stream through ``norm_out`` (LTX-Video's output) and the audio stream through
``audio_norm_out``. The stack is one stack of two streams: the caches read the block's ``(vx, ax)`` as one packed
tensor, so they decide on video and audio together and store one residual over both, and each stream's share is
added at its own tail (``norm_out``, then ``audio_norm_out``).

Sequence Parallel: none. Every block's audio-to-video and video-to-audio cross-attention lets each stream attend to
the other's whole sequence; a token split of either stream would cut those keys, and the pack exchanges keys only for
self-attention.

ComfyUI before 0.33 has no LTX-2: the class is probed from its module only when that module is loaded, so nothing
matches there.
"""
from __future__ import annotations

import sys

import comfy.ldm.common_dit
import torch

from ...omni_hooks.blockstack import BlockStack, PackedStreams, TensorArg, pack_streams, skip_returning
from ...omni_hooks.teacache import ModulatedInput
from .base import Expectations, ForwardParameters, ModelFamily, Variant, calibrate_first, call_arg

X = TensorArg("x", 0)  # the (video, audio) pair a block receives and returns
NORM_INPUT = TensorArg("input", 0)  # norm_out(vx), audio_norm_out(ax): LayerNorms called positionally

# inner_dim (video) of the released checkpoints: LTX-2 19B
_SIZES = {4096: "19B"}

def _av_model_class() -> type | tuple:
    """``LTXAVModel`` when ComfyUI's module is loaded (a model of it can only exist then), else ()."""
    return getattr(sys.modules.get("comfy.ldm.lightricks.av_model"), "LTXAVModel", ())


def _stack(dm: torch.nn.Module) -> BlockStack:
    # Packing the two streams copies them, so the head input needs no clone although the blocks add in place.
    return BlockStack(blocks=list(dm.transformer_blocks), tail=dm.norm_out, head_hidden=PackedStreams("x", 0),
                      tail_hidden=NORM_INPUT, skip_block=skip_returning(X), clone_head_input=False,
                      stream_tails=[(dm.audio_norm_out, NORM_INPUT)])


def _modulated_input(dm: torch.nn.Module, signal: str) -> ModulatedInput:
    def compute(block, args, kwargs, captured):
        # The first block's self-attention inputs of both streams, rms_norm(x) * (1 + scale_msa) + shift_msa, each
        # from its own scale_shift_table and timestep (the block's own get_ada_values), packed: the LTX-Video signal
        # (ali-vilab TeaCache4LTX-Video) taken on video and audio. An empty audio stream adds nothing.
        vx, ax = X.get(args, kwargs)
        streams = []
        for x, table, timestep in ((vx, block.scale_shift_table, call_arg(args, kwargs, "v_timestep", 4)),
                                   (ax, block.audio_scale_shift_table, call_arg(args, kwargs, "a_timestep", 5))):
            shift, scale = block.get_ada_values(table, x.shape[0], timestep, slice(0, 2))
            streams.append(comfy.ldm.common_dit.rms_norm(x) * (1 + scale) + shift)
        return pack_streams(streams)
    return ModulatedInput(compute=compute)


def _matches(base_model: torch.nn.Module, dm: torch.nn.Module) -> bool:
    return isinstance(dm, _av_model_class()) and len(dm.transformer_blocks) > 0


def _variant(base_model: torch.nn.Module, dm: torch.nn.Module) -> Variant:
    size = _SIZES.get(dm.inner_dim) or f"inner_dim {dm.inner_dim}"
    return calibrate_first(f"LTX-2 {size}", "LTX-2", "a calibration measures the video and the audio together")


FAMILY = ModelFamily(
    name="ltxav", display_name="LTX-2 (audio and video)", matches=_matches, resolve_variant=_variant,
    build_stack=_stack, build_modulated_input=_modulated_input,
    # the LTX-Video side (scale_shift_table: the final video modulation), the audio side, the audio-video
    # cross-attention modulations and the text connectors
    resident=("patchify_proj", "adaln_single", "prompt_adaln_single", "caption_projection", "scale_shift_table",
              "norm_out", "proj_out",
              "audio_patchify_proj", "audio_adaln_single", "audio_prompt_adaln_single", "audio_caption_projection",
              "audio_scale_shift_table", "audio_norm_out", "audio_proj_out",
              "av_ca_video_scale_shift_adaln_single", "av_ca_a2v_gate_adaln_single",
              "av_ca_audio_scale_shift_adaln_single", "av_ca_v2a_gate_adaln_single",
              "audio_embeddings_connector", "video_embeddings_connector"),
    detect_before=("ltxv",),  # LTXAVModel subclasses LTXVModel
    sequence_refusal=("in every block the video attends to the whole audio and the audio to the whole video, so "
                      "splitting the tokens of either stream would cut the keys the other reads; the caches and CPU "
                      "Offload work on it"),
    expects=Expectations(
        blocks={"transformer_blocks": ForwardParameters(
            ("x", "v_context", "a_context", "attention_mask", "v_timestep", "a_timestep", "v_pe", "a_pe",
             "v_cross_pe", "a_cross_pe", "v_cross_scale_shift_timestep", "a_cross_scale_shift_timestep",
             "v_cross_gate_timestep", "a_cross_gate_timestep", "transformer_options", "self_attention_mask",
             "v_prompt_timestep", "a_prompt_timestep"),
            positions={"x": 0, "v_timestep": 4, "a_timestep": 5})},
        call=ForwardParameters(("x", "timestep", "context", "attention_mask", "frame_rate", "transformer_options",
                                "keyframe_idxs", "**kwargs"))))
