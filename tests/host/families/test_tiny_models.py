"""The tiny models of ``omnitest.tiny_models`` build and sample with ComfyUI's own sampler."""
from __future__ import annotations

import pytest

from omnitest.tiny_models import CASES

pytestmark = pytest.mark.host

DISTILLED = {"flux", "flux_schnell", "flux_kontext", "hunyuan_video", "flux2", "hunyuan_video15_sr"}


@pytest.fixture(scope="module")
def tm():
    from omnitest import tiny_models

    return tiny_models


def test_unknown_name_is_a_key_error(tm):
    with pytest.raises(KeyError):
        tm.build_case("sd15")


@pytest.mark.parametrize("name", CASES)
def test_builds_and_samples_deterministically(tm, name):
    import torch
    import comfy.model_patcher
    import comfy.sample

    case = tm.build_case(name)

    assert case.name == name
    assert isinstance(case.patcher, comfy.model_patcher.ModelPatcher)
    assert type(case.patcher.model.model_config).__name__ == case.config_name
    assert case.patcher.load_device == torch.device("cpu") and case.patcher.offload_device == torch.device("cpu")
    # an audio-video latent (a NestedTensor) has the channels of its widest stream (MiniMax-H3: audio 32, video 24)
    streams = case.latent.unbind() if getattr(case.latent, "is_nested", False) else [case.latent]
    assert max(s.shape[1] for s in streams) == case.patcher.model.latent_format.latent_channels
    assert case.latent.ndim == 4 + (case.patcher.model.latent_format.latent_dimensions == 3)
    assert (case.cfg == 1.0) if name in DISTILLED else (case.cfg > 1.0)
    pos_before = case.positive[0][0].clone()

    out = tm.sample(case, steps=3)
    again = tm.sample(case, steps=3)
    other_seed = tm.sample(case, steps=3, seed=1)

    assert out.shape == tm.packed_latent(case.latent).shape
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert torch.equal(out, again)
    assert not torch.equal(out, other_seed)
    noise = tm.packed_latent(comfy.sample.prepare_noise(case.latent, 0))
    assert not torch.allclose(out, noise)  # the model did something
    assert torch.equal(case.positive[0][0], pos_before)


@pytest.mark.parametrize("name", CASES)
def test_same_seed_same_weights(tm, name):
    import torch

    a = tm.build_case(name, seed=3).diffusion_model.state_dict()
    b = tm.build_case(name, seed=3).diffusion_model.state_dict()
    c = tm.build_case(name, seed=4).diffusion_model.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
