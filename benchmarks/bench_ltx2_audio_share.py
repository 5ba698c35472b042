"""LTX-2 under Sequence Parallel: how much of a block's work every rank repeats by keeping the audio stream whole, the
most that splitting the audio too could save.

One of ComfyUI's own LTX-2 blocks (``BasicAVTransformerBlock``, ComfyUI 0.33) at LTX-2 19B's widths (the
``LTXAVModel`` defaults: video 32 heads x 128, audio 32 heads x 64, 128 text tokens a stream) runs on the "meta" device
under torch's ``FlopCounterMode``, which counts the floating-point operations of every matrix product and attention
the block really calls, from their shapes (no weights, nothing computed). Each clip is counted three times: with its
audio, with one audio token (the attention between the streams still runs), and without audio (the block then runs
the video alone). The work that grows with the audio tokens (with audio, less with one token) is what every rank
repeats when the audio is whole; the attention between the streams runs on the video's tokens and is split with them
(the audio's attention to the video by heads or by keys across the ranks). Clips at 25 fps, 8 frames a latent frame,
LTX-2's 32 x 32 pixels a token, 25 audio tokens a second. Attention is counted as torch's scaled-dot-product
attention (ComfyUI's CPU kernel does the same products in chunks).

Run: .venv/bin/python benchmarks/bench_ltx2_audio_share.py   (needs ComfyUI 0.33: COMFYUI_PATH; prints markdown)
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from omni_hooks.sequence_parallel import sdpa_attention  # noqa: E402

V_DIM, A_DIM, V_HEADS, A_HEADS, TEXT = 4096, 2048, 32, 32, 128
AUDIO_PER_SECOND = 25
# (name, width, height) in pixels; (name, pixel frames)
RESOLUTIONS = [("480p", 832, 480), ("720p", 1280, 704)]
CLIPS = [("2 s", 49), ("5 s", 121), ("10 s", 241)]


def counted_attention(func, q, k, v, heads, mask=None, skip_reshape=False, skip_output_reshape=False, **_):
    """The block's attention calls through torch's SDPA, whose operations the counter knows."""
    return sdpa_attention(q, k, v, heads, mask=mask, skip_reshape=skip_reshape,
                          skip_output_reshape=skip_output_reshape)


def block_flops(block, video: int, audio: int) -> int:
    def meta(*shape):
        return torch.empty(*shape, device="meta")

    kwargs = dict(v_context=meta(1, TEXT, V_DIM), a_context=meta(1, TEXT, A_DIM), attention_mask=None,
                  v_timestep=meta(1, 1, 6 * V_DIM), a_timestep=meta(1, 1, 6 * A_DIM),
                  v_cross_scale_shift_timestep=meta(1, 1, 4 * V_DIM),
                  a_cross_scale_shift_timestep=meta(1, 1, 4 * A_DIM),
                  v_cross_gate_timestep=meta(1, 1, V_DIM), a_cross_gate_timestep=meta(1, 1, A_DIM),
                  transformer_options={"optimized_attention_override": counted_attention})
    with FlopCounterMode(display=False) as counter:
        block((meta(1, video, V_DIM), meta(1, audio, A_DIM)), **kwargs)
    return counter.get_total_flops()


def main() -> int:
    from omnitest.comfy_path import use_comfyui_in_process

    if use_comfyui_in_process() is None:
        print("no ComfyUI checkout (COMFYUI_PATH or ~/ComfyUI): nothing to measure")
        return 1
    import comfy.ldm.lightricks.av_model as av_model
    import comfy.ops

    block = av_model.BasicAVTransformerBlock(V_DIM, A_DIM, V_HEADS, A_HEADS, V_DIM // V_HEADS, A_DIM // A_HEADS,
                                             v_context_dim=V_DIM, a_context_dim=A_DIM,
                                             operations=comfy.ops.disable_weight_init, device="meta")
    print(f"One LTX-2 block at 19B widths (ComfyUI's BasicAVTransformerBlock: video {V_HEADS} x {V_DIM // V_HEADS}, "
          f"audio {A_HEADS} x {A_DIM // A_HEADS}, {TEXT} text tokens a stream), operations counted by torch's "
          "FlopCounterMode on the meta device\n")
    print("| clip | video tokens | audio tokens | TFLOP per block | repeated on every rank with the audio whole | "
          "attention between the streams (split with the video) |")
    print("|---|---|---|---|---|---|")
    for name, width, height in RESOLUTIONS:
        for clip, frames in CLIPS:
            video = ((frames - 1) // 8 + 1) * (width // 32) * (height // 32)
            audio = round(AUDIO_PER_SECOND * frames / 25)
            full, one, alone = (block_flops(block, video, a) for a in (audio, 1, 0))
            print(f"| {name}, {clip} | {video} | {audio} | {full / 1e12:.2f} | {100 * (full - one) / full:.2f}% | "
                  f"{100 * (one - alone) / full:.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
