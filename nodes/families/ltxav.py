"""LTX-2, audio and video (ComfyUI's ``LTXAV``; comfy/ldm/lightricks/av_model.py: ``LTXAVModel``, ComfyUI 0.33).

``_process_transformer_blocks`` runs ``transformer_blocks``: ``block((vx, ax), v_context=, a_context=, v_timestep=,
a_timestep=, v_pe=, a_pe=, ...)`` -> ``(vx, ax)``, each block updating both streams in place (video and audio
self-attention, text cross-attention, audio-to-video and video-to-audio cross-attention, feed-forwards). Then
``_process_output`` sends the video stream through ``norm_out`` (LTX-Video's output) and the audio stream through
``audio_norm_out``. The stack is one stack of two streams: the caches read the block's ``(vx, ax)`` as one packed
tensor, so they decide on video and audio together and store one residual over both, and each stream's share is
added at its own tail (``norm_out``, then ``audio_norm_out``).

Sequence Parallel: the video stream is split, the audio stream stays whole on every rank. The video tokens are split
at the first block, before its caches (after the forward has embedded them, added the keyframe markers and built any
guide mask over the whole sequence), and the blocks' per-video-token inputs at every block: the RoPE tables ``v_pe``
and ``v_cross_pe`` and the video timesteps (``v_timestep``, ``v_cross_scale_shift_timestep``,
``v_cross_gate_timestep``: host ``CompressedTimestep`` objects, one row per latent frame where the frame's tokens
share it, narrowed to this rank's token range by ``TokenRange`` without expanding the rest). Per block:

* video self-attention ``attn1``: exchanged (Ulysses, ring or both), as LTX-Video's;
* audio self-attention ``audio_attn1`` and both text cross-attentions: local (every rank holds their keys);
* audio-to-video ``audio_to_video_attn`` (video queries, audio keys): local, every rank holds the whole audio;
* video-to-audio ``video_to_audio_attn`` (audio queries, video keys): a ``SequenceParallelCrossAttention`` site:
  with Ulysses the video keys and values are exchanged for heads, each rank attends with its heads over the whole
  video as one process does, and the audio output's heads are all-gathered; across a ring the partial attentions over
  each rank's keys are all-gathered and merged.

``norm_out``'s output is gathered (as LTX-Video's); the audio output is every rank's own. The caches keep reading the
block's ``(video shard, audio)`` as one packed stream, their measurements averaged and their verdict agreed over the
ranks (``RankAgreement``).

Why the audio is not split: it is short, about 25 tokens a second against thousands of video tokens a second (a 720p
frame is 880), so the work every rank repeats by holding it whole is small. Counted on ComfyUI's own block at LTX-2
19B's widths, the work that grows with the audio tokens is under 1% of a block's for 480p and 720p clips of 2 to 10 s
(docs/benchmarks.md, ``benchmarks/bench_ltx2_audio_share.py``), the most a split could save; a split audio stream
would add three exchanges to every block (its self-attention, the video's attention to it, its output) to save it.
Whole, an audio stream of any length (none, or fewer tokens than ranks) needs nothing of its own. Refused at the call,
before any exchange, naming the fix: an LTXVAddGuide below strength 1 or with an attention mask (its self-attention
mask spans the whole video sequence).

ComfyUI before 0.33 has no LTX-2: the class is probed from its module only when that module is loaded, so nothing
matches there.
"""
from __future__ import annotations

import functools
import sys
from typing import Any

import comfy.ldm.common_dit
import torch

from ...omni_hooks.blockstack import BlockStack, PackedStreams, StackSignal, TensorArg, pack_streams, skip_returning
from ...omni_hooks.sequence_parallel import (SequenceParallelCrossAttention, SequenceParallelInput,
                                             SequenceParallelObjectInput, SequenceParallelOutput,
                                             SequenceParallelSelfAttention)
from ...omni_hooks.sequence_parallel.sharding import pad_to
from .base import (DEFAULT_SIGNAL, Expectations, ForwardParameters, ModelFamily, Variant, call_arg,
                   nothing_published)
from .ltxv import guide_mask_refusal, rope_spec

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


def _modulated_input(dm: torch.nn.Module) -> StackSignal:
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
    return StackSignal(compute=compute)


# -- sequence parallelism ------------------------------------------------------------------------------------------

_VIDEO_GROUP = "ltx2_video"  # the per-video-token block inputs (the tokens themselves are the default sequence)


def _timestep_tokens(timestep: Any) -> int | None:
    """How many video tokens a video timestep holds rows for (None: one row for all of them). A tensor
    [B, tokens or 1, D] or the host's ``CompressedTimestep`` (``num_frames`` rows of ``patches_per_frame`` tokens)."""
    tokens = timestep.shape[1] if isinstance(timestep, torch.Tensor) else (
        timestep.num_frames * timestep.patches_per_frame)
    return None if tokens == 1 else tokens


def _narrow_timestep(timestep: Any, start: int, length: int) -> Any:
    """A video timestep for tokens [start, start + length) only (rows past its end: zeros, the padding's)."""
    if isinstance(timestep, torch.Tensor):
        return pad_to(timestep, 1, start + length).narrow(1, start, length)
    return _token_range_class(type(timestep))(timestep, start, length)


@functools.cache
def _token_range_class(compressed: type) -> type:
    """``TokenRange`` for the host's ``CompressedTimestep`` class (made once the host's module is loaded)."""

    class TokenRange(compressed):
        """Tokens [start, start + length) of a ``CompressedTimestep``: the frames they fall in, kept compressed (a
        ``CompressedTimestep`` of those rows, made by the host's own class) and expanded by the host's own methods,
        then cut to the range (padding past the last token: zeros). The blocks read it as they read the whole one."""

        __slots__ = ("frames", "offset", "length")

        def __init__(self, whole, start: int, length: int):
            per_frame = whole.patches_per_frame
            first = min(start // per_frame, whole.num_frames)
            last = min(-(-(start + length) // per_frame), whole.num_frames)
            self.frames = compressed(whole.data[:, first:last], per_frame, per_frame=True)
            self.offset, self.length = start - first * per_frame, length
            self.batch_size, self.feature_dim = whole.batch_size, whole.feature_dim
            self.num_frames, self.patches_per_frame, self.data = self.frames.num_frames, per_frame, self.frames.data

        def _cut(self, tokens: torch.Tensor) -> torch.Tensor:
            return pad_to(tokens, 1, self.offset + self.length).narrow(1, self.offset, self.length)

        def expand(self):
            return self._cut(self.frames.expand())

        def expand_for_computation(self, scale_shift_table, batch_size, indices=slice(None, None)):
            values = self.frames.expand_for_computation(scale_shift_table, batch_size, indices)
            return tuple(self._cut(v) for v in values)

    return TokenRange


_VIDEO_TIMESTEP = SequenceParallelObjectInput(tokens=_timestep_tokens, narrow=_narrow_timestep,
                                              shard_group=_VIDEO_GROUP, outside_caches=True)


def _sequence_plan(dm: torch.nn.Module) -> dict:
    (v_pe, v_cross_pe), _audio = _pe_probe(dm)
    blocks = {"v_pe": rope_spec(v_pe, _VIDEO_GROUP), "v_cross_pe": rope_spec(v_cross_pe, _VIDEO_GROUP),
              "v_timestep": _VIDEO_TIMESTEP, "v_cross_scale_shift_timestep": _VIDEO_TIMESTEP,
              "v_cross_gate_timestep": _VIDEO_TIMESTEP, "self_attention_mask": guide_mask_refusal("LTX-2")}
    return {
        # x = (video, audio): the video tokens split, the audio whole
        "transformer_blocks.0": {"x": [SequenceParallelInput(split_dim=1, expected_dims=3, auto_pad=True,
                                                             outside_caches=True), None]},
        "transformer_blocks.*": blocks,
        "transformer_blocks.*.attn1": SequenceParallelSelfAttention(),
        "transformer_blocks.*.video_to_audio_attn": SequenceParallelCrossAttention(),
        "norm_out": SequenceParallelOutput(gather_dim=1, expected_dims=3),
    }


def _pe_probe(dm: torch.nn.Module):
    """The blocks' RoPE tables ``[(v_pe, v_cross_pe), (a_pe, a_cross_pe)]`` for two video and two audio positions,
    made by the model's own ``_prepare_positional_embeddings``."""
    video, audio = torch.zeros(1, 3, 2, 2), torch.zeros(1, 1, 2, 2)
    return dm._prepare_positional_embeddings([video, audio], 25.0, torch.float32)


def _timesteps_probe(dm: torch.nn.Module) -> list:
    """The blocks' timesteps for a 2-frame latent of 2x2 tokens with one timestep per token (an image-to-video
    denoise mask), made by the model's own ``_prepare_timestep``: [v_timestep, a_timestep, cross timesteps, ...]."""
    timestep = torch.ones(1, 8)
    return dm._prepare_timestep(timestep, 1, torch.float32, orig_shape=[1, dm.in_channels, 2, 2, 2],
                                a_timestep=torch.ones(1))[0]


def _attention_sites(dm: torch.nn.Module) -> list[torch.nn.Module]:
    return [attn for block in dm.transformer_blocks for attn in (block.attn1, block.video_to_audio_attn)]


def _matches(base_model: torch.nn.Module, dm: torch.nn.Module) -> bool:
    return isinstance(dm, _av_model_class()) and len(dm.transformer_blocks) > 0


def _variant(base_model: torch.nn.Module, dm: torch.nn.Module) -> Variant:
    size = _SIZES.get(dm.inner_dim) or f"inner_dim {dm.inner_dim}"
    return nothing_published(f"LTX-2 {size}", "LTX-2", "a calibration measures the video and the audio together")


FAMILY = ModelFamily(
    name="ltxav", display_name="LTX-2 (audio and video)", matches=_matches, resolve_variant=_variant,
    build_stack=_stack, signals={DEFAULT_SIGNAL: _modulated_input},
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
    sequence_plan=_sequence_plan, attention_sites=_attention_sites,
    expects=Expectations(
        blocks={"transformer_blocks": ForwardParameters(
            ("x", "v_context", "a_context", "attention_mask", "v_timestep", "a_timestep", "v_pe", "a_pe",
             "v_cross_pe", "a_cross_pe", "v_cross_scale_shift_timestep", "a_cross_scale_shift_timestep",
             "v_cross_gate_timestep", "a_cross_gate_timestep", "transformer_options", "self_attention_mask",
             "v_prompt_timestep", "a_prompt_timestep"),
            positions={"x": 0, "v_timestep": 4, "a_timestep": 5})},
        call=ForwardParameters(("x", "timestep", "context", "attention_mask", "frame_rate", "transformer_options",
                                "keyframe_idxs", "**kwargs")),
        plan_inputs={("transformer_blocks.*", "v_pe"): lambda dm: _pe_probe(dm)[0][0],
                     ("transformer_blocks.*", "v_cross_pe"): lambda dm: _pe_probe(dm)[0][1],
                     ("transformer_blocks.*", "v_timestep"): lambda dm: _timesteps_probe(dm)[0],
                     ("transformer_blocks.*", "v_cross_scale_shift_timestep"): lambda dm: _timesteps_probe(dm)[2][1],
                     ("transformer_blocks.*", "v_cross_gate_timestep"): lambda dm: _timesteps_probe(dm)[2][2]}))
