"""Sequence parallelism across real processes: gloo on CPU, 2 and 4 ranks spawned by torch.multiprocessing.

Each test runs a module-level function on every rank of a shared pool (tests/omnitest/rank_pool.py) with a timeout
that fails the test and tears the pool down; nothing here can hang the suite. References are computed in the rank
itself from the full inputs (float64 for attention, the unsplit float32 model for the toy DiT).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from omni_hooks.context import CallContext
from omni_hooks.caching.forecast import AUTO, CANDIDATES
from omni_hooks.magcache import MagCacheConfig, apply_mag_cache_hook
from omni_hooks.offload import apply_layerwise_offload
from omni_hooks.sequence_parallel import (
    ActiveSite,
    SequenceParallelConfig,
    SequenceParallelInput,
    SequenceParallelMesh,
    SequenceParallelOutput,
    SequenceParallelPartialInput,
    SequenceParallelRun,
    SequenceParallelSelfAttention,
    apply_sequence_parallel,
    heads_to_sequence,
    remove_sequence_parallel,
    ring_attention,
    sdpa_attention,
    sequence_to_heads,
)
from omni_hooks.blockstack import StackSignal
from omni_hooks.teacache import TeaCacheConfig, apply_teacache_hook
from omnitest.toy_dit import ToyDiT, sp_plan, toy_inputs, toy_stack

TIMEOUT_S = 90


def degrees(ulysses: int, ring: int) -> SequenceParallelConfig:
    return SequenceParallelConfig(ulysses_degree=ulysses, ring_degree=ring)


# -- split and gather -------------------------------------------------------------------------------------------------

class Body(torch.nn.Module):
    def forward(self, x, ids):
        self.seen = (x.clone(), ids.clone())
        return x * 2, ids[3:] + 0.5


class Prep(torch.nn.Module):
    def forward(self, n):
        return torch.arange(float(n)), torch.arange(float(n)) * 10


class Wrapper(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.prep = Prep()
        self.body = Body()

    def forward(self, x, ids):
        table, scaled = self.prep(12)
        out, img_ids = self.body(x, ids)
        return out, img_ids, table, scaled


def rank_split_gather_round_trip():
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for length, pad in [(4 * world, False), (4 * world + 1, True), (world - 1, True)]:
        model = Wrapper()
        plan = {"": {"x": SequenceParallelInput(split_dim=1, expected_dims=3, auto_pad=pad),
                     "ids": SequenceParallelPartialInput(split_dim=0, text_len_source=3, auto_pad=pad)},
                "prep": {1: SequenceParallelInput(split_dim=0, split_output=True)},
                "body": [SequenceParallelOutput(gather_dim=1, expected_dims=3), SequenceParallelOutput(gather_dim=0)]}
        apply_sequence_parallel(model, degrees(world, 1), plan)
        x = torch.arange(2 * length * 3, dtype=torch.float32).reshape(2, length, 3)
        ids = torch.arange(3 + length, dtype=torch.float32)
        out, img_ids, table, scaled = model(x, ids)
        shard_x, shard_ids = model.body.seen
        remove_sequence_parallel(model, plan)
        local = -(-length // world)
        padded = torch.cat([x, x.new_zeros(2, local * world - length, 3)], 1)
        expected_shard = padded[:, rank * local:(rank + 1) * local]
        results.append(dict(
            gathered=torch.equal(out, x * 2) and torch.equal(img_ids, ids[3:] + 0.5),
            shard=torch.equal(shard_x, expected_shard),
            text_whole=torch.equal(shard_ids[:3], ids[:3]) and shard_ids.shape[0] == 3 + local,
            split_output=torch.equal(table, torch.arange(12.0))
            and torch.equal(scaled, (torch.arange(12.0) * 10).chunk(world)[rank]),
            restored=all("forward" not in m.__dict__ for m in model.modules())))
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_split_then_gather_returns_the_full_tensor_even_when_padded(rank_pool, world):
    for per_rank in rank_pool(world).run(rank_split_gather_round_trip, timeout=TIMEOUT_S):
        for case in per_rank:
            assert all(case.values()), case


def rank_strict_length_error():
    model = Wrapper()
    apply_sequence_parallel(model, degrees(dist.get_world_size(), 1),
                            {"": {"x": SequenceParallelInput(split_dim=1)}})
    try:
        model(torch.zeros(1, 2 * dist.get_world_size() + 1, 3), torch.zeros(3))
    except ValueError as exc:
        return str(exc)
    return None


def test_a_length_the_world_does_not_divide_fails_on_every_rank_naming_auto_pad(rank_pool):
    messages = rank_pool(2).run(rank_strict_length_error, timeout=TIMEOUT_S)
    assert all(m is not None and "auto_pad=True" in m and "strict mode" in m for m in messages), messages


# -- all-to-all -------------------------------------------------------------------------------------------------------

def rank_all_to_all():
    rank, world = dist.get_rank(), dist.get_world_size()
    runtime = SequenceParallelRun(degrees(world, 1))
    b, length, heads, dim = 2, 4 * world, 2 * world, 3
    full = torch.arange(b * length * heads * dim, dtype=torch.float64).reshape(b, length, heads, dim)
    shard = full.chunk(world, 1)[rank]
    exchanged = heads_to_sequence(runtime.ulysses_comm, torch.stack([shard, -shard]))
    per_heads = heads // world
    mine = full[:, :, rank * per_heads:(rank + 1) * per_heads]
    back = sequence_to_heads(runtime.ulysses_comm, exchanged[0])
    return torch.equal(exchanged[0], mine) and torch.equal(exchanged[1], -mine) and torch.equal(back, shard)


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_all_to_all_gives_each_rank_its_heads_of_the_whole_sequence_and_back(rank_pool, world):
    assert rank_pool(world).run(rank_all_to_all, timeout=TIMEOUT_S) == [True] * world


# -- attention against a float64 reference ----------------------------------------------------------------------------

def max_error(got, want):
    """Largest absolute difference (0 for empty tensors: a rank may hold nothing but padding)."""
    return (got - want).abs().max().item() if got.numel() else 0.0


def full_attention(q, k, v):
    """float64 reference over ``[B, L, H, D]``."""
    qh, kh, vh = (t.double().transpose(1, 2) for t in (q, k, v))
    weights = torch.softmax(qh @ kh.transpose(-1, -2) * q.shape[-1] ** -0.5, -1)
    return (weights @ vh).transpose(1, 2)


def rank_ring_vs_full(joint: int, image: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    runtime = SequenceParallelRun(degrees(1, world))
    g = torch.Generator().manual_seed(3)
    b, heads, dim = 2, 3, 8
    q, k, v = (torch.randn(b, joint + image, heads, dim, generator=g, dtype=torch.float64) for _ in range(3))
    reference = full_attention(q, k, v)
    local = -(-image // world)

    def my_block(t):
        img = torch.cat([t[:, joint:], t.new_zeros(b, local * world - image, heads, dim)], 1)
        return img[:, rank * local:(rank + 1) * local]

    out = ring_attention(runtime.ring_comm, torch.cat([q[:, :joint], my_block(q)], 1), my_block(k), my_block(v),
                         joint_k=k[:, :joint] if joint else None, joint_v=v[:, :joint] if joint else None,
                         valid_keys=lambda j: max(0, min(local, image - j * local)))
    valid = max(0, min(local, image - rank * local))
    got = torch.cat([out[:, :joint], out[:, joint:joint + valid]], 1)
    want = torch.cat([reference[:, :joint], reference[:, joint + rank * local:joint + rank * local + valid]], 1)
    return max_error(got, want), runtime.stats.by_kind["ring_hop"].calls


@pytest.mark.parametrize("world, joint, image", [(2, 0, 16), (2, 5, 16), (2, 5, 13), (4, 3, 14), (4, 0, 3)])
def test_ring_attention_equals_full_attention(rank_pool, world, joint, image):
    for error, hops in rank_pool(world).run(rank_ring_vs_full, joint, image, timeout=TIMEOUT_S):
        assert error < 1e-12 and hops == world - 1


def rank_entry_vs_full(ulysses: int, ring: int, joint: int, image: int, heads_first: bool):
    """The host-facing entry at a self-attention site (float64), and its byte accounting against a simulated mesh."""
    rank, world = dist.get_rank(), dist.get_world_size()
    config = degrees(ulysses, ring)
    runtime = SequenceParallelRun(config)
    g = torch.Generator().manual_seed(4)
    b, heads, dim = 1, 4, 8
    q, k, v = (torch.randn(b, joint + image, heads, dim, generator=g, dtype=torch.float64) for _ in range(3))
    reference = full_attention(q, k, v)
    local = -(-image // world)
    from omni_hooks.sequence_parallel import PaddingRecord
    if image % world:
        runtime.padding[None] = PaddingRecord(image, local * world)

    def mine(t):
        img = torch.cat([t[:, joint:], t.new_zeros(b, local * world - image, heads, dim)], 1)
        part = torch.cat([t[:, :joint], img[:, rank * local:(rank + 1) * local]], 1)
        return part.transpose(1, 2) if heads_first else part.reshape(b, -1, heads * dim)

    calls = []

    def host(q_, k_, v_, heads_, **kwargs):
        # a mask-blind kernel (like Sage): padding must be handled without a mask
        if kwargs.get("mask") is not None:
            raise AssertionError("the entry passed an attention mask to a mask-blind host function")
        calls.append(heads_)
        return sdpa_attention(q_, k_, v_, heads_, **kwargs)

    site = ActiveSite(SequenceParallelSelfAttention(joint_tokens=joint), joint, torch.nn.Identity())
    runtime.enter_site(site)
    out = runtime.attention(host, mine(q), mine(k), mine(v), heads, skip_reshape=heads_first,
                            skip_output_reshape=heads_first, transformer_options={})
    out = out.transpose(1, 2) if heads_first else out.reshape(b, -1, heads, dim)
    valid = max(0, min(local, image - rank * local))
    got = torch.cat([out[:, :joint], out[:, joint:joint + valid]], 1)
    want = torch.cat([reference[:, :joint], reference[:, joint + rank * local:joint + rank * local + valid]], 1)
    # the same call on a simulated mesh (meta tensors) counts exactly the bytes the real exchange sent
    simulated = SequenceParallelRun(config, SequenceParallelMesh.simulated_for(config, rank))
    simulated.padding.update(runtime.padding)
    simulated.enter_site(site)
    meta = mine(q).to("meta")
    simulated.attention(sdpa_attention, meta, meta, meta, heads, skip_reshape=heads_first,
                        skip_output_reshape=heads_first)
    same_bytes = {k_: (r.calls, r.bytes_sent) for k_, r in simulated.stats.by_kind.items()} == {
        k_: (r.calls, r.bytes_sent) for k_, r in runtime.stats.by_kind.items()}
    return max_error(got, want), calls, same_bytes


@pytest.mark.parametrize("ulysses, ring, joint, image, heads_first", [
    (2, 1, 0, 16, False), (2, 1, 5, 13, True), (1, 2, 5, 16, False)])
def test_entry_on_two_ranks_equals_full_attention_and_uses_the_host_function_for_ulysses(
        rank_pool, ulysses, ring, joint, image, heads_first):
    for error, calls, same_bytes in rank_pool(2).run(rank_entry_vs_full, ulysses, ring, joint, image, heads_first,
                                                     timeout=TIMEOUT_S):
        assert error < 1e-12 and same_bytes
        assert calls == ([4 // ulysses] if ring == 1 else [])  # ring computes its blocks itself (needs the LSE)


@pytest.mark.parametrize("ulysses, ring, joint, image, heads_first", [
    (2, 2, 0, 16, False), (2, 2, 5, 14, True), (4, 1, 3, 16, False), (1, 4, 3, 13, True)])
def test_entry_on_four_ranks_hybrid_equals_one_process(rank_pool, ulysses, ring, joint, image, heads_first):
    for error, calls, same_bytes in rank_pool(4).run(rank_entry_vs_full, ulysses, ring, joint, image, heads_first,
                                                     timeout=TIMEOUT_S):
        assert error < 1e-12 and same_bytes


def rank_mesh_layout():
    mesh = SequenceParallelMesh.from_config(degrees(2, 2))
    return mesh.sp.rank, mesh.ulysses.ranks, mesh.ring.ranks


def test_hybrid_groups_follow_the_ulysses_low_layout(rank_pool):
    assert rank_pool(4).run(rank_mesh_layout, timeout=TIMEOUT_S) == [
        (0, (0, 1), (0, 2)), (1, (0, 1), (1, 3)), (2, (2, 3), (0, 2)), (3, (2, 3), (1, 3))]


def rank_indivisible_heads():
    runtime = SequenceParallelRun(degrees(2, 1))
    runtime.enter_site(ActiveSite(SequenceParallelSelfAttention(), 0, torch.nn.Identity()))
    q = torch.zeros(1, 4, 3 * 8)
    try:
        runtime.attention(sdpa_attention, q, q, q, 3)
    except ValueError as exc:
        return str(exc)
    return None


def test_indivisible_heads_fail_on_every_rank_without_a_hang(rank_pool):
    messages = rank_pool(2).run(rank_indivisible_heads, timeout=TIMEOUT_S)
    assert all(m and "ulysses_degree" in m and "ring_degree" in m for m in messages), messages
    assert rank_pool(2).run(rank_all_to_all, timeout=TIMEOUT_S) == [True, True]  # the group is still in step


# -- the toy DiT ------------------------------------------------------------------------------------------------------

def rank_toy_dit(ulysses: int, ring: int, image_tokens: int):
    model = ToyDiT()
    inputs = toy_inputs(image_tokens=image_tokens)
    plan = sp_plan(auto_pad=image_tokens % (ulysses * ring) != 0)
    with torch.no_grad():
        reference = model(**inputs)
        sp = apply_sequence_parallel(model, degrees(ulysses, ring), plan)
        out = model(**inputs, transformer_options={"attention_override": sp.attention})
        remove_sequence_parallel(model, plan)
        again = model(**inputs)
    return (out - reference).abs().max().item(), torch.equal(again, reference), sp.stats.bytes_sent


@pytest.mark.parametrize("ulysses, ring, image_tokens", [(2, 1, 16), (1, 2, 16), (2, 1, 15), (1, 2, 13)])
def test_toy_dit_on_two_ranks_equals_one_process(rank_pool, ulysses, ring, image_tokens):
    for error, restored, sent in rank_pool(2).run(rank_toy_dit, ulysses, ring, image_tokens, timeout=TIMEOUT_S):
        assert error <= 1e-5 and restored and sent > 0


@pytest.mark.parametrize("ulysses, ring, image_tokens", [(2, 2, 16), (4, 1, 16), (1, 4, 16), (2, 2, 14)])
def test_toy_dit_on_four_ranks_equals_one_process(rank_pool, ulysses, ring, image_tokens):
    for error, restored, sent in rank_pool(4).run(rank_toy_dit, ulysses, ring, image_tokens, timeout=TIMEOUT_S):
        assert error <= 1e-5 and restored and sent > 0


def rank_toy_dit_in_subgroups(ulysses: int, ring: int):
    """Two independent SP groups of two ranks ({0, 1} and {2, 3}) on one default group of four."""
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both, in the same order
    config = SequenceParallelConfig(ulysses_degree=ulysses, ring_degree=ring, process_group=groups[rank // 2])
    model = ToyDiT()
    inputs = toy_inputs(image_tokens=14 + rank // 2)  # the two groups run different inputs
    plan = sp_plan(auto_pad=True)
    with torch.no_grad():
        reference = model(**inputs)
        sp = apply_sequence_parallel(model, config, plan)
        out = model(**inputs, transformer_options={"attention_override": sp.attention})
    return (out - reference).abs().max().item(), sp.mesh.sp.ranks, sp.rank


@pytest.mark.parametrize("ulysses, ring", [(2, 1), (1, 2)])
def test_a_config_process_group_runs_sequence_parallelism_inside_a_subgroup(rank_pool, ulysses, ring):
    results = rank_pool(4).run(rank_toy_dit_in_subgroups, ulysses, ring, timeout=TIMEOUT_S)
    assert [r[1:] for r in results] == [((0, 1), 0), ((0, 1), 1), ((2, 3), 0), ((2, 3), 1)]
    assert all(r[0] <= 1e-5 for r in results)


# -- caches under sequence parallelism --------------------------------------------------------------------------------

STEPS = 10


def sample(model, run, sp, steps=STEPS):
    """``steps`` calls of the toy (cond and uncond batched), each bracketed by the cache run; outputs and verdicts."""
    inputs = toy_inputs(image_tokens=16)
    outputs = []
    options = {"attention_override": sp.attention} if sp is not None else {}
    for step in range(steps):
        rank = sp.rank_view() if sp is not None else CallContext([], []).rank
        run.begin_call(CallContext(branches=["c", "u"], labels=["cond", "uncond"], step=step, total_steps=steps,
                                   rank=rank))
        try:
            with torch.no_grad():
                outputs.append(model(**dict(inputs, t=inputs["t"] * (1 - step / steps)),
                                     transformer_options=options))
        finally:
            run.end_call()
    return outputs


def rank_signal(rank: int) -> StackSignal:
    """A TeaCache signal whose per-step change differs by rank: (rank + 1) x 2% per call."""
    calls = [0]

    def compute(block, args, kwargs, captured):
        calls[0] += 1
        return torch.full((args[0].shape[0], 4), 1.0 + 0.02 * (rank + 1) * calls[0])

    return StackSignal(compute=compute)


def rank_teacache(ulysses: int, ring: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    config = TeaCacheConfig(threshold=0.07)
    # what this rank alone would decide (no sequence parallelism, its own signal)
    alone = ToyDiT()
    local_run = apply_teacache_hook(toy_stack(alone), config, rank_signal(rank))
    sample(alone, local_run, None)
    # under sequence parallelism
    model = ToyDiT()
    sp = apply_sequence_parallel(model, degrees(ulysses, ring), sp_plan())
    run = apply_teacache_hook(toy_stack(model), config, rank_signal(rank))
    outputs = sample(model, run, sp)
    with torch.no_grad():
        plain = ToyDiT()(**dict(toy_inputs(image_tokens=16)))
    residual = run.branch_state("c").previous_residual
    return dict(pattern=[e.computed for e in run.stats.evaluations],
                local=[e.computed for e in local_run.stats.evaluations],
                metrics=[[b.metric for b in e.branches] for e in run.stats.evaluations],
                first_step_error=(outputs[0] - plain).abs().max().item(),
                residual_tokens=residual.shape[1], full_tokens=outputs[-1].shape[1],
                finite=all(torch.isfinite(o).all().item() for o in outputs), world=world)


@pytest.mark.parametrize("world, ulysses, ring", [(2, 2, 1), (2, 1, 2), (4, 2, 2)])
def test_teacache_decides_alike_on_every_rank_with_differing_rank_metrics(rank_pool, world, ulysses, ring):
    results = rank_pool(world).run(rank_teacache, ulysses, ring, timeout=TIMEOUT_S)
    patterns = [r["pattern"] for r in results]
    assert all(p == patterns[0] for p in patterns)
    assert True in patterns[0] and False in patterns[0]
    assert all(r["metrics"] == results[0]["metrics"] for r in results)  # the metric is the mean over ranks
    assert any(r["local"] != patterns[0] for r in results)  # alone, a rank would have decided otherwise
    for r in results:
        assert r["first_step_error"] <= 1e-5 and r["finite"]
        assert r["residual_tokens"] == 16 // world and r["full_tokens"] == 16  # each rank caches its own shard


def rank_teacache_auto_forecast(ulysses: int, ring: int):
    """TeaCache with the auto forecast under sequence parallelism: each rank scores the candidates on its own shard
    of the residuals; the scores are averaged over the ranks, so every rank forecasts with the same candidate."""
    rank = dist.get_rank()
    model = ToyDiT()
    sp = apply_sequence_parallel(model, degrees(ulysses, ring), sp_plan())
    run = apply_teacache_hook(toy_stack(model), TeaCacheConfig(threshold=0.07, forecast_order=AUTO),
                              rank_signal(rank))
    outputs = sample(model, run, sp)
    states = [run.branch_state(k) for k in ("c", "u")]
    return dict(pattern=[e.computed for e in run.stats.evaluations],
                candidates=[[b.candidate for b in e.branches] for e in run.stats.evaluations],
                scores=[st.scores.errors for st in states],
                coherence=[st.scores.coherence for st in states],
                horizons=[st.scores.horizon for st in states],
                weights=[(st.error_per_metric.weight(), st.error_per_metric.count) for st in states],
                metrics=[[b.metric for b in e.branches] for e in run.stats.evaluations],
                residual_tokens=states[0].previous_residual.shape[1],
                finite=all(torch.isfinite(o).all().item() for o in outputs))


@pytest.mark.parametrize("world, ulysses, ring", [(2, 2, 1), (2, 1, 2)])
def test_auto_forecast_chooses_the_same_candidate_on_every_rank(rank_pool, world, ulysses, ring):
    results = rank_pool(world).run(rank_teacache_auto_forecast, ulysses, ring, timeout=TIMEOUT_S)
    assert all(r["pattern"] == results[0]["pattern"] and r["candidates"] == results[0]["candidates"] for r in results)
    assert all(r["scores"] == results[0]["scores"] and r["coherence"] == results[0]["coherence"]
               for r in results)  # the means over the ranks
    # the forecast's record weighs TeaCache's metric alike on every rank (errors and metric are both rank means)
    assert all(r["weights"] == results[0]["weights"] and r["metrics"] == results[0]["metrics"]
               and r["horizons"] == results[0]["horizons"] for r in results)
    assert results[0]["horizons"][0] is not None and results[0]["weights"][0][1] > 0
    assert all(e is not None for e in results[0]["scores"][0][:3])  # reuse, 1st and 2nd order were scored
    assert results[0]["coherence"][0][0] is not None
    skipped = [c for c, computed in zip(results[0]["candidates"], results[0]["pattern"]) if not computed]
    assert skipped and all(candidate in CANDIDATES for branches in skipped for candidate in branches)
    assert all(r["finite"] and r["residual_tokens"] == 16 // world for r in results)


def rank_magcache(ulysses: int, ring: int):
    rank = dist.get_rank()
    # rank 0's curve would let it skip from the retention steps on; the others' would make them compute late on
    ratios = [1.0] * STEPS if rank == 0 else [1.0] * (STEPS // 2) + [0.8] * (STEPS - STEPS // 2)
    config = dict(threshold=0.1, max_skip_steps=2, retention_ratio=0.2, mag_ratios=ratios)
    model = ToyDiT()
    sp = apply_sequence_parallel(model, degrees(ulysses, ring), sp_plan())
    run = apply_mag_cache_hook(toy_stack(model), MagCacheConfig(**config))
    outputs = sample(model, run, sp)
    alone = ToyDiT()
    local_run = apply_mag_cache_hook(toy_stack(alone), MagCacheConfig(**config))
    sample(alone, local_run, None)
    return dict(pattern=[e.computed for e in run.stats.evaluations],
                local=[e.computed for e in local_run.stats.evaluations],
                reasons=[b.reason for e in run.stats.evaluations for b in e.branches],
                residual_tokens=run.branch_state("u").previous_residual.shape[1],
                finite=all(torch.isfinite(o).all().item() for o in outputs))


@pytest.mark.parametrize("world, ulysses, ring", [(2, 2, 1), (2, 1, 2)])
def test_magcache_decides_alike_on_every_rank_with_differing_rank_curves(rank_pool, world, ulysses, ring):
    results = rank_pool(world).run(rank_magcache, ulysses, ring, timeout=TIMEOUT_S)
    patterns = [r["pattern"] for r in results]
    assert all(p == patterns[0] for p in patterns) and False in patterns[0]
    assert results[0]["local"] != results[1]["local"]  # the ranks' own decisions differ ...
    assert "other-rank" in results[0]["reasons"]  # ... and rank 0 computed because a peer had to
    assert all(r["finite"] and r["residual_tokens"] == 16 // world for r in results)


def rank_sp_with_offload_and_teacache(ulysses: int, ring: int):
    """Sequence parallel, TeaCache and block offload (to "cpu": real slot copies) on one model, against the same
    without offload: the phases order the hooks, so the outputs and the skip pattern must not change."""
    rank = dist.get_rank()

    def sampled(offload: bool):
        model = ToyDiT()
        sp = apply_sequence_parallel(model, degrees(ulysses, ring), sp_plan())
        handle = apply_layerwise_offload(list(model.blocks), "cpu", prefetch_blocks=1) if offload else None
        run = apply_teacache_hook(toy_stack(model), TeaCacheConfig(threshold=0.07), rank_signal(rank))
        outputs = sample(model, run, sp)
        block_calls = handle.collect_stats().block_calls if handle is not None else None
        return outputs, [e.computed for e in run.stats.evaluations], block_calls

    plain, plain_pattern, _ = sampled(False)
    offloaded, pattern, block_calls = sampled(True)
    return (max((a - b).abs().max().item() for a, b in zip(plain, offloaded)), pattern == plain_pattern,
            pattern, block_calls)


@pytest.mark.parametrize("ulysses, ring", [(2, 1), (1, 2)])
def test_sequence_parallel_composes_with_offload_and_teacache(rank_pool, ulysses, ring):
    results = rank_pool(2).run(rank_sp_with_offload_and_teacache, ulysses, ring, timeout=TIMEOUT_S)
    for difference, same_pattern, pattern, block_calls in results:
        assert difference == 0 and same_pattern and False in pattern
        assert block_calls == 2 * sum(pattern)  # offload runs only the blocks of computed steps (2 each)
    assert results[0][2] == results[1][2]


# -- CUDA / NCCL ------------------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_toy_dit_over_nccl_on_two_gpus():
    from omnitest.rank_pool import RankPool

    pool = RankPool(2, backend="nccl")
    try:
        for error in pool.run(rank_toy_dit_cuda, timeout=TIMEOUT_S):
            assert error <= 1e-5
    finally:
        pool.close()


def rank_toy_dit_cuda():
    device = torch.device("cuda", dist.get_rank())
    model = ToyDiT().to(device)
    inputs = {k: v.to(device) for k, v in toy_inputs(image_tokens=15).items()}
    plan = sp_plan(auto_pad=True)
    with torch.no_grad():
        reference = model(**inputs)
        sp = apply_sequence_parallel(model, degrees(1, 2), plan)
        out = model(**inputs, transformer_options={"attention_override": sp.attention})
    return (out - reference).abs().max().item()
