"""Flux 2's, Z-Image's and HunyuanVideo 1.5's sequence plans on ComfyUI 0.3.75's real tiny models, sampled on 2 gloo
ranks against one process (``omnitest.sp_families.rank_family_plan``), Ulysses and ring. On an older ComfyUI, without
these model classes, each test skips in one line naming the version.

Flux 2 attends ``[512 padded text tokens | image shard]``; Z-Image splits its image tokens (pad tokens included) before
the noise refiner and gathers ``[caption | image]`` back from the final layer; HunyuanVideo 1.5 carries its ByT5 glyph
tokens (and, for the super-resolution model, the low-resolution latent's channels) with the text at the rear.
"""
from __future__ import annotations

import pytest

from omnitest.sp_families import rank_family_plan
from omnitest.tiny_models import CASES

pytestmark = pytest.mark.host

TIMEOUT_S = 300
MIN_PSNR_DB = 60.0
ULYSSES, RING = (2, 1), (1, 2)
_IMAGE_15_TOKENS = (1, 128, 3, 5)           # Flux 2: patch 1, 15 tokens, the last shard padded
_VIDEO_15_TOKENS = (1, 32, 1, 3, 5)         # HunyuanVideo 1.5: patch 1x1x1, 15 tokens


@pytest.mark.parametrize("case, degrees, latent_shape, sites", [
    ("flux2", ULYSSES, None, 2),
    ("flux2", RING, _IMAGE_15_TOKENS, 2),
    ("z_image", ULYSSES, None, 3),            # one noise-refiner layer and two layers
    ("z_image", RING, None, 3),
    ("hunyuan_video15", ULYSSES, None, 2),
    ("hunyuan_video15", RING, _VIDEO_15_TOKENS, 2),
    ("hunyuan_video15_sr", ULYSSES, None, 2),
])
def test_plan_on_two_ranks_equals_one_process(rank_pool, case, degrees, latent_shape, sites):
    from omnitest import tiny_models

    assert case in CASES
    tiny_models.build_case(case)  # skips on a ComfyUI without the model's class
    ulysses, ring = degrees
    exchange = "ulysses_all_to_all" if ulysses > 1 else "ring_hop"
    for quality, restored, found, exchanged in rank_pool(2).run(rank_family_plan, case, None, ulysses, ring,
                                                                latent_shape, timeout=TIMEOUT_S):
        assert quality >= MIN_PSNR_DB
        assert restored
        assert found == sites
        assert exchanged.get(exchange, 0) > 0 and exchanged.get("output_all_gather", 0) > 0
