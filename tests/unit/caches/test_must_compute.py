"""A stack that names calls it must compute (``BlockStack.must_compute``; HiDream-O1's layers fill the model's own
key/value cache on some calls): both caches compute those calls whatever they decided, with the stack's reason, and
skip the others as usual."""
from __future__ import annotations

import pytest
import torch

from omni_hooks.blockstack import BlockStack, StackSignal, TensorArg, skip_returning
from omni_hooks.magcache import MagCacheConfig, apply_mag_cache_hook
from omni_hooks.teacache import CallContext, TeaCacheConfig, apply_teacache_hook

X = TensorArg("x", 0)
ALWAYS_REUSE = (0.0, 0.0, 0.0, 0.0, 0.0)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x, t, fill=False):
        self.calls += 1
        return x + torch.tanh(self.linear(x) * t)


class DiT(torch.nn.Module):
    def __init__(self, depth=2):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(depth))
        self.out = torch.nn.LayerNorm(4)

    def forward(self, x, t, fill=False):
        for block in self.blocks:
            x = block(x, t, fill=fill)
        return self.out(x)


def stack_of(model: DiT) -> BlockStack:
    return BlockStack(blocks=list(model.blocks), tail=model.out, head_hidden=X, tail_hidden=TensorArg("input", 0),
                      skip_block=skip_returning(X), clone_head_input=False,
                      must_compute=lambda args, kwargs: "model-cache" if kwargs.get("fill") else None)


FILLS = [True, False, True, False, False, False]  # which step's call fills the model's own cache


def run_steps(model, run):
    x = torch.randn(1, 3, 4, generator=torch.Generator().manual_seed(1))
    for step, fill in enumerate(FILLS):
        run.begin_call(CallContext(branches=["c"], labels=["c"], step=step, total_steps=len(FILLS)))
        try:
            model(x, 1.0, fill=fill)
        finally:
            run.end_call()
    return [(e.computed, e.branches[0].reason) for e in run.stats.evaluations]


@pytest.mark.parametrize("cache", ["teacache", "magcache"])
def test_a_call_the_stack_must_compute_is_computed_and_says_why(cache):
    model = DiT()
    if cache == "teacache":
        run = apply_teacache_hook(stack_of(model), TeaCacheConfig(1e9, ALWAYS_REUSE), StackSignal(
            compute=lambda block, args, kwargs, captured: X.get(args, kwargs)))
    else:
        run = apply_mag_cache_hook(stack_of(model), MagCacheConfig(threshold=1e9, mag_ratios=(1.0,) * len(FILLS),
                                                                   max_skip_steps=99, retention_ratio=0.0))
    decisions = run_steps(model, run)
    run.remove()
    assert decisions[0] == (True, "first")
    assert decisions[2] == (True, "model-cache")
    # (TeaCache also computes the last step)
    assert [computed for computed, _ in decisions[:5]] == [True, False, True, False, False]
