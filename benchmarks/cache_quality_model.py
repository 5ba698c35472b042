"""The small Wan models the cache quality benchmark samples: ComfyUI's own ``WanModel`` (Wan 2.1 T2V architecture),
trained by ``train_cache_quality_model.py`` on synthetic class-conditional distributions, so that their sampling
trajectories are those of trained flow models (a random-weight model's are not). Four models of different size and
data, so that a claim about the caches holds on more than one (``MODELS``):

* ``small``: dim 64, 4 blocks, latent [16, 1, 8, 8]. Class k is a plane wave of class frequency ``FREQ[k]`` along a
  class channel direction, with random amplitude and phase, plus a Gaussian blob at a random place along a second
  class direction.
* ``wide``: dim 256, 6 blocks, latent [16, 1, 16, 16]. Class k is a few oriented stripe patches (Gabor patches: the
  class's orientation and frequency, random places, sizes and phases) in the class's three "colours" (channel
  directions) over a smooth gradient background in a fourth.
* ``deep``: dim 128, 10 blocks, a 3-frame latent [16, 3, 12, 12]. Class k is a shape of its own (disk, square, ring,
  cross) moving at the class's velocity from frame to frame, at a random start, size and brightness, in the class's
  colour over noise-free black. Added after the forecast policy was chosen, as a check on a model it was not
  developed on.
* ``long``: dim 192, 8 blocks, a 2-frame latent [16, 2, 16, 16] (128 tokens, the longest sequence). Class k is a
  ring of k + 2 dots in the class's colour, at a random centre, radius and angle, turning at the class's speed from
  frame to frame, over a smooth random background (three low-frequency waves) in a second colour. Added after the
  forecast settings were developed on the other three, as a second check on a model none of them was developed on.

The "prompt" of class k is a fixed random text conditioning (``tokens`` x ``text_dim``); the negative prompt is all
zeros (trained as the unconditional input with probability ``DROPOUT``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

CLASSES = 4
DROPOUT = 0.15
FREQ = [(1, 0), (0, 1), (1, 1), (2, 1)]
DATA = Path(__file__).resolve().parent / "data"


@dataclass(frozen=True)
class QualityModel:
    """One benchmark model: its WanModel config, latent shape, text conditioning size, data and weights file."""

    name: str
    config: dict
    latent_shape: tuple[int, ...]
    tokens: int
    sample_data: Callable[[torch.Tensor, torch.Generator], torch.Tensor]
    weights: Path
    description: str

    @property
    def text_dim(self) -> int:
        return self.config["text_dim"]

    def class_context(self, k: int | None) -> torch.Tensor:
        """The text conditioning [1, tokens, text_dim] of class k; None: the unconditional (zeros) one."""
        if k is None:
            return torch.zeros(1, self.tokens, self.text_dim)
        g = torch.Generator().manual_seed(100 + k)
        return torch.randn(1, self.tokens, self.text_dim, generator=g)

    def conditioning(self, k: int | None) -> list:
        """ComfyUI CONDITIONING for class k (None: the negative prompt)."""
        return [[self.class_context(k), {}]]

    def build(self, trained: bool = True):
        """The model as a tiny-model case (a ComfyUI ModelPatcher on CPU); its weights from ``weights``."""
        from omnitest import tiny_models
        from safetensors.torch import load_file

        case = tiny_models.build_case("wan21_t2v", unet_overrides=self.config, latent_shape=self.latent_shape)
        if trained:
            dm = case.patcher.model.diffusion_model
            dm.load_state_dict({k: v.float() for k, v in load_file(str(self.weights)).items()})
        return case


def class_directions(seed: int = 1234, count: int = 2) -> list[torch.Tensor]:
    """``count`` per-class channel directions [CLASSES, 16] (unit vectors times 4, so ~unit per channel)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.functional.normalize(torch.randn(CLASSES, 16, generator=g), dim=1) * 4 for _ in range(count)]


def _grid(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    h = torch.arange(size).float() / size
    return torch.meshgrid(h, h, indexing="ij")


def waves_and_blobs(labels: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """The ``small`` model's data: one clean latent [16, 1, 8, 8] per label."""
    n = labels.shape[0]
    hh, ww = _grid(8)
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


ORIENTATIONS = [0.0, math.pi / 4, math.pi / 2, 3 * math.pi / 4]
STRIPES = [3.0, 4.5, 6.0, 3.5]  # cycles across the latent


def gabor_patches(labels: torch.Tensor, g: torch.Generator, patches: int = 3) -> torch.Tensor:
    """The ``wide`` model's data: one clean latent [16, 1, 16, 16] per label."""
    n = labels.shape[0]
    hh, ww = _grid(16)
    colours = torch.stack(class_directions(seed=4321, count=4), dim=1)  # [CLASSES, 4, 16]
    theta = torch.tensor(ORIENTATIONS)[labels][:, None] + (torch.rand(n, patches, generator=g) - 0.5) * 0.3
    freq = torch.tensor(STRIPES)[labels][:, None]
    center = torch.rand(n, patches, 2, generator=g) * 0.7 + 0.15
    width = torch.rand(n, patches, generator=g) * 0.1 + 0.1
    phase = torch.rand(n, patches, generator=g) * 2 * math.pi
    amp = torch.rand(n, patches, generator=g) * 0.8 + 0.4
    dy, dx = hh - center[..., 0, None, None], ww - center[..., 1, None, None]  # [n, patches, 16, 16]
    along = dx * torch.cos(theta)[..., None, None] + dy * torch.sin(theta)[..., None, None]
    envelope = torch.exp(-(dx ** 2 + dy ** 2) / (2 * width[..., None, None] ** 2))
    patch = amp[..., None, None] * envelope * torch.cos(2 * math.pi * freq[..., None, None] * along
                                                         + phase[..., None, None])
    which = torch.arange(patches) % 3
    x = torch.einsum("npyx,npc->ncyx", patch, colours[labels][:, which])
    slope = torch.rand(n, 2, generator=g) * 2 - 1
    background = slope[:, 0, None, None] * (hh - 0.5) + slope[:, 1, None, None] * (ww - 0.5)
    x = x + 0.5 * background[:, None] * colours[labels][:, 3, :, None, None]
    return x[:, :, None] * 0.6


SHAPE_VELOCITY = [(0.12, 0.0), (0.0, 0.12), (0.09, 0.09), (-0.1, 0.06)]  # per frame, in latent widths


def moving_shapes(labels: torch.Tensor, g: torch.Generator, frames: int = 3, size: int = 12) -> torch.Tensor:
    """The ``deep`` model's data: one clean latent [16, frames, size, size] per label."""
    n = labels.shape[0]
    hh, ww = _grid(size)
    colour = class_directions(seed=2468, count=1)[0][labels]  # [n, 16]
    velocity = torch.tensor(SHAPE_VELOCITY)[labels]  # [n, 2]
    start = torch.rand(n, 2, generator=g) * 0.4 + 0.2
    radius = torch.rand(n, generator=g) * 0.12 + 0.12
    amp = torch.rand(n, generator=g) * 0.8 + 0.6
    out = []
    for f in range(frames):
        center = start + f * velocity
        dy, dx = hh - center[:, 0, None, None], ww - center[:, 1, None, None]  # [n, size, size]
        r = radius[:, None, None]
        dist = torch.sqrt(dy ** 2 + dx ** 2)
        box = torch.maximum(dy.abs(), dx.abs())
        soft = lambda d: torch.sigmoid(d / 0.03)  # noqa: E731  a soft edge: inside where d > 0
        shapes = torch.stack([soft(r - dist), soft(r - box), soft(r - dist) * soft(dist - 0.55 * r),
                              torch.maximum(soft(0.35 * r - dy.abs()) * soft(r - dx.abs()),
                                            soft(0.35 * r - dx.abs()) * soft(r - dy.abs()))], dim=1)
        mask = shapes[torch.arange(n), labels]  # [n, size, size]
        out.append(amp[:, None, None, None] * colour[:, :, None, None] * mask[:, None])
    return torch.stack(out, dim=2) * 0.6


RING_TURN = [0.25, -0.35, 0.2, -0.15]  # radians per frame


def dot_rings(labels: torch.Tensor, g: torch.Generator, frames: int = 2, size: int = 16) -> torch.Tensor:
    """The ``long`` model's data: one clean latent [16, frames, size, size] per label."""
    n = labels.shape[0]
    hh, ww = _grid(size)
    dots, ground = (d[labels] for d in class_directions(seed=1357, count=2))  # [n, 16] each
    centre = torch.rand(n, 2, generator=g) * 0.3 + 0.35
    radius = torch.rand(n, generator=g) * 0.12 + 0.16
    angle = torch.rand(n, generator=g) * 2 * math.pi
    amp = torch.rand(n, generator=g) * 0.6 + 0.7
    waves = torch.randint(1, 3, (n, 3, 2), generator=g).float() * torch.sign(torch.rand(n, 3, 2, generator=g) - 0.5)
    wave_phase = torch.rand(n, 3, generator=g) * 2 * math.pi
    wave_amp = torch.rand(n, 3, generator=g) * 0.3
    background = sum(wave_amp[:, j, None, None] * torch.sin(2 * math.pi * (waves[:, j, 0, None, None] * hh
                                                                          + waves[:, j, 1, None, None] * ww)
                                                            + wave_phase[:, j, None, None]) for j in range(3))
    count, turn = labels + 2, torch.tensor(RING_TURN)[labels]
    out = []
    for f in range(frames):
        ring = torch.zeros(n, size, size)
        for j in range(5):
            theta = angle + f * turn + 2 * math.pi * j / count
            cy = centre[:, 0] + radius * torch.sin(theta)
            cx = centre[:, 1] + radius * torch.cos(theta)
            dot = torch.exp(-((hh - cy[:, None, None]) ** 2 + (ww - cx[:, None, None]) ** 2) / (2 * 0.05 ** 2))
            ring = ring + (j < count).float()[:, None, None] * dot
        out.append(amp[:, None, None, None] * dots[:, :, None, None] * ring[:, None]
                   + ground[:, :, None, None] * background[:, None])
    return torch.stack(out, dim=2) * 0.6


SMALL = QualityModel("small", {"dim": 64, "ffn_dim": 256, "num_heads": 2, "num_layers": 4, "text_dim": 32},
                     (1, 16, 1, 8, 8), 4, waves_and_blobs, DATA / "cache_quality_wan.safetensors",
                     "dim 64, 4 blocks, an 8x8 latent (16 tokens), waves and blobs")
WIDE = QualityModel("wide", {"dim": 256, "ffn_dim": 512, "num_heads": 4, "num_layers": 6, "text_dim": 64},
                    (1, 16, 1, 16, 16), 6, gabor_patches, DATA / "cache_quality_wan_wide.safetensors",
                    "dim 256, 6 blocks, a 16x16 latent (64 tokens), oriented stripe patches")
DEEP = QualityModel("deep", {"dim": 128, "ffn_dim": 384, "num_heads": 4, "num_layers": 10, "text_dim": 48},
                    (1, 16, 3, 12, 12), 5, moving_shapes, DATA / "cache_quality_wan_deep.safetensors",
                    "dim 128, 10 blocks, a 3-frame 12x12 latent (108 tokens), moving shapes")
LONG = QualityModel("long", {"dim": 192, "ffn_dim": 576, "num_heads": 4, "num_layers": 8, "text_dim": 40},
                    (1, 16, 2, 16, 16), 6, dot_rings, DATA / "cache_quality_wan_long.safetensors",
                    "dim 192, 8 blocks, a 2-frame 16x16 latent (128 tokens), turning rings of dots")
MODELS = {m.name: m for m in (SMALL, WIDE, DEEP, LONG)}
