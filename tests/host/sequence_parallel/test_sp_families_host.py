"""Wan's sequence plan on ComfyUI's real tiny model, sampled on 2 gloo ranks against one process
(``omnitest.sp_families.rank_family_plan``). Heads divisible by the world size run Ulysses, one head runs ring
attention.
"""
from __future__ import annotations

import pytest

from omnitest.sp_families import assert_plan_equals_one_process
from omnitest.tiny_models import CASES

pytestmark = pytest.mark.host

TIMEOUT_S = 240


@pytest.mark.parametrize("heads, ulysses, ring, latent_shape", [
    (2, 2, 1, None),                 # 32 tokens, heads divisible: Ulysses
    (1, 1, 2, None),                 # one head: ring
    (2, 2, 1, (1, 16, 3, 6, 6)),     # 27 tokens: the last shard padded
    (1, 1, 2, (1, 16, 3, 6, 6)),
])
def test_wan_plan_on_two_ranks_equals_one_process(rank_pool, heads, ulysses, ring, latent_shape):
    assert "wan21_t2v" in CASES
    assert_plan_equals_one_process(rank_pool, "wan21_t2v", {"num_heads": heads}, ulysses, ring, latent_shape, 2,
                                   TIMEOUT_S)
