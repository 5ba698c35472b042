"""HunyuanVideo's and LTX-Video's sequence plans on ComfyUI's real tiny models, sampled on 2 gloo ranks
(tests/omnitest/rank_pool.py), as tests/host/test_sp_families_host.py does for Wan.

Every rank builds the same tiny model, samples it once in one process (the reference) and once with the family's plan
applied and the runtime's attention entry in ``transformer_options["optimized_attention_override"]``, both through
ComfyUI's KSampler. Heads divisible by the world size run Ulysses, one head runs ring attention; 27 tokens pad the
last shard. HunyuanVideo also runs with a text attention mask (padded text tokens: the host's key mask exchanged
across ranks); LTX-Video also runs with a denoise mask (image-to-video: one timestep per token, split with the
tokens) and with keyframe indices (a guide frame's RoPE positions).
"""
from __future__ import annotations

import pytest

from omnitest.quality import psnr_db
from omnitest.tiny_models import CASES

pytestmark = pytest.mark.host

TIMEOUT_S = 240
MIN_PSNR_DB = 60.0
ONE_HEAD = {  # one attention head of the same width (HunyuanVideo's RoPE axes must sum to the head dim)
    "hunyuan_video": {"num_heads": 1, "axes_dim": [16, 24, 24]},
    "ltxv": {"num_attention_heads": 1, "attention_head_dim": 64},
}
PADDED_LATENT = {"hunyuan_video": (1, 16, 3, 6, 6), "ltxv": (1, 128, 3, 3, 3)}  # 27 tokens each


def rank_family_plan(case_name: str, one_head: bool, padded: bool, extra: str | None):
    """On every rank: (PSNR of the SP latent against the one-process latent, model restored, sites, exchanges)."""
    from omnitest.comfy_path import use_comfyui_in_process

    use_comfyui_in_process()
    import torch

    from omnitest.pack import pack_module
    from omnitest.tiny_models import build_case, sample

    sp = pack_module("omni_hooks.sequence_parallel")
    families = pack_module("nodes.families")
    case = build_case(case_name, unet_overrides=ONE_HEAD[case_name] if one_head else None,
                      latent_shape=PADDED_LATENT[case_name] if padded else None)
    if extra == "text_mask":  # the text encoder padded the last 3 of 8 tokens
        for cond in (case.positive, case.negative):
            mask = torch.ones(1, cond[0][0].shape[1], dtype=torch.long)
            mask[:, -3:] = 0
            cond[0][1]["attention_mask"] = mask
    elif extra == "denoise_mask":  # LTXVImgToVideo: the first latent frame is kept
        case.noise_mask = torch.ones(1, 1, *case.latent.shape[2:])
        case.noise_mask[:, :, 0] = 0
    elif extra == "keyframes":  # LTXVAddGuide: the last latent frame is a guide placed at pixel frame 0
        _, _, _, height, width = case.latent.shape
        rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
        idxs = torch.stack([torch.zeros(height * width), rows.flatten() * 32.0, cols.flatten() * 32.0])[None]
        for cond in (case.positive, case.negative):
            cond[0][1]["keyframe_idxs"] = idxs
    reference = sample(case)
    dm = case.diffusion_model
    family = families.detect(case.patcher).model_family
    heads = 1 if one_head else 2
    config = sp.SequenceParallelConfig(ulysses_degree=2 if heads == 2 else 1, ring_degree=1 if heads == 2 else 2)
    plan = family.sequence_plan(dm)
    runtime = sp.apply_sequence_parallel(dm, config, plan)
    clone = case.patcher.clone()
    clone.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = runtime.attention
    try:
        got = sample(case, clone)
    finally:
        sp.remove_sequence_parallel(dm, plan)
    restored = sample(case)
    exchanged = {kind: record.calls for kind, record in runtime.stats.snapshot().items()}
    return psnr_db(got, reference), bool((restored == reference).all()), len(family.attention_sites(dm)), exchanged


CASES_RUN = [
    # case, one head (ring) or 2 heads (Ulysses), 27 tokens (padded), extra input
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
]
SITES = {"hunyuan_video": 2, "ltxv": 2}  # 1 double + 1 single block; 2 transformer blocks


@pytest.mark.parametrize("case_name, one_head, padded, extra", CASES_RUN)
def test_plan_on_two_ranks_equals_one_process(rank_pool, case_name, one_head, padded, extra):
    assert case_name in CASES
    exchange = "ring_hop" if one_head else "ulysses_all_to_all"
    for quality, restored, sites, exchanged in rank_pool(2).run(rank_family_plan, case_name, one_head, padded, extra,
                                                                timeout=TIMEOUT_S):
        assert quality >= MIN_PSNR_DB
        assert restored
        assert sites == SITES[case_name]
        assert exchanged.get(exchange, 0) > 0 and exchanged.get("output_all_gather", 0) > 0
        assert (exchanged.get("key_mask_all_gather", 0) > 0) == (extra == "text_mask")


def rank_refused_input():
    """On every rank: the error of a HunyuanVideo call with guiding_frame_index (I2V 'v2 (replace)'), raised before
    any exchange, and whether a call without it then still samples alike."""
    from omnitest.comfy_path import use_comfyui_in_process

    use_comfyui_in_process()
    from omnitest.pack import pack_module
    from omnitest.tiny_models import build_case, sample

    sp = pack_module("omni_hooks.sequence_parallel")
    families = pack_module("nodes.families")
    case = build_case("hunyuan_video")
    reference = sample(case)
    dm = case.diffusion_model
    plan = families.detect(case.patcher).model_family.sequence_plan(dm)
    runtime = sp.apply_sequence_parallel(dm, sp.SequenceParallelConfig(ulysses_degree=2), plan)
    clone = case.patcher.clone()
    clone.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = runtime.attention
    message = ""
    try:
        case.positive[0][1]["guiding_frame_index"] = 0
        try:
            sample(case, clone)
        except ValueError as exc:
            message = str(exc)
        sent = runtime.stats.bytes_sent
        runtime.reset()
        del case.positive[0][1]["guiding_frame_index"]
        quality = psnr_db(sample(case, clone), reference)
    finally:
        sp.remove_sequence_parallel(dm, plan)
    return message, sent, quality


def test_hunyuan_guiding_frame_index_is_refused_on_every_rank_naming_why(rank_pool):
    for message, sent, quality in rank_pool(2).run(rank_refused_input, timeout=TIMEOUT_S):
        assert "HunyuanVideo called with guiding_frame_index is not supported" in message
        assert "modulates token ranges" in message
        assert sent == 0  # refused before any exchange: no rank waits for another
        assert quality >= MIN_PSNR_DB
