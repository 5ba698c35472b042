"""A tiny Wan 2.1 t2v checkpoint (~1.1 M params, 4.4 MB fp32), written without importing ComfyUI.

ComfyUI's model detection (``comfy/model_detection.py``) reads everything it needs from the key set and the
shapes: ``head.modulation`` marks Wan, ``dim = head.modulation.shape[-1]`` (heads = dim // 128),
``ffn_dim = blocks.0.ffn.0.weight.shape[0]``, ``num_layers = count(blocks.N.)``, no ``img_emb.*`` → t2v.
The file loads with core ``UNETLoader {"unet_name": ..., "weight_dtype": "default"}`` and samples a
16-channel Wan 2.1 latent with a [1, tokens, 4096] text conditioning.

Values are deterministic for a given ``seed``: linear weights and modulations are ``randn * std``, biases
``randn * std`` as well, and the norm weights are ``1 + randn * std`` (with norm gains of ~0.02 the attention
would be almost uniform and the time embedding almost constant). The time-embedding input layer gets a larger
scale (``time_std``) so that the model output depends visibly on the timestep, which cache heuristics
(TeaCache, MagCache, EasyCache) need to see a non-trivial step-to-step change.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file

TEXT_DIM = 4096
FREQ_DIM = 256
IN_DIM = 16
OUT_DIM = 16
PATCH = (1, 2, 2)


def tiny_wan_shapes(num_blocks: int = 2, dim: int = 128, ffn_dim: int = 256) -> dict[str, tuple[int, ...]]:
    """Every key of the Wan 2.1 t2v state dict and its shape (the exact set ``WanModel`` builds)."""
    if dim % 128:
        raise ValueError("Wan's detection uses num_heads = dim // 128: dim must be a multiple of 128")
    if num_blocks < 1:
        raise ValueError("num_blocks must be >= 1")
    patch_out = OUT_DIM * PATCH[0] * PATCH[1] * PATCH[2]
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embedding.weight": (dim, IN_DIM, *PATCH),
        "patch_embedding.bias": (dim,),
        "text_embedding.0.weight": (dim, TEXT_DIM),
        "text_embedding.0.bias": (dim,),
        "text_embedding.2.weight": (dim, dim),
        "text_embedding.2.bias": (dim,),
        "time_embedding.0.weight": (dim, FREQ_DIM),
        "time_embedding.0.bias": (dim,),
        "time_embedding.2.weight": (dim, dim),
        "time_embedding.2.bias": (dim,),
        "time_projection.1.weight": (6 * dim, dim),
        "time_projection.1.bias": (6 * dim,),
    }
    for i in range(num_blocks):
        b = f"blocks.{i}."
        shapes[b + "modulation"] = (1, 6, dim)
        for attn in ("self_attn", "cross_attn"):
            for proj in ("q", "k", "v", "o"):
                shapes[f"{b}{attn}.{proj}.weight"] = (dim, dim)
                shapes[f"{b}{attn}.{proj}.bias"] = (dim,)
            shapes[f"{b}{attn}.norm_q.weight"] = (dim,)
            shapes[f"{b}{attn}.norm_k.weight"] = (dim,)
        shapes[b + "norm3.weight"] = (dim,)
        shapes[b + "norm3.bias"] = (dim,)
        shapes[b + "ffn.0.weight"] = (ffn_dim, dim)
        shapes[b + "ffn.0.bias"] = (ffn_dim,)
        shapes[b + "ffn.2.weight"] = (dim, ffn_dim)
        shapes[b + "ffn.2.bias"] = (dim,)
    shapes["head.modulation"] = (1, 2, dim)
    shapes["head.head.weight"] = (patch_out, dim)
    shapes["head.head.bias"] = (patch_out,)
    return shapes


def tiny_wan_state_dict(num_blocks: int = 2, *, dim: int = 128, ffn_dim: int = 256, seed: int = 0,
                        std: float = 0.02, time_std: float = 0.2,
                        dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The deterministic tiny Wan 2.1 t2v state dict (contiguous CPU tensors, sorted keys)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for key, shape in tiny_wan_shapes(num_blocks, dim, ffn_dim).items():
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        if key.endswith(("norm_q.weight", "norm_k.weight", "norm3.weight")):
            value = 1.0 + noise * std
        elif key == "time_embedding.0.weight":
            value = noise * time_std
        else:
            value = noise * std
        sd[key] = value.to(dtype).contiguous()
    return sd


def write_tiny_wan(path: str | os.PathLike, num_blocks: int = 2, **kwargs) -> Path:
    """Write the tiny Wan checkpoint to ``path`` (parents created) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tiny_wan_state_dict(num_blocks, **kwargs), str(tmp))
    os.replace(tmp, path)
    return path
