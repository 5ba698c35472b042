"""Cross-attention over split keys (``SequenceParallelCrossAttention``): queries every rank holds whole, keys and
values split across the ranks (padded at the end), as LTX-2's audio attending to its video. On 2 and 4 gloo ranks
(tests/omnitest/rank_pool.py) against a float64 reference over every key, in one process for what needs no peer."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from omni_hooks.sequence_parallel import (
    ActiveSite,
    PaddingRecord,
    SequenceParallelConfig,
    SequenceParallelCrossAttention,
    SequenceParallelMesh,
    SequenceParallelRun,
    sdpa_attention,
)

TIMEOUT_S = 90


def full_attention(q, k, v):
    """float64 reference over ``[B, L, H, D]``."""
    qh, kh, vh = (t.double().transpose(1, 2) for t in (q, k, v))
    weights = torch.softmax(qh @ kh.transpose(-1, -2) * q.shape[-1] ** -0.5, -1)
    return (weights @ vh).transpose(1, 2)


def host_layout(t: torch.Tensor, heads_first: bool) -> torch.Tensor:
    return t.transpose(1, 2) if heads_first else t.reshape(t.shape[0], t.shape[1], -1)


def rank_split_keys_entry(ulysses: int, ring: int, queries: int, keys: int, heads_first: bool):
    """This rank's output of the entry at a cross-attention site against the reference, the head counts the host
    function was called with, whether the bytes match a simulated mesh's, and the output itself (every rank must hold
    the same)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    config = SequenceParallelConfig(ulysses_degree=ulysses, ring_degree=ring)
    runtime = SequenceParallelRun(config)
    g = torch.Generator().manual_seed(5)
    b, heads, dim = 2, 4, 8
    q = torch.randn(b, queries, heads, dim, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, keys, heads, dim, generator=g, dtype=torch.float64) for _ in range(2))
    reference = full_attention(q, k, v)
    local = -(-keys // world)
    if keys % world:
        runtime.padding[None] = PaddingRecord(keys, local * world)

    def mine(t):  # this rank's keys, the padding garbage (it must be left out)
        padded = torch.cat([t, t.new_full((b, local * world - keys, heads, dim), 7.0)], 1)
        return padded[:, rank * local:(rank + 1) * local]

    calls = []

    def host(q_, k_, v_, heads_, **kwargs):
        calls.append(heads_)
        return sdpa_attention(q_, k_, v_, heads_, **kwargs)

    site = ActiveSite(SequenceParallelCrossAttention(), 0, torch.nn.Identity())
    runtime.enter_site(site)
    args = (host_layout(q, heads_first), host_layout(mine(k), heads_first), host_layout(mine(v), heads_first))
    out = runtime.attention(host, *args, heads, skip_reshape=heads_first, skip_output_reshape=heads_first)
    out = out.transpose(1, 2) if heads_first else out.reshape(b, queries, heads, dim)
    simulated = SequenceParallelRun(config, SequenceParallelMesh.simulated_for(config, rank))
    simulated.padding.update(runtime.padding)
    simulated.enter_site(site)
    simulated.attention(sdpa_attention, *(a.to("meta") for a in args), heads, skip_reshape=heads_first,
                        skip_output_reshape=heads_first)
    same_bytes = {kind: (r.calls, r.bytes_sent) for kind, r in simulated.stats.by_kind.items()} == {
        kind: (r.calls, r.bytes_sent) for kind, r in runtime.stats.by_kind.items()}
    return (out - reference).abs().max().item(), calls, same_bytes, out


@pytest.mark.parametrize("ulysses, ring, queries, keys, heads_first", [
    (2, 1, 5, 16, False), (2, 1, 1, 13, True), (1, 2, 5, 13, False), (1, 2, 3, 1, True)])
def test_split_keys_on_two_ranks_give_every_rank_the_attention_over_every_key(rank_pool, ulysses, ring, queries,
                                                                              keys, heads_first):
    results = rank_pool(2).run(rank_split_keys_entry, ulysses, ring, queries, keys, heads_first, timeout=TIMEOUT_S)
    for error, calls, same_bytes, _ in results:
        assert error < 1e-12 and same_bytes
        assert calls == ([4 // ulysses] if ring == 1 else [])  # across a ring the merge needs the log-sum-exp
    assert torch.equal(results[0][3], results[1][3])


@pytest.mark.parametrize("ulysses, ring, queries, keys, heads_first", [
    (2, 2, 5, 16, False), (2, 2, 2, 13, True), (4, 1, 3, 14, False), (1, 4, 1, 3, True)])
def test_split_keys_on_four_ranks_hybrid_give_every_rank_the_same_output(rank_pool, ulysses, ring, queries, keys,
                                                                         heads_first):
    results = rank_pool(4).run(rank_split_keys_entry, ulysses, ring, queries, keys, heads_first, timeout=TIMEOUT_S)
    for error, _, same_bytes, out in results:
        assert error < 1e-12 and same_bytes
        assert torch.equal(out, results[0][3])


def test_a_cross_site_sends_the_keys_once_and_gathers_only_the_short_output():
    """Bytes per rank on a simulated mesh of 2: the keys and values all-to-all (half of each shard leaves), and the
    queries' output heads (all-gather); across a ring the partial outputs with their log-sum-exps."""
    b, queries, keys, heads, dim = 1, 4, 32, 4, 8
    q = torch.zeros(b, queries, heads * dim, device="meta")
    kv = torch.zeros(b, keys // 2, heads * dim, device="meta")
    sent = {}
    for ulysses, ring in ((2, 1), (1, 2)):
        config = SequenceParallelConfig(ulysses_degree=ulysses, ring_degree=ring)
        runtime = SequenceParallelRun(config, SequenceParallelMesh.simulated_for(config, 0))
        runtime.enter_site(ActiveSite(SequenceParallelCrossAttention(), 0, torch.nn.Identity()))
        runtime.attention(sdpa_attention, q, kv, kv, heads)
        sent[(ulysses, ring)] = {kind: r.bytes_sent for kind, r in runtime.stats.by_kind.items()}
    shard = b * (keys // 2) * heads * dim * 4
    assert sent[(2, 1)] == {"ulysses_all_to_all": 2 * shard // 2,
                            "cross_heads_all_gather": b * queries * heads * dim * 2}
    assert sent[(1, 2)] == {"cross_partial_all_gather": b * heads * queries * (dim + 1) * 4}


def test_a_cross_site_refuses_a_mask_and_mismatched_keys_naming_it():
    config = SequenceParallelConfig(ulysses_degree=2)
    runtime = SequenceParallelRun(config, SequenceParallelMesh.simulated_for(config, 0))
    runtime.enter_site(ActiveSite(SequenceParallelCrossAttention(), 0, torch.nn.Linear(1, 1)))
    q, k = torch.zeros(1, 3, 8), torch.zeros(1, 5, 8)
    with pytest.raises(ValueError, match="cross-attention site on Linear got an attention mask"):
        runtime.attention(sdpa_attention, q, k, k, 2, mask=torch.ones(1, 1, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="keys and values must match"):
        runtime.attention(sdpa_attention, q, k, torch.zeros(1, 4, 8), 2)
    with pytest.raises(ValueError, match="not divisible by ulysses_degree 2"):
        runtime.attention(sdpa_attention, torch.zeros(1, 3, 9), torch.zeros(1, 5, 9), torch.zeros(1, 5, 9), 3)
    assert runtime.stats.bytes_sent == 0  # refused before any exchange
