"""Families' sequence plans on ComfyUI's real tiny models, sampled on 2 gloo ranks (tests/omnitest/rank_pool.py).

Every rank builds the same tiny model (weights and inputs are functions of the seed), samples it once in one
process (the reference) and once with the family's plan applied and the runtime's attention entry installed in
``transformer_options["optimized_attention_override"]``, ComfyUI's own attention seam; both go through ComfyUI's
KSampler (CFG batches cond and uncond). Heads divisible by the world size run Ulysses, one head runs ring attention.
"""
from __future__ import annotations

import pytest

from omnitest.quality import psnr_db
from omnitest.tiny_models import CASES

pytestmark = pytest.mark.host

TIMEOUT_S = 240
MIN_PSNR_DB = 60.0


def rank_family_plan(case_name: str, heads: int, ulysses: int, ring: int, latent_shape):
    """On every rank: (PSNR of the SP latent against the one-process latent, model restored, sites found)."""
    from omnitest.comfy_path import use_comfyui_in_process

    use_comfyui_in_process()
    from omnitest.pack import pack_module
    from omnitest.tiny_models import build_case, sample

    sp = pack_module("omni_hooks.sequence_parallel")
    families = pack_module("nodes.families")
    case = build_case(case_name, unet_overrides={"num_heads": heads},
                      latent_shape=tuple(latent_shape) if latent_shape else None)
    reference = sample(case)
    dm = case.diffusion_model
    family = families.detect(case.patcher).model_family
    plan = family.sequence_plan(dm)
    runtime = sp.apply_sequence_parallel(dm, sp.SequenceParallelConfig(ulysses_degree=ulysses, ring_degree=ring),
                                         plan)
    clone = case.patcher.clone()
    options = clone.model_options.setdefault("transformer_options", {})
    options["optimized_attention_override"] = runtime.attention
    try:
        got = sample(case, clone)
    finally:
        sp.remove_sequence_parallel(dm, plan)
    restored = sample(case)
    exchanged = {kind: record.calls for kind, record in runtime.stats.snapshot().items()}
    return psnr_db(got, reference), bool((restored == reference).all()), len(family.attention_sites(dm)), exchanged


@pytest.mark.parametrize("heads, ulysses, ring, latent_shape", [
    (2, 2, 1, None),                 # 32 tokens, heads divisible: Ulysses
    (1, 1, 2, None),                 # one head: ring
    (2, 2, 1, (1, 16, 3, 6, 6)),     # 27 tokens: the last shard padded
    (1, 1, 2, (1, 16, 3, 6, 6)),
])
def test_wan_plan_on_two_ranks_equals_one_process(rank_pool, heads, ulysses, ring, latent_shape):
    assert "wan21_t2v" in CASES
    exchange = "ulysses_all_to_all" if ulysses > 1 else "ring_hop"
    for quality, restored, sites, exchanged in rank_pool(2).run(rank_family_plan, "wan21_t2v", heads, ulysses, ring,
                                                        latent_shape, timeout=TIMEOUT_S):
        assert quality >= MIN_PSNR_DB
        assert restored
        assert sites == 2
        assert exchanged.get(exchange, 0) > 0 and exchanged.get("output_all_gather", 0) > 0
