"""A small DiT-shaped block stack for the offload tests: every kind of tensor a real block has.

Each ``ToyBlock`` holds a Linear, a LayerNorm (weight and bias), a modulation Linear the caches' signal reads, a
bfloat16 gate, a transposed (non-contiguous) projection, a float64 buffer and an int64 buffer, so packing, binding and
restoring are exercised across dtypes and layouts. ``ToyStack.probe`` (if set) is called by every block while it
computes, which is how the tests see residency at that moment.
"""
from __future__ import annotations

from typing import Callable

import torch

from omni_hooks.blockstack import BlockStack, TensorArg, skip_returning


class ToyBlock(torch.nn.Module):
    def __init__(self, dim: int, owner: "ToyStack"):
        super().__init__()
        self.lin = torch.nn.Linear(dim, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.mod = torch.nn.Linear(dim, dim)
        self.gate = torch.nn.Parameter(torch.rand(dim).to(torch.bfloat16))
        self.proj = torch.nn.Parameter(torch.randn(dim, dim).t() / dim ** 0.5)  # transposed: non-contiguous
        self.register_buffer("scale", torch.rand(dim, dtype=torch.float64) + 0.5)
        self.register_buffer("perm", torch.randperm(dim))
        self.calls = 0
        self.fail_next = False
        self._owner = [owner]  # a list, so the stack is not registered as a submodule of its own block

    def forward(self, x: torch.Tensor, *, t: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        owner = self._owner[0]
        if owner.probe is not None:
            owner.probe(self)
        h = self.norm(self.lin(x)) * (1 + self.mod(t)[:, None])
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("toy block failure")
        h = (h[..., self.perm] * self.scale.to(h.dtype)) @ self.proj
        return x + torch.tanh(h * self.gate.to(h.dtype))


class ToyStack(torch.nn.Module):
    """embed -> time_proj(t) -> blocks(x, t=...) -> tail(x)."""

    def __init__(self, dim: int = 16, depth: int = 5, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Linear(dim, dim)
        self.time_proj = torch.nn.Linear(1, dim)
        self.blocks = torch.nn.ModuleList(ToyBlock(dim, self) for _ in range(depth))
        self.tail = torch.nn.Linear(dim, dim)
        self.probe: Callable[[ToyBlock], None] | None = None

    def forward(self, x: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        t = self.time_proj(timestep[:, None])
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, t=t)
        return self.tail(h)


def block_is_resident(block: torch.nn.Module) -> bool:
    """True when the block's weights are real tensors (an offloaded block holds 0-element placeholders)."""
    return block.lin.weight.numel() > 0


def resident_count(model: ToyStack) -> int:
    return sum(block_is_resident(b) for b in model.blocks)


def toy_block_stack(model: ToyStack) -> BlockStack:
    """The stack description the caches use for ``ToyStack``."""
    return BlockStack(blocks=list(model.blocks), tail=model.tail, head_hidden=TensorArg("x", 0),
                      tail_hidden=TensorArg("input", 0), skip_block=skip_returning(TensorArg("x", 0)))


def toy_inputs(batch: int = 2, tokens: int = 6, dim: int = 16, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, tokens, dim, generator=generator)
