"""Flux's, Chroma's and Qwen-Image's sequence plans (joint text + image attention, text kept whole on every rank) on
ComfyUI's real tiny models, sampled on 2 gloo ranks against one process (``omnitest.sp_families.rank_family_plan``).

Heads divisible by the world size run Ulysses, one head runs ring attention; a latent of 15 tokens (2 does not divide
it) pads the last shard. Flux Kontext's reference tokens are split with the image tokens.
"""
from __future__ import annotations

import pytest

from omnitest.sp_families import assert_plan_equals_one_process
from omnitest.tiny_models import CASES

pytestmark = pytest.mark.host

TIMEOUT_S = 240

# One head needs RoPE axes that cover the whole head (hidden 64): the tiny Flux-layout configs have 2 heads of 32.
_FLUX_ONE_HEAD = {"num_heads": 1, "axes_dim": [16, 24, 24]}
_FLUX_TWO_HEADS = {"num_heads": 2}
_QWEN_ONE_HEAD = {"num_attention_heads": 1}
_QWEN_TWO_HEADS = {"num_attention_heads": 2}
_IMAGE_15_TOKENS = (1, 16, 6, 10)      # 3 x 5 patches of 2 x 2
_QWEN_15_TOKENS = (1, 16, 1, 6, 10)

ULYSSES, RING = (2, 1), (1, 2)


@pytest.mark.parametrize("case, overrides, degrees, latent_shape, sites", [
    ("flux", _FLUX_TWO_HEADS, ULYSSES, None, 2),              # 16 image tokens
    ("flux", _FLUX_ONE_HEAD, RING, None, 2),
    ("flux", _FLUX_TWO_HEADS, ULYSSES, _IMAGE_15_TOKENS, 2),  # the last shard padded
    ("flux", _FLUX_ONE_HEAD, RING, _IMAGE_15_TOKENS, 2),
    ("flux_kontext", _FLUX_TWO_HEADS, ULYSSES, _IMAGE_15_TOKENS, 2),  # 15 + 16 reference tokens
    ("chroma", _FLUX_TWO_HEADS, ULYSSES, _IMAGE_15_TOKENS, 2),
    ("chroma", _FLUX_ONE_HEAD, RING, None, 2),
    ("qwen_image", _QWEN_TWO_HEADS, ULYSSES, None, 2),
    ("qwen_image", _QWEN_ONE_HEAD, RING, None, 2),
    ("qwen_image", _QWEN_TWO_HEADS, ULYSSES, _QWEN_15_TOKENS, 2),
    ("qwen_image", _QWEN_ONE_HEAD, RING, _QWEN_15_TOKENS, 2),
])
def test_joint_attention_plan_on_two_ranks_equals_one_process(rank_pool, case, overrides, degrees, latent_shape,
                                                               sites):
    assert case in CASES
    ulysses, ring = degrees
    for exchanged in assert_plan_equals_one_process(rank_pool, case, overrides, ulysses, ring, latent_shape, sites,
                                                    TIMEOUT_S):
        if ulysses > 1:  # the text tokens' output heads come back from the peer
            assert exchanged.get("ulysses_joint_all_gather", 0) > 0


@pytest.mark.parametrize("case, overrides, heads", [
    ("flux", _FLUX_TWO_HEADS, 2), ("chroma", _FLUX_ONE_HEAD, 1), ("qwen_image", _QWEN_TWO_HEADS, 2),
    ("qwen_image", _QWEN_ONE_HEAD, 1),  # Qwen-Image's model keeps no head count: its attention sites do
    ("z_image", None, 4),  # NextDiT's n_heads
])
def test_auto_degrees_read_the_head_count(case, overrides, heads):
    from omnitest.pack import pack_module
    from omnitest.tiny_models import build_case

    node = pack_module("nodes.sequence_parallel.node")
    families = pack_module("nodes.families")
    built = build_case(case, unet_overrides=overrides)
    assert node._heads(built.diffusion_model, families.detect(built.patcher).family) == heads


def test_an_unsupported_family_is_refused_with_the_supported_ones():
    from omnitest.pack import pack_module
    from omnitest.tiny_models import CASE_FAMILY, build_case

    node = pack_module("nodes.sequence_parallel.node")
    families = pack_module("nodes.families")
    unsupported = {f.name for f in families.FAMILIES if f.sequence_plan is None}
    case = next((name for name, family in CASE_FAMILY.items() if family in unsupported), None)
    if case is None:
        pytest.skip("every registered family has a sequence plan")
    with pytest.raises(ValueError, match="Sequence Parallel: .* is not supported yet; supported: ") as error:
        node.SequenceParallel.execute(build_case(case).patcher, 2, "auto", "auto", "auto", "auto", "127.0.0.1", 0)
    listed = str(error.value).split("supported: ", 1)[1]
    display = {f.name: f.display_name for f in families.FAMILIES}
    for name in ("flux", "chroma", "qwen_image"):
        assert display[name] in listed
