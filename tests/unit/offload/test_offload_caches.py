"""Offload composed with the real TeaCache and MagCache on one toy stack, in either order.

A skipped step runs no offload hook and moves no weights; a computed step finds every block on the device or being
copied there (no synchronous load), including the head block whose weights the cache's signal reads before the
block runs; and the outputs equal the cache's outputs without offload, bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from omni_hooks import HookRegistry
from omni_hooks.context import CallContext
from omni_hooks.magcache import MagCacheConfig, apply_mag_cache_hook
from omni_hooks.offload import HOOK_NAME, apply_layerwise_offload
from omni_hooks.blockstack import StackSignal
from omni_hooks.teacache import TeaCacheConfig, apply_teacache_hook
from omnitest.offload_toys import ToyStack, toy_block_stack, toy_inputs

STEPS = 8
ALWAYS_REUSE = (0.0, 0.0, 0.0, 0.0, 0.0)


def head_modulation() -> StackSignal:
    """The head block's own modulation of the time embedding: reads block 0's weights before block 0 runs."""
    return StackSignal(compute=lambda head, args, kwargs, captured: head.mod(kwargs["t"]))


def apply_teacache(model: ToyStack):
    # steps 1-3 may reuse; 4-7 lie outside end_percent 0.5, 0 is the first: computed
    config = TeaCacheConfig(threshold=0.5, coefficients=ALWAYS_REUSE, end_percent=0.5)
    return apply_teacache_hook(toy_block_stack(model), config, head_modulation())


def apply_magcache(model: ToyStack):
    config = MagCacheConfig(mag_ratios=[1.0] * STEPS, threshold=1.0, retention_ratio=0.0, max_skip_steps=2)
    return apply_mag_cache_hook(toy_block_stack(model), config)


CACHES = {"teacache": apply_teacache, "magcache": apply_magcache}


def sample(model: ToyStack, run, x: torch.Tensor, handle=None) -> tuple[list[torch.Tensor], list[dict]]:
    """STEPS cond+uncond calls bracketed like a host does; per call: verdict and what offload did during it."""
    outputs, calls = [], []
    for step in range(STEPS):
        before = handle.stats.summary() if handle else None
        context = CallContext(branches=["c", "u"], labels=["cond", "uncond"], step=step, total_steps=STEPS)
        run.begin_call(context)
        try:
            with torch.no_grad():
                outputs.append(model(x, torch.full((x.shape[0],), 1 - step / STEPS)))
        finally:
            run.end_call()
        call = {"computed": context.blocks_run}
        if handle:
            after = handle.stats.summary()
            call.update({key: after[key] - before[key]
                         for key in ("bytes_moved", "copies", "block_calls", "hits", "sync_loads")})
        calls.append(call)
    return outputs, calls


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("offload_first", [True, False], ids=["offload-then-cache", "cache-then-offload"])
@pytest.mark.parametrize("cache", sorted(CACHES))
def test_a_skipped_step_moves_no_weights_and_a_computed_step_finds_its_blocks(cache, offload_first, prefetch):
    x = toy_inputs()
    reference_model = ToyStack(depth=5)
    reference_run = CACHES[cache](reference_model)
    reference, reference_calls = sample(reference_model, reference_run, x)

    model = ToyStack(depth=5)
    if offload_first:
        handle = apply_layerwise_offload(model.blocks, "cpu", prefetch_blocks=prefetch)
        run = CACHES[cache](model)
    else:
        run = CACHES[cache](model)
        handle = apply_layerwise_offload(model.blocks, "cpu", prefetch_blocks=prefetch)
    try:
        assert HookRegistry.get_or_create(model.blocks[0]).ordered_names()[-1] == HOOK_NAME
        outputs, calls = sample(model, run, x, handle)
    finally:
        handle.remove()
        run.remove()

    verdicts = [c["computed"] for c in calls]
    assert verdicts == [c["computed"] for c in reference_calls]
    assert verdicts.count(False) >= 3 and verdicts.count(True) >= 3, verdicts
    assert any(not a and b for a, b in zip(verdicts, verdicts[1:])), "a computed step must follow a skipped one"
    for step, call in enumerate(calls):
        if call["computed"]:
            # with a look-ahead every block is found on the device or on its way; without one, only the head
            assert call["block_calls"] == 5 and call["hits"] == (5 if prefetch else 1), (step, call)
            assert call["sync_loads"] == 5 - call["hits"], (step, call)
        else:
            assert call == {"computed": False, "bytes_moved": 0, "copies": 0, "block_calls": 0, "hits": 0,
                            "sync_loads": 0}, step
    assert all(torch.equal(a, b) for a, b in zip(outputs, reference))
