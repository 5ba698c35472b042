"""HunyuanVideo's and LTX-Video's sequence plans on ComfyUI's real tiny models, sampled on 2 gloo ranks against one
process (``omnitest.sp_families.rank_family_plan``).

Heads divisible by the world size run Ulysses, one head runs ring attention; 27 tokens pad the last shard.
HunyuanVideo also runs with a text attention mask (padded text tokens: the host's key mask, exchanged across ranks);
LTX-Video also runs with a denoise mask (image-to-video: one timestep per token, split with the tokens) and with
keyframe indices (a guide frame's RoPE positions).
"""
from __future__ import annotations

import pytest

from omnitest.quality import psnr_db
from omnitest.sp_families import MIN_PSNR_DB, assert_plan_equals_one_process, rank_refused_then_in_step
from omnitest.tiny_models import CASES

pytestmark = pytest.mark.host

TIMEOUT_S = 240
ONE_HEAD = {  # one attention head of the same width (HunyuanVideo's RoPE axes must cover the whole head)
    "hunyuan_video": {"num_heads": 1, "axes_dim": [16, 24, 24]},
    "ltxv": {"num_attention_heads": 1, "attention_head_dim": 64},
}
PADDED_LATENT = {"hunyuan_video": (1, 16, 3, 6, 6), "ltxv": (1, 128, 3, 3, 3)}  # 27 tokens each
SITES = {"hunyuan_video": 2, "ltxv": 2}  # 1 double + 1 single block; attn1 of 2 transformer blocks


@pytest.mark.parametrize("case_name, one_head, padded, variant", [
    # case, one head (ring) or 2 heads (Ulysses), 27 tokens (padded), a change to the inputs
    ("hunyuan_video", False, False, None),
    ("hunyuan_video", True, False, None),
    ("hunyuan_video", False, True, None),
    ("hunyuan_video", True, True, None),
    ("hunyuan_video", False, True, "text_mask"),
    ("hunyuan_video", True, True, "text_mask"),
    ("ltxv", False, False, None),
    ("ltxv", True, False, None),
    ("ltxv", False, True, None),
    ("ltxv", True, True, None),
    ("ltxv", False, True, "denoise_mask"),
    ("ltxv", True, True, "denoise_mask"),
    ("ltxv", False, True, "keyframes"),
    ("ltxv", True, True, "keyframes"),
])
def test_plan_on_two_ranks_equals_one_process(rank_pool, case_name, one_head, padded, variant):
    assert case_name in CASES
    ulysses, ring = (1, 2) if one_head else (2, 1)
    for exchanged in assert_plan_equals_one_process(
            rank_pool, case_name, ONE_HEAD[case_name] if one_head else None, ulysses, ring,
            PADDED_LATENT[case_name] if padded else None, SITES[case_name], TIMEOUT_S, variant):
        assert (exchanged.get("key_mask_all_gather", 0) > 0) == (variant == "text_mask")


@pytest.mark.parametrize("case_name, one_head", [
    ("hunyuan_video", False), ("hunyuan_video", True), ("ltxv", False), ("ltxv", True)])
def test_auto_degrees_read_the_head_count(case_name, one_head):
    from omnitest.pack import pack_module
    from omnitest.tiny_models import build_case

    node = pack_module("nodes.sequence_parallel.node")
    families = pack_module("nodes.families")
    built = build_case(case_name, unet_overrides=ONE_HEAD[case_name] if one_head else None)
    family = families.detect(built.patcher).family
    assert node._heads(built.diffusion_model, family) == (1 if one_head else 2)


def test_hunyuan_guiding_frame_index_is_refused_on_every_rank_naming_why(rank_pool):
    """Refused before any exchange, and a call without it afterwards runs in step."""
    for message, sent, got, reference in rank_pool(2).run(rank_refused_then_in_step, "hunyuan_video",
                                                          "guiding_frame_index", timeout=TIMEOUT_S):
        assert "HunyuanVideo called with guiding_frame_index is not supported" in message
        assert "modulates token ranges" in message
        assert sent == 0  # refused before any exchange: no rank waits for another
        assert psnr_db(got, reference) >= MIN_PSNR_DB
