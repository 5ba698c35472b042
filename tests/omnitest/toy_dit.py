"""A small diffusion transformer written for the sequence-parallel tests and benchmark (no host code).

It has what matters to sequence parallelism in the hosts' DiTs: text and image tokens, rotary position embeddings
applied before the attention call, an MMDiT-style joint block (text and image in one self-attention, q/k/v passed
``[B, H, L, D]``), a Wan-style block (image self-attention, q/k/v passed ``[B, L, H·D]``, then cross-attention to the
text), a timestep modulation, and an attention seam like ComfyUI's (``transformer_options["attention_override"]`` is
called as ``override(func, q, k, v, heads, mask=..., skip_reshape=..., skip_output_reshape=..., **kw)``).

``sp_plan(auto_pad, depth)`` splits ``img`` and the image part of ``ids`` at the root, mark both blocks'
self-attention as sites (the joint one with the text length as joint tokens) and gather at ``final``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from omni_hooks.blockstack import BlockStack, TensorArg
from omni_hooks.sequence_parallel import (
    SequenceParallelInput,
    SequenceParallelOutput,
    SequenceParallelPartialInput,
    SequenceParallelSelfAttention,
)


def local_attention(q, k, v, heads, mask=None, skip_reshape=False, skip_output_reshape=False, **kwargs):
    """The toy host's own attention: ``[B, L, H·D]`` (or ``[B, H, L, D]`` with ``skip_reshape``) in and out."""
    if not skip_reshape:
        b, length, width = q.shape
        q, k, v = (t.reshape(b, t.shape[1], heads, width // heads).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if skip_output_reshape:
        return out
    b, h, length, d = out.shape
    return out.transpose(1, 2).reshape(b, length, h * d)


def attention(q, k, v, heads, transformer_options, **kwargs):
    override = transformer_options.get("attention_override")
    if override is not None:
        return override(local_attention, q, k, v, heads, **kwargs)
    return local_attention(q, k, v, heads, **kwargs)


def rope_table(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """cos/sin of ``positions`` ``[N]`` at ``dim/2`` frequencies: ``[N, dim/2, 2]``."""
    freqs = 1.0 / (100.0 ** (torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim))
    angles = positions.double()[:, None] * freqs[None]
    return torch.stack([angles.cos(), angles.sin()], -1).to(torch.float32)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of ``x`` ``[B, N, H, D]`` by ``table`` ``[N, D/2, 2]``."""
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    cos, sin = table[None, :, None, :, 0], table[None, :, None, :, 1]
    real, imag = pairs[..., 0], pairs[..., 1]
    return torch.stack([real * cos - imag * sin, real * sin + imag * cos], -1).reshape(x.shape)


class JointAttention(torch.nn.Module):
    """Text and image tokens in one self-attention (``[text | image]``), q/k/v passed heads-first."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv_img = torch.nn.Linear(dim, 3 * dim)
        self.qkv_txt = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x, c, table, transformer_options):
        b, length, dim = x.shape
        shape = (b, -1, 3, self.heads, dim // self.heads)
        qi, ki, vi = self.qkv_img(x).reshape(shape).unbind(2)
        qt, kt, vt = self.qkv_txt(c).reshape(shape).unbind(2)
        q = apply_rope(torch.cat([qt, qi], 1), table)
        k = apply_rope(torch.cat([kt, ki], 1), table)
        v = torch.cat([vt, vi], 1)
        out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.heads, transformer_options,
                        skip_reshape=True)
        return out[:, c.shape[1]:], out[:, :c.shape[1]]


class SelfAttention(torch.nn.Module):
    """Image self-attention, q/k/v passed ``[B, L, H·D]``."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x, table, transformer_options):
        b, length, dim = x.shape
        q, k, v = self.qkv(x).reshape(b, length, 3, self.heads, dim // self.heads).unbind(2)
        q, k = apply_rope(q, table), apply_rope(k, table)
        out = attention(q.reshape(b, length, dim), k.reshape(b, length, dim), v.reshape(b, length, dim), self.heads,
                        transformer_options)
        return self.out(out)


class CrossAttention(torch.nn.Module):
    """Image queries, text keys (replicated on every rank): no exchange needed."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * dim)

    def forward(self, x, c, transformer_options):
        k, v = self.kv(c).chunk(2, -1)
        return attention(self.q(x), k.contiguous(), v.contiguous(), self.heads, transformer_options)


class ModulatedBlock(torch.nn.Module):
    """A block's timestep modulation (scale and shift of the normalised stream) and MLP."""

    def __init__(self, dim: int):
        super().__init__()
        self.mod = torch.nn.Linear(dim, 2 * dim)
        self.norm = torch.nn.LayerNorm(dim, elementwise_affine=False)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))

    def modulated(self, x, temb):
        scale, shift = self.mod(temb)[:, None].chunk(2, -1)
        return self.norm(x) * (1 + scale) + shift


class JointBlock(ModulatedBlock):
    def __init__(self, dim: int, heads: int):
        super().__init__(dim)
        self.attn = JointAttention(dim, heads)
        self.proj_img = torch.nn.Linear(dim, dim)
        self.proj_txt = torch.nn.Linear(dim, dim)

    def forward(self, x, c, temb, table, transformer_options):
        img, txt = self.attn(self.modulated(x, temb), self.norm(c), table, transformer_options)
        x = x + self.proj_img(img)
        c = c + self.proj_txt(txt)
        return x + self.mlp(self.norm(x)), c


class SelfCrossBlock(ModulatedBlock):
    def __init__(self, dim: int, heads: int):
        super().__init__(dim)
        self.self_attn = SelfAttention(dim, heads)
        self.cross_attn = CrossAttention(dim, heads)

    def forward(self, x, c, temb, table, transformer_options):
        x = x + self.self_attn(self.modulated(x, temb), table[c.shape[1]:], transformer_options)
        x = x + self.cross_attn(self.norm(x), c, transformer_options)
        return x + self.mlp(self.norm(x)), c


class ToyDiT(torch.nn.Module):
    """``forward(img [B, L, in], txt [B, T, txt_in], t [B], ids [T + L])`` -> ``[B, L, in]``.

    ``ids`` are the rotary positions of ``[text | image]`` (like Flux's txt_ids/img_ids), so a rank that holds a
    slice of the image still rotates its tokens by their global positions.
    """

    def __init__(self, in_channels: int = 4, txt_channels: int = 6, dim: int = 32, heads: int = 4,
                 depth: int = 2, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.heads = heads
        self.img_in = torch.nn.Linear(in_channels, dim)
        self.txt_in = torch.nn.Linear(txt_channels, dim)
        self.t_in = torch.nn.Sequential(torch.nn.Linear(1, dim), torch.nn.SiLU(), torch.nn.Linear(dim, dim))
        self.blocks = torch.nn.ModuleList(JointBlock(dim, heads) if i % 2 == 0 else SelfCrossBlock(dim, heads)
                                          for i in range(depth))
        self.final = torch.nn.Linear(dim, in_channels)

    def forward(self, img, txt, t, ids, transformer_options=None):
        options = transformer_options or {}
        x, c = self.img_in(img), self.txt_in(txt)
        temb = self.t_in(t[:, None])
        table = rope_table(ids, x.shape[-1] // self.heads)
        for block in self.blocks:
            x, c = block(x, c, temb, table, transformer_options=options)
        return self.final(x)


def sp_plan(auto_pad: bool = False, depth: int = 2) -> dict:
    """The toy's sequence-parallel plan (for a ``ToyDiT`` of ``depth`` blocks)."""
    plan = {
        "": {"img": SequenceParallelInput(split_dim=1, expected_dims=3, auto_pad=auto_pad),
             "ids": SequenceParallelPartialInput(split_dim=0, text_len_source="txt", text_len_dim=1,
                                                 auto_pad=auto_pad)},
        "final": SequenceParallelOutput(gather_dim=1, expected_dims=3),
    }
    for i in range(depth):
        if i % 2 == 0:
            plan[f"blocks.{i}.attn"] = SequenceParallelSelfAttention(joint_tokens="c", joint_tokens_dim=1)
        else:
            plan[f"blocks.{i}.self_attn"] = SequenceParallelSelfAttention()
    return plan


def toy_inputs(batch: int = 2, image_tokens: int = 16, text_tokens: int = 5, seed: int = 1, in_channels: int = 4,
               txt_channels: int = 6) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"img": torch.randn(batch, image_tokens, in_channels, generator=g),
            "txt": torch.randn(batch, text_tokens, txt_channels, generator=g),
            "t": torch.rand(batch, generator=g),
            "ids": torch.arange(text_tokens + image_tokens, dtype=torch.float32)}


def toy_stack(model: ToyDiT) -> BlockStack:
    """The toy's block stack for TeaCache/MagCache: blocks take and return (x, c); ``final`` is the tail."""
    x, c = TensorArg("x", 0), TensorArg("c", 1)
    return BlockStack(blocks=list(model.blocks), tail=model.final, head_hidden=x, tail_hidden=TensorArg("input", 0),
                      skip_block=lambda block, args, kwargs: (x.get(args, kwargs), c.get(args, kwargs)))
