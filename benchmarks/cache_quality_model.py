"""The small Wan model the cache quality benchmark samples: ComfyUI's own ``WanModel`` (Wan 2.1 T2V architecture) at
dim 64, 4 blocks, trained by ``train_cache_quality_model.py`` on a synthetic class-conditional distribution, so that
its sampling trajectories are those of a trained flow model (a random-weight model's are not).

The distribution (in the model's latent space, [16, 1, 8, 8]): class k is a plane wave of class frequency ``FREQ[k]``
along a class channel direction, with random amplitude and phase, plus a Gaussian blob at a random place along a
second class direction. The "prompt" of class k is a fixed random text conditioning (``TOKENS`` x ``TEXT_DIM``); the
negative prompt is all zeros (trained as the unconditional input with probability ``DROPOUT``).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

CONFIG = {"dim": 64, "ffn_dim": 256, "num_heads": 2, "num_layers": 4, "text_dim": 32}
LATENT_SHAPE = (1, 16, 1, 8, 8)  # 16 tokens: trains in minutes on one CPU thread
CLASSES = 4
TOKENS = 4
TEXT_DIM = CONFIG["text_dim"]
DROPOUT = 0.15
FREQ = [(1, 0), (0, 1), (1, 1), (2, 1)]
WEIGHTS = Path(__file__).resolve().parent / "data" / "cache_quality_wan.safetensors"


def class_directions() -> tuple[torch.Tensor, torch.Tensor]:
    """Per class: the wave's and the blob's channel direction (unit vectors times 4, so ~unit per channel)."""
    g = torch.Generator().manual_seed(1234)
    v = torch.nn.functional.normalize(torch.randn(CLASSES, 16, generator=g), dim=1) * 4
    u = torch.nn.functional.normalize(torch.randn(CLASSES, 16, generator=g), dim=1) * 4
    return v, u


def class_context(k: int | None) -> torch.Tensor:
    """The text conditioning [1, TOKENS, TEXT_DIM] of class k; None: the unconditional (zeros) one."""
    if k is None:
        return torch.zeros(1, TOKENS, TEXT_DIM)
    g = torch.Generator().manual_seed(100 + k)
    return torch.randn(1, TOKENS, TEXT_DIM, generator=g)


def conditioning(k: int | None) -> list:
    """ComfyUI CONDITIONING for class k (None: the negative prompt)."""
    return [[class_context(k), {}]]


def sample_data(labels: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """One clean latent [16, 1, H, W] (``LATENT_SHAPE``) per label."""
    n = labels.shape[0]
    h = torch.arange(LATENT_SHAPE[-1]).float() / LATENT_SHAPE[-1]
    hh, ww = torch.meshgrid(h, h, indexing="ij")
    v, u = class_directions()
    freq = torch.tensor(FREQ, dtype=torch.float32)[labels]
    amp = torch.rand(n, generator=g) * 0.8 + 0.6
    phase = torch.rand(n, generator=g) * 2 * math.pi
    wave = torch.sin(2 * math.pi * (freq[:, 0, None, None] * hh + freq[:, 1, None, None] * ww) + phase[:, None, None])
    center = torch.rand(n, 2, generator=g) * 0.6 + 0.2
    size = torch.rand(n, generator=g) * 0.5 + 0.5
    blob = torch.exp(-((hh - center[:, 0, None, None]) ** 2 + (ww - center[:, 1, None, None]) ** 2) / (2 * 0.2 ** 2))
    x = (amp[:, None, None, None] * v[labels][:, :, None, None] * wave[:, None]
         + size[:, None, None, None] * u[labels][:, :, None, None] * blob[:, None])
    return x[:, :, None] * 0.7


def build(trained: bool = True):
    """The benchmark model as a tiny-model case (a ComfyUI ModelPatcher on CPU); its weights from ``WEIGHTS``."""
    from omnitest import tiny_models
    from safetensors.torch import load_file

    case = tiny_models.build_case("wan21_t2v", unet_overrides=CONFIG, latent_shape=LATENT_SHAPE)
    if trained:
        dm = case.patcher.model.diffusion_model
        state = {k: v.float() for k, v in load_file(str(WEIGHTS)).items()}
        dm.load_state_dict(state)
    return case
