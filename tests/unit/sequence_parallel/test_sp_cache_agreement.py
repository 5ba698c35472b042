"""The caches' hook point for sequence parallelism, in one process: ``CallContext.rank.agreement`` is asked exactly
once per call for the mean of the measured metrics and once for the verdict, whatever this rank measured, and a
verdict a peer forces is recorded as such (the multi-rank behaviour is in test_sp_ranks.py)."""
from __future__ import annotations

import torch

from omni_hooks.context import CallContext, RankView
from omni_hooks.magcache import MagCacheConfig, apply_mag_cache_hook
from omni_hooks.blockstack import StackSignal
from omni_hooks.teacache import TeaCacheConfig, apply_teacache_hook
from omnitest.toy_dit import ToyDiT, toy_inputs, toy_stack


class PretendPeers:
    """An agreement whose peers measured ``offset`` more than this rank and, from call ``peer_computes_from`` on,
    want to compute."""

    def __init__(self, offset: float = 0.0, peer_computes_from: int | None = None):
        self.offset = offset
        self.peer_computes_from = peer_computes_from
        self.means: list[list[float]] = []
        self.verdicts: list[bool] = []

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        self.means.append(values.tolist())
        return values.double().cpu() + self.offset / 2

    def any(self, flag: bool) -> bool:
        self.verdicts.append(flag)
        peer = self.peer_computes_from is not None and len(self.verdicts) > self.peer_computes_from
        return flag or peer


def run(model, cache_run, agreement, steps=6):
    inputs = toy_inputs(image_tokens=8)
    for step in range(steps):
        cache_run.begin_call(CallContext(["c", "u"], ["cond", "uncond"], step=step, total_steps=steps,
                                         rank=RankView(0, 2, agreement)))
        try:
            with torch.no_grad():
                model(**dict(inputs, t=inputs["t"] * (1 - step / steps)))
        finally:
            cache_run.end_call()
    return cache_run.stats.evaluations


def slow_signal() -> StackSignal:
    calls = [0]

    def compute(block, args, kwargs, captured):
        calls[0] += 1
        return torch.full((args[0].shape[0], 4), 1.0 + 0.01 * calls[0])

    return StackSignal(compute=compute)


def test_teacache_asks_once_per_call_and_decides_on_the_mean_over_ranks():
    model = ToyDiT()
    peers = PretendPeers(offset=0.1)  # the mean rel-L1 is this rank's + 0.05
    cache = apply_teacache_hook(toy_stack(model), TeaCacheConfig(threshold=0.2), slow_signal())
    evaluations = run(model, cache, peers)
    assert len(peers.means) == len(peers.verdicts) == 6  # also on the first call, where nothing is measured
    assert peers.means[0] == [0.0, 0.0]
    # this rank alone: rel ~0.01 per call, 0.05 after five calls, far below 0.2 (only the first and the forced last
    # call computed); with the peers the mean is ~0.06 per call and passes 0.2 at the fifth call
    metrics = [b.metric for e in evaluations for b in e.branches if b.metric is not None]
    assert metrics and all(m > 0.05 for m in metrics)
    assert [e.computed for e in evaluations] == [True, False, False, False, True, True]
    assert [b.reason for b in evaluations[4].branches] == ["threshold", "threshold"]


def test_a_verdict_forced_by_a_peer_is_recorded_as_other_rank_and_restarts_the_accumulators():
    model = ToyDiT()
    peers = PretendPeers(peer_computes_from=3)
    cache = apply_mag_cache_hook(toy_stack(model), MagCacheConfig(threshold=1.0, max_skip_steps=10,
                                                                  retention_ratio=0.0, mag_ratios=[1.0] * 6))
    evaluations = run(model, cache, peers)
    assert peers.verdicts == [True, False, False, False, False, False]  # what this rank wanted
    assert [e.computed for e in evaluations] == [True, False, False, True, True, True]
    assert [b.reason for b in evaluations[3].branches] == ["other-rank", "other-rank"]
    assert peers.means == []  # MagCache's decision depends on the step and its curve only: nothing to average
