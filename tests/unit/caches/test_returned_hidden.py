"""A stack whose forward reshapes the blocks' tokens before the next module (Kandinsky 5 folds them into the latent
grid): no module receives the stack's output as tokens, so its last block is its own tail (``ReturnedHidden``) and a
cache stores and reuses the residual of that block's output."""
from __future__ import annotations

import pytest
import torch

from omni_hooks import module_has_active_hooks
from omni_hooks.blockstack import BlockStack, ReturnedHidden, StackSignal, TensorArg, skip_returning
from omni_hooks.teacache import CallContext, TeaCacheConfig, apply_teacache_hook

ALWAYS_REUSE = (0.0, 0.0, 0.0, 0.0, 0.0)
X = TensorArg("x", 0)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x, t):
        self.calls += 1
        return x + torch.tanh(self.proj(x) * t[:, None, None])


class GridDiT(torch.nn.Module):
    """Tokens [B, H·W, 8] through the blocks, then reshaped to the grid [B, H, W, 8] for the output layer."""

    def __init__(self, depth=3):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(depth))
        self.out = torch.nn.Linear(8, 2)

    def forward(self, grid, t):
        shape = grid.shape[:-1]
        x = grid.flatten(1, -2)
        for block in self.blocks:
            x = block(x, t)
        return self.out(x.reshape(*shape, -1))


def stack_of(model: GridDiT) -> BlockStack:
    return BlockStack(blocks=list(model.blocks), tail=model.blocks[-1], head_hidden=X, tail_hidden=ReturnedHidden(),
                      skip_block=skip_returning(X), clone_head_input=False)


def run_steps(model, run, timesteps, grid):
    outputs = []
    for step, ts in enumerate(timesteps):
        run.begin_call(CallContext(branches=["c"], labels=["c"], step=step, total_steps=len(timesteps)))
        try:
            outputs.append(model(grid, torch.full((grid.shape[0],), ts)))
        finally:
            run.end_call()
    return outputs


def test_a_returned_hidden_tail_is_the_last_block_without_stream_tails():
    model = GridDiT()
    with pytest.raises(ValueError, match="last block as tail"):
        BlockStack(blocks=list(model.blocks), tail=model.out, head_hidden=X, tail_hidden=ReturnedHidden(),
                   skip_block=skip_returning(X))


@pytest.mark.parametrize("depth", [1, 3])
def test_threshold_zero_is_bit_identical_and_a_reuse_replaces_the_last_blocks_output(depth):
    model = GridDiT(depth)
    grid = torch.randn(2, 3, 4, 8, generator=torch.Generator().manual_seed(1))
    timesteps = [1.0, 0.9, 0.8]
    expected = [model(grid, torch.full((2,), ts)) for ts in timesteps]
    signal = StackSignal(compute=lambda block, args, kwargs, captured: X.get(args, kwargs))
    run = apply_teacache_hook(stack_of(model), TeaCacheConfig(0.0, ALWAYS_REUSE), signal)
    assert all(torch.equal(a, b) for a, b in zip(run_steps(model, run, timesteps, grid), expected))
    run.remove()

    run = apply_teacache_hook(stack_of(model), TeaCacheConfig(0.5, ALWAYS_REUSE), signal)
    outputs = run_steps(model, run, timesteps, grid)
    assert [e.computed for e in run.stats.evaluations] == [True, False, True]
    assert [b.calls for b in model.blocks] == [8] * depth  # 3 plain + 3 at threshold 0 + 2 computed steps
    # the input does not change from step to step: the skipped step's head input plus the residual is what the
    # first step's blocks gave, reshaped to the grid by the model's own forward
    torch.testing.assert_close(outputs[1], expected[0], rtol=1e-6, atol=1e-6)
    assert run.branch_state("c").previous_residual.shape == (2, 12, 8)
    run.remove()
    assert not any(module_has_active_hooks(m) for m in (*model.blocks, model.out))

