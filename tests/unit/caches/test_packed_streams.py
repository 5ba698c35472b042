"""A stack whose blocks pass two streams in one argument and whose output leaves through one tail per stream (LTX-2's
video and audio): the caches decide on both streams, store one residual over both and add each stream's share at its
own tail."""
from __future__ import annotations

import pytest
import torch

from omni_hooks import module_has_active_hooks
from omni_hooks.blockstack import BlockStack, PackedStreams, StackSignal, TensorArg, pack_streams, skip_returning
from omni_hooks.teacache import CallContext, TeaCacheConfig, apply_teacache_hook

ALWAYS_REUSE = (0.0, 0.0, 0.0, 0.0, 0.0)
STREAMS = PackedStreams("x", 0)


class TwoStreamBlock(torch.nn.Module):
    """(video [B, Nv, 8], audio [B, Na, 4]) -> the same, each stream updated in place from both."""

    def __init__(self):
        super().__init__()
        self.v = torch.nn.Linear(8, 8)
        self.a = torch.nn.Linear(4, 4)
        self.a2v = torch.nn.Linear(4, 8)
        self.calls = 0

    def forward(self, x, t):
        self.calls += 1
        vx, ax = x
        vx.add_(torch.tanh(self.v(vx) * t[:, None, None]) + self.a2v(ax.mean(1, keepdim=True)))
        ax.add_(torch.tanh(self.a(ax) * t[:, None, None]))
        return vx, ax


class TwoStreamDiT(torch.nn.Module):
    def __init__(self, depth=3):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(TwoStreamBlock() for _ in range(depth))
        self.video_out = torch.nn.LayerNorm(8)
        self.audio_out = torch.nn.LayerNorm(4)

    def forward(self, vx, ax, t):
        vx, ax = vx.clone(), ax.clone()
        for block in self.blocks:
            vx, ax = block((vx, ax), t)
        return torch.cat([self.video_out(vx).flatten(1), self.audio_out(ax).flatten(1)], 1)


def stack_of(model: TwoStreamDiT) -> BlockStack:
    return BlockStack(blocks=list(model.blocks), tail=model.video_out, head_hidden=STREAMS,
                      tail_hidden=TensorArg("input", 0), skip_block=skip_returning(TensorArg("x", 0)),
                      stream_tails=[(model.audio_out, TensorArg("input", 0))])


def signal(block, args, kwargs, captured):
    return pack_streams(TensorArg("x", 0).get(args, kwargs))


def run_steps(model, run, timesteps, vx, ax):
    outputs = []
    for step, ts in enumerate(timesteps):
        run.begin_call(CallContext(branches=["c"], labels=["c"], step=step, total_steps=len(timesteps)))
        try:
            outputs.append(model(vx, ax, torch.full((vx.shape[0],), ts)))
        finally:
            run.end_call()
    return outputs


def inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 5, 8, generator=g), torch.randn(2, 3, 4, generator=g)


def test_stream_tails_need_packed_streams():
    model = TwoStreamDiT()
    with pytest.raises(ValueError, match="PackedStreams"):
        BlockStack(blocks=list(model.blocks), tail=model.video_out, head_hidden=TensorArg("x", 0),
                   tail_hidden=TensorArg("input", 0), skip_block=skip_returning(TensorArg("x", 0)),
                   stream_tails=[(model.audio_out, TensorArg("input", 0))])


def test_threshold_zero_is_bit_identical_and_a_reuse_adds_each_streams_share_at_its_tail():
    model = TwoStreamDiT()
    vx, ax = inputs()
    timesteps = [1.0, 0.9, 0.8]
    expected = [model(vx, ax, torch.full((2,), ts)) for ts in timesteps]
    run = apply_teacache_hook(stack_of(model), TeaCacheConfig(0.0, ALWAYS_REUSE), StackSignal(compute=signal))
    assert all(torch.equal(a, b) for a, b in zip(run_steps(model, run, timesteps, vx, ax), expected))
    run.remove()

    tails = {"video": [], "audio": []}  # what each tail module made (after the cache replaced its input)
    model.video_out.register_forward_hook(lambda m, args, out: tails["video"].append(out.clone()))
    model.audio_out.register_forward_hook(lambda m, args, out: tails["audio"].append(out.clone()))
    run = apply_teacache_hook(stack_of(model), TeaCacheConfig(0.5, ALWAYS_REUSE), StackSignal(compute=signal))
    outputs = run_steps(model, run, timesteps, vx, ax)
    assert [e.computed for e in run.stats.evaluations] == [True, False, True]
    assert [b.calls for b in model.blocks] == [8, 8, 8]  # 3 plain + 3 at threshold 0 + 2 computed steps
    # the inputs do not change from step to step: the skipped step's head input plus the residual is what the first
    # step's blocks gave, stream by stream
    for stream in ("video", "audio"):
        torch.testing.assert_close(tails[stream][1], tails[stream][0], rtol=1e-6, atol=1e-6)
        assert not torch.equal(tails[stream][2], tails[stream][0])  # the last step computes at its own timestep
    torch.testing.assert_close(outputs[1], expected[0], rtol=1e-6, atol=1e-6)
    residual = run.branch_state("c").previous_residual
    assert residual.shape == (2, 5 * 8 + 3 * 4)
    run.remove()
    assert not any(module_has_active_hooks(m) for m in (*model.blocks, model.video_out, model.audio_out))
