"""The cache quality benchmark's trained models (``benchmarks/cache_quality_model.py``) on this ComfyUI: every weights
file loads into its config (strictly: every key, every shape), and sampling gives latents of its data's spread, which
the same model with untrained weights does not."""
from __future__ import annotations

import sys

import pytest
import torch

from omnitest.comfy_path import PACK_ROOT

pytestmark = pytest.mark.host

STEPS, CFG, SEEDS = 10, 3.0, 4


def quality_models():
    sys.path.insert(0, str(PACK_ROOT / "benchmarks"))
    try:
        import cache_quality_model
    finally:
        sys.path.remove(str(PACK_ROOT / "benchmarks"))
    return cache_quality_model


def spread_against_data(spec, trained: bool) -> float:
    """The std of class 0's sampled latents (in the model's own space) over the std of class 0's data."""
    from omnitest import tiny_models

    case = spec.build(trained=trained)
    case.positive, case.negative = spec.conditioning(0), spec.conditioning(None)
    outs = torch.stack([case.patcher.model.process_latent_in(tiny_models.sample(case, steps=STEPS, cfg=CFG, seed=s))
                        for s in range(SEEDS)])
    data = spec.sample_data(torch.zeros(256, dtype=torch.long), torch.Generator().manual_seed(0))
    return outs.std().item() / data.std().item()


@pytest.mark.parametrize("name", ["small", "wide", "deep", "long"])
def test_each_benchmark_model_loads_and_samples_its_own_data(name):
    spec = quality_models().MODELS[name]
    trained = spread_against_data(spec, trained=True)
    assert 0.5 < trained < 2.5, f"{name}: sampled spread {trained:.2f} x the data's"
    untrained = spread_against_data(spec, trained=False)
    assert untrained > 3.0, f"{name}: the untrained model's spread {untrained:.2f} x the data's"
