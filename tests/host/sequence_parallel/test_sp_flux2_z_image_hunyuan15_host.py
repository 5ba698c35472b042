"""Flux 2's, Z-Image's and HunyuanVideo 1.5's sequence plans on ComfyUI 0.3.75's real tiny models, sampled on 2 gloo
ranks against one process (``omnitest.sp_families.rank_family_plan``), Ulysses and ring. On an older ComfyUI, without
these model classes, each test skips in one line naming the version.

Flux 2 attends ``[512 padded text tokens | image shard]``; Z-Image splits its image tokens (pad tokens included) before
the noise refiner and gathers them after it (ComfyUI 0.33 derives the caption length from the refined sequence's
length), splits the image part of ``[caption | image]`` again at the first layer and gathers it back from the final
layer; HunyuanVideo 1.5 carries its ByT5 glyph tokens (and, for the super-resolution model, the low-resolution
latent's channels) with the text at the rear.
"""
from __future__ import annotations

import pytest

from omnitest.sp_families import assert_plan_equals_one_process
from omnitest.tiny_models import CASES

pytestmark = pytest.mark.host

TIMEOUT_S = 300
ULYSSES, RING = (2, 1), (1, 2)
_IMAGE_15_TOKENS = (1, 128, 3, 5)           # Flux 2: patch 1, 15 tokens, the last shard padded
_VIDEO_15_TOKENS = (1, 32, 1, 3, 5)         # HunyuanVideo 1.5: patch 1x1x1, 15 tokens
_Z_IMAGE_TWO_REFINERS = {"n_refiner_layers": 2}  # the released models' count: split, gather at different refiners


@pytest.mark.parametrize("case, overrides, degrees, latent_shape, sites", [
    ("flux2", None, ULYSSES, None, 2),
    ("flux2", None, RING, _IMAGE_15_TOKENS, 2),
    ("z_image", None, ULYSSES, None, 3),      # one noise-refiner layer and two layers
    ("z_image", None, RING, None, 3),
    ("z_image", _Z_IMAGE_TWO_REFINERS, ULYSSES, None, 4),
    ("hunyuan_video15", None, ULYSSES, None, 2),
    ("hunyuan_video15", None, RING, _VIDEO_15_TOKENS, 2),
    ("hunyuan_video15_sr", None, ULYSSES, None, 2),
])
def test_plan_on_two_ranks_equals_one_process(rank_pool, case, overrides, degrees, latent_shape, sites):
    from omnitest import tiny_models

    assert case in CASES
    tiny_models.build_case(case, unet_overrides=overrides)  # skips on a ComfyUI without the model's class
    assert_plan_equals_one_process(rank_pool, case, overrides, *degrees, latent_shape, sites, TIMEOUT_S)


def test_z_image_with_reference_images_is_refused_before_any_exchange():
    """Z-Image Omni passes ``timestep_zero_index`` (slices of the whole sequence) to its refiners and layers, on hosts
    whose blocks take it: the plan refuses such a call at the first refiner, where the sequence is first split (before
    any exchange), naming the fix. A call without it (``None``, plain Z-Image) is not refused."""
    import inspect

    from omnitest import tiny_models
    from omnitest.pack import pack_module

    sp = pack_module("omni_hooks.sequence_parallel")
    dm = tiny_models.build_case("z_image").diffusion_model
    plan = pack_module("nodes.families.z_image").FAMILY.sequence_plan(dm)
    takes_it = "timestep_zero_index" in inspect.signature(type(dm.noise_refiner[0]).forward).parameters
    refused = {module: name for module, specs in plan.items() if isinstance(specs, dict)
               for name, spec in specs.items() if isinstance(spec, sp.SequenceParallelRefusedInput)}
    assert refused == ({"noise_refiner.0": "timestep_zero_index"} if takes_it else {})
    if takes_it:
        reason = plan["noise_refiner.0"]["timestep_zero_index"].reason
        assert "reference images" in reason and "fix: " in reason
        assert isinstance(plan["noise_refiner.0"]["x"], sp.SequenceParallelInput)  # the split is still there
