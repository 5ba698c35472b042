"""CFG parallel on real processes (gloo, 2 and 4 ranks from tests/omnitest/rank_pool.py): the call's batch split
between the cfg halves, each half sequence-parallel over its ranks, the output gathered along the batch; calls whose
batch does not split run on every rank. References are the unsplit toy DiT in the rank itself."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from omni_hooks.context import CallContext
from omni_hooks.sequence_parallel import SequenceParallelConfig, apply_sequence_parallel, remove_sequence_parallel
from omni_hooks.teacache import TeaCacheConfig, apply_teacache_hook
from omnitest.toy_dit import ToyDiT, sp_plan, toy_inputs, toy_stack

TIMEOUT_S = 90


def rank_toy_dit_cfg(ulysses: int, ring: int, batch: int, image_tokens: int):
    """(max error against one process, batch parts this rank computed, bytes gathered along the batch, restored)."""
    config = SequenceParallelConfig(ulysses_degree=ulysses, ring_degree=ring, cfg_degree=2)
    model = ToyDiT()
    inputs = toy_inputs(batch=batch, image_tokens=image_tokens)
    plan = sp_plan(auto_pad=True)
    parts = []
    with torch.no_grad():
        reference = model(**inputs)
        sp = apply_sequence_parallel(model, config, plan)
        seen = model.blocks[0].register_forward_pre_hook(lambda m, args: parts.append((args[0].shape[0],
                                                                                       sp.batch_part())))
        out = model(**inputs, transformer_options={"attention_override": sp.attention})
        seen.remove()
        remove_sequence_parallel(model, plan)
        again = model(**inputs)
    gathered = sp.stats.by_kind.get("cfg_batch_all_gather")
    return ((out - reference).abs().max().item(), parts, gathered.calls if gathered else 0,
            torch.equal(again, reference) and all("forward" not in m.__dict__ for m in model.modules()))


def test_cfg_2_x_sp_1_on_two_ranks_equals_one_process(rank_pool):
    results = rank_pool(2).run(rank_toy_dit_cfg, 1, 1, 2, 16, timeout=TIMEOUT_S)
    for rank, (error, parts, gathers, restored) in enumerate(results):
        assert error <= 1e-5 and restored
        assert parts == [(1, (rank, 2))] and gathers == 1  # each rank ran its half of the batch, then gathered


def test_cfg_2_x_ulysses_2_on_four_ranks_equals_one_process(rank_pool):
    results = rank_pool(4).run(rank_toy_dit_cfg, 2, 1, 2, 15, timeout=TIMEOUT_S)  # 15 tokens: padded shards
    for rank, (error, parts, gathers, restored) in enumerate(results):
        assert error <= 1e-5 and restored
        assert parts == [(1, (rank // 2, 2))] and gathers == 1  # ranks {0, 1} hold the cond half, {2, 3} the uncond


@pytest.mark.parametrize("world, ulysses", [(2, 1), (4, 2)])
def test_a_batch_the_halves_cannot_split_runs_on_every_rank_with_the_same_result(rank_pool, world, ulysses):
    for error, parts, gathers, restored in rank_pool(world).run(rank_toy_dit_cfg, ulysses, 1, 1, 16,
                                                                timeout=TIMEOUT_S):
        assert error <= 1e-5 and restored
        assert parts == [(1, (0, 1))] and gathers == 0


def rank_cfg_teacache(ulysses: int, batches: tuple[int, ...]):
    """TeaCache on the toy under CFG parallel: calls of cond+uncond (split) and of one branch (whole), with the real
    signal (the modulated input of the first block), against the same run in one process."""
    config = TeaCacheConfig(threshold=0.3)

    def run(sp_config):
        model = ToyDiT()
        sp = apply_sequence_parallel(model, sp_config, sp_plan()) if sp_config is not None else None
        cache = apply_teacache_hook(toy_stack(model), config, modulated_signal())
        outputs = []
        for step, batch in enumerate(batches):
            inputs = toy_inputs(batch=batch, image_tokens=16)
            branches = (["c", "u"] if batch == 2 else ["c"])
            rank = sp.rank_view() if sp is not None else CallContext([], []).rank
            cache.begin_call(CallContext(branches=branches, labels=["cond", "uncond"][:batch], step=step,
                                         total_steps=len(batches), rank=rank))
            options = {"attention_override": sp.attention} if sp is not None else {}
            try:
                with torch.no_grad():
                    outputs.append(model(**dict(inputs, t=inputs["t"] * (1 - step / len(batches))),
                                         transformer_options=options))
            finally:
                cache.end_call()
        evaluations = cache.stats.evaluations
        return outputs, [e.computed for e in evaluations], [[b.branch for b in e.branches] for e in evaluations]

    plain, plain_pattern, _ = run(None)
    outputs, pattern, branches = run(SequenceParallelConfig(ulysses_degree=ulysses, cfg_degree=2))
    error = max((a - b).abs().max().item() for a, b in zip(outputs, plain))
    return dict(pattern=pattern, plain_pattern=plain_pattern, branches=branches, error=error,
                rank=dist.get_rank())


def modulated_signal():
    from omni_hooks.blockstack import StackSignal

    return StackSignal(compute=lambda block, args, kwargs, captured: args[0])


@pytest.mark.parametrize("world, ulysses", [(2, 1), (4, 2)])
def test_teacache_under_cfg_parallel_decides_and_samples_as_one_process(rank_pool, world, ulysses):
    for r in rank_pool(world).run(rank_cfg_teacache, ulysses, (2,) * 8, timeout=TIMEOUT_S):
        assert r["pattern"] == r["plain_pattern"] and True in r["pattern"] and False in r["pattern"]
        assert r["error"] <= 1e-5
        assert r["branches"] == [["cond" if r["rank"] < world // 2 else "uncond"]] * 8  # each half its own branch


@pytest.mark.parametrize("world, ulysses", [(2, 1), (4, 2)])
def test_teacache_verdicts_stay_identical_on_every_rank_when_split_and_whole_calls_alternate(
        rank_pool, world, ulysses):
    batches = (2, 2, 2, 1, 2, 2, 2, 2)
    results = rank_pool(world).run(rank_cfg_teacache, ulysses, batches, timeout=TIMEOUT_S)
    patterns = [r["pattern"] for r in results]
    assert all(p == patterns[0] for p in patterns) and True in patterns[0] and False in patterns[0]
    for r in results:
        own = "cond" if r["rank"] < world // 2 else "uncond"
        # a split call's branches are this rank's half's; the one-branch call ran whole on every rank
        assert r["branches"] == [[own]] * 3 + [["cond"]] + [[own]] * 4
