"""CFG parallel on ComfyUI's real tiny Wan, sampled by ComfyUI's KSampler path at cfg 5 (cond and uncond batched into
one call) on 2 gloo ranks (tests/omnitest/rank_pool.py): rank 0 computes the cond half, rank 1 the uncond half, the
output is gathered along the batch; the latent must match the one-process run (PSNR >= 60 dB)."""
from __future__ import annotations

import pytest

from omnitest.quality import psnr_db
from omnitest.tiny_models import CASES

pytestmark = pytest.mark.host

TIMEOUT_S = 240
MIN_PSNR_DB = 60.0
CFG = 5.0


def rank_wan_cfg_parallel(heads: int, ulysses: int, ring: int):
    """On every rank: (PSNR against one process, model restored, batch gathers, the parts of the batch computed)."""
    from omnitest.comfy_path import use_comfyui_in_process

    use_comfyui_in_process()
    from omnitest.pack import pack_module
    from omnitest.tiny_models import build_case, sample

    sp = pack_module("omni_hooks.sequence_parallel")
    families = pack_module("nodes.families")
    case = build_case("wan21_t2v", unet_overrides={"num_heads": heads})
    reference = sample(case, cfg=CFG)
    dm = case.diffusion_model
    plan = families.detect(case.patcher).family.sequence_plan(dm)
    config = sp.SequenceParallelConfig(ulysses_degree=ulysses, ring_degree=ring, cfg_degree=2)
    runtime = sp.apply_sequence_parallel(dm, config, plan)
    parts = []
    seen = dm.blocks[0].register_forward_pre_hook(lambda m, args: parts.append(runtime.batch_part()))
    clone = case.patcher.clone()
    clone.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = runtime.attention
    try:
        got = sample(case, clone, cfg=CFG)
    finally:
        seen.remove()
        sp.remove_sequence_parallel(dm, plan)
    restored = sample(case, cfg=CFG)
    gathers = runtime.stats.snapshot().get("cfg_batch_all_gather")
    return (psnr_db(got, reference), bool((restored == reference).all()), gathers.calls if gathers else 0,
            sorted(set(parts)))


def test_wan_cfg_parallel_on_two_ranks_equals_one_process(rank_pool):
    assert "wan21_t2v" in CASES
    results = rank_pool(2).run(rank_wan_cfg_parallel, 2, 1, 1, timeout=TIMEOUT_S)
    for rank, (quality, restored, gathers, parts) in enumerate(results):
        assert quality >= MIN_PSNR_DB and restored
        assert gathers > 0 and parts == [(rank, 2)]  # every call split: this rank ran its half of cond+uncond


# -- the node's degrees ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sp_node():
    from omnitest.pack import pack_module

    node, group = pack_module("nodes.sequence_parallel.node"), pack_module("nodes.sequence_parallel.group")
    yield node
    group.close_group()


def _settings(node, world_size: int, cfg_parallel: bool, ulysses=None, ring=None) -> tuple:
    """``resolve_degrees``' arguments before ``heads``: CPU ranks of ``world_size``, the degrees and cfg_parallel."""
    from omnitest.pack import pack_module

    group = pack_module("nodes.sequence_parallel.group").GroupSettings(world_size, "gloo", ("cpu",) * world_size)
    return group, ulysses, ring, cfg_parallel


def test_cfg_parallel_degrees_share_half_the_world(sp_node):
    config = sp_node.resolve_degrees(*_settings(sp_node, 4, True), heads=2)
    assert (config.ulysses_degree, config.ring_degree, config.cfg_degree) == (2, 1, 2)
    config = sp_node.resolve_degrees(*_settings(sp_node, 2, True), heads=1)
    assert (config.ulysses_degree, config.ring_degree, config.cfg_degree) == (1, 1, 2)
    with pytest.raises(ValueError, match="even world_size"):
        sp_node.resolve_degrees(*_settings(sp_node, 3, True), heads=2)
    with pytest.raises(ValueError, match=r"world_size / 2 \(cfg_parallel\)"):
        sp_node.resolve_degrees(*_settings(sp_node, 4, True, ulysses=2, ring=2), heads=2)

