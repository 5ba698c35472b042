"""A two-block stack whose residual is a known function of sigma, for the forecasting and skip-correction unit tests:
what a cache reuses, forecasts or corrects can be checked against the exact residual."""
from __future__ import annotations

from typing import Callable

import torch

from omni_hooks.blockstack import BlockStack, TensorArg, skip_returning

X = TensorArg("x", 0)


class SigmaBlock(torch.nn.Module):
    """Adds ``residual(sigma, row)`` to each batch row: the stack's residual is known exactly."""

    def __init__(self, residual: Callable[[float, int], torch.Tensor]):
        super().__init__()
        self.residual = residual
        self.calls = 0

    def forward(self, x, *, sigma):
        self.calls += 1
        return x + torch.stack([self.residual(float(s), i) for i, s in enumerate(sigma)])


class Model(torch.nn.Module):
    """``SigmaBlock(residual)``, then a block that adds nothing, then an identity tail: ``model(x, sigma)`` is x plus
    the residual, per row of ``x`` ([rows, 4, 3])."""

    def __init__(self, residual: Callable[[float, int], torch.Tensor]):
        super().__init__()
        self.blocks = torch.nn.ModuleList([SigmaBlock(residual), SigmaBlock(lambda s, i: torch.zeros(4, 3))])
        self.tail = torch.nn.Identity()

    def forward(self, x, sigma):
        for block in self.blocks:
            x = block(x, sigma=sigma)
        return self.tail(x)


def stack_of(model: Model) -> BlockStack:
    return BlockStack(blocks=list(model.blocks), tail=model.tail, head_hidden=X, tail_hidden=TensorArg("input", 0),
                      skip_block=skip_returning(X))
