"""LTX-2's and Kandinsky 5's sequence plans (ComfyUI 0.33) on ComfyUI's real tiny models, sampled on 2 gloo ranks
against one process (``omnitest.sp_families.rank_calls_against_one_process``), at cfg 1 and at the case's cfg > 1.

Ulysses gives the one-process latent within ``SPLIT_RELATIVE`` (float32 rounding of other kernels); ring attention
within ``RING_RELATIVE``. LTX-2: its video split, its
audio whole on every rank, with audio and video-only calls; 27 video tokens pad the last shard; an audio stream of
one token (fewer tokens than ranks); image-to-video (one timestep row per latent frame, the host's compressed form);
a guide frame at strength 1. Kandinsky 5: video, one latent frame (the forward's image path) and its image model;
27 tokens. Every test changes the resolution between the runs under one applied plan. A call the plan cannot split
(LTX-2 with a guide below strength 1) fails on every rank naming why, before any exchange, and the next call runs in
step.

A rank runs the same arithmetic on its shard as one process on the whole sequence, but the CPU BLAS picks a linear
layer's kernel by its row count and by the CPU, and the kernels round differently (``omnitest.sp_families``). The
shards here hold at least 13 rows, where the kernels differ least; Kandinsky 5's image model, which ComfyUI only
builds 2560 wide, is held to the ring's bound under Ulysses too.
"""
from __future__ import annotations

import pytest

from omnitest.comfy_path import requires_comfy_class
from omnitest.sp_families import (RING_RELATIVE, SPLIT_RELATIVE, assert_split_close, rank_calls_against_one_process,
                                  rank_refused_then_in_step)

pytestmark = pytest.mark.host
# the ranks cannot skip a test: on a ComfyUI without the model it skips here, in one line naming the version
LTX2 = requires_comfy_class("comfy.model_base", "LTXAV")
KANDINSKY5 = requires_comfy_class("comfy.model_base", "Kandinsky5Image")

TIMEOUT_S = 300
ONE_HEAD = {"ltxav": {"num_attention_heads": 1, "attention_head_dim": 64, "audio_num_attention_heads": 1,
                      "audio_attention_head_dim": 32},
            "kandinsky5": {"model_dim": 32}}  # Kandinsky 5's head is the RoPE axes' 32 channels

# per test: the runs' inputs, (variant, latent shape), each run after the other under one applied plan
LTX2_AUDIO = [(None, None), ("ltx2_odd", None)]                 # 32 then 27 video tokens, 5 audio tokens
LTX2_VIDEO_ONLY = [("ltx2_video_only", None), ("ltx2_video_only_even", None)]
LTX2_SHORT_AUDIO = [("ltx2_short_audio", None), (None, None)]   # 1 audio token for 2 ranks, then 5
LTX2_IMAGE_TO_VIDEO = [("ltx2_image_to_video", None), ("ltx2_guide", None)]
KANDINSKY5_VIDEO = [(None, None), (None, (1, 16, 3, 6, 6))]     # 2 x 4 x 4 then 3 x 3 x 3 tokens
KANDINSKY5_FRAME = [(None, (1, 16, 12, 12)), (None, (1, 16, 10, 10))]  # one latent frame: 6 x 6, then 5 x 5
KANDINSKY5_IMAGE = [(None, None), (None, (1, 16, 6, 6))]        # the image model: 4 x 4 then 3 x 3 tokens


def check(results, ulysses: int, split_bound: bool = True) -> None:
    """Every run within ``SPLIT_RELATIVE`` under Ulysses (``split_bound``), else within the ring's bound; and the
    degrees' exchanges ran."""
    for per_run, exchanged in results:
        for relative in per_run:
            assert relative < (SPLIT_RELATIVE if ulysses > 1 and split_bound else RING_RELATIVE), relative
        assert exchanged.get("ulysses_all_to_all" if ulysses > 1 else "ring_hop", 0) > 0
        assert exchanged.get("output_all_gather", 0) > 0


@pytest.mark.parametrize("cfg", [1.0, None])
@pytest.mark.parametrize("ulysses, ring", [(2, 1), (1, 2)])
@pytest.mark.parametrize("inputs", [LTX2_AUDIO, LTX2_VIDEO_ONLY, LTX2_IMAGE_TO_VIDEO],
                         ids=["audio", "video_only", "image_to_video"])
@LTX2
def test_ltx2_on_two_ranks_equals_one_process(rank_pool, inputs, ulysses, ring, cfg):
    results = rank_pool(2).run(rank_calls_against_one_process, "ltxav", None if ulysses > 1 else ONE_HEAD["ltxav"],
                               ulysses, ring, cfg, inputs, timeout=TIMEOUT_S)
    check(results, ulysses)
    kinds = results[0][1]
    with_audio = inputs is not LTX2_VIDEO_ONLY
    # the audio attends to the video through the cross-attention exchange; a video-only call runs none
    assert (kinds.get("cross_heads_all_gather" if ulysses > 1 else "cross_partial_all_gather", 0) > 0) == with_audio


@pytest.mark.parametrize("ulysses, ring", [(2, 1), (1, 2)])
@LTX2
def test_ltx2_with_fewer_audio_tokens_than_ranks_equals_one_process(rank_pool, ulysses, ring):
    """With one audio token (one query of the video-to-audio attention), ComfyUI's CPU attention (sub-quadratic,
    batched over heads) rounds differently for half the heads than for all of them, so Ulysses is held to the ring's
    bound on that run; the run with 5 audio tokens after it is within ``SPLIT_RELATIVE``."""
    results = rank_pool(2).run(rank_calls_against_one_process, "ltxav", None if ulysses > 1 else ONE_HEAD["ltxav"],
                               ulysses, ring, 3.0, LTX2_SHORT_AUDIO, timeout=TIMEOUT_S)
    check(results, ulysses, split_bound=False)
    if ulysses > 1:
        assert all(per_run[1] < SPLIT_RELATIVE for per_run, _ in results)


@pytest.mark.parametrize("cfg", [1.0, None])
@pytest.mark.parametrize("ulysses, ring", [(2, 1), (1, 2)])
@pytest.mark.parametrize("case_name, inputs", [("kandinsky5", KANDINSKY5_VIDEO), ("kandinsky5", KANDINSKY5_FRAME),
                                               ("kandinsky5_image", KANDINSKY5_IMAGE)],
                         ids=["video", "one_frame", "image_model"])
@KANDINSKY5
def test_kandinsky5_on_two_ranks_equals_one_process(rank_pool, case_name, inputs, ulysses, ring, cfg):
    one_head = ONE_HEAD["kandinsky5"] if ulysses == 1 and case_name == "kandinsky5" else None  # (image: 80 heads)
    results = rank_pool(2).run(rank_calls_against_one_process, case_name, one_head, ulysses, ring, cfg, inputs,
                               timeout=TIMEOUT_S)
    check(results, ulysses, split_bound=case_name == "kandinsky5")


@KANDINSKY5
def test_kandinsky5_of_one_visual_block_splits_and_gathers_at_it(rank_pool):
    """One block is the stack's head and its last: its split and its gather are on the same module."""
    results = rank_pool(2).run(rank_calls_against_one_process, "kandinsky5", {"num_visual_blocks": 1}, 2, 1, None,
                               KANDINSKY5_VIDEO, timeout=TIMEOUT_S)
    check(results, 2)


@LTX2
def test_ltx2_with_a_guide_below_strength_1_is_refused_on_every_rank_before_any_exchange(rank_pool):
    for message, sent, got, reference in rank_pool(2).run(rank_refused_then_in_step, "ltxav", "ltx2_guide_half",
                                                          "ltx2_odd", timeout=TIMEOUT_S):
        assert message.startswith("Sequence Parallel: LTX-2 with an LTXVAddGuide whose strength is not 1")
        assert "fix: set the guide's strength to 1" in message
        assert sent == 0
        assert_split_close(got, reference)  # the group is still in step


@pytest.mark.parametrize("case_name, heads", [("ltxav", 2), ("kandinsky5", 2), ("kandinsky5_image", 80)])
def test_auto_degrees_read_every_attention_sites_heads(case_name, heads):
    """LTX-2's Ulysses degree must divide the video's and the audio's head counts: 'auto' reads both."""
    from omnitest.pack import pack_module
    from omnitest.tiny_models import build_case

    node = pack_module("nodes.sequence_parallel.node")
    built = build_case(case_name)
    family = pack_module("nodes.families").detect(built.patcher).family
    assert node._heads(built.diffusion_model, family) == heads
    if case_name == "ltxav":
        built = build_case(case_name, unet_overrides={"audio_num_attention_heads": 1, "audio_attention_head_dim": 32})
        assert node._heads(built.diffusion_model, family) == 1
