"""The hook registry on a real ComfyUI Wan model: pass-through hooks change nothing and leave nothing behind."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.host


def fingerprint(dm: torch.nn.Module):
    return {name: (sorted(m.__dict__), type(m).forward) for name, m in dm.named_modules()}


def test_pass_through_hooks_during_a_run_are_bit_identical_and_fully_removed():
    import comfy.patcher_extension as pe
    from omnitest import tiny_models
    from omnitest.pack import pack_module

    omni = pack_module("omni_hooks")
    case = tiny_models.build_case("wan21_t2v")
    dm = case.patcher.model.diffusion_model
    baseline = tiny_models.sample(case, steps=6, cfg=3.0)
    before = fingerprint(dm)  # after a first run: ComfyUI's loader marks modules (comfy_patched_weights, ...)

    class Counting(omni.ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Counting.calls += 1
            return args, kwargs

    seen_during_run = []

    def outer_sample(executor, *args, **kwargs):
        modules = [dm, *dm.blocks, dm.head]
        for m in modules:
            omni.HookRegistry.get_or_create(m).register_hook("pass_through", Counting())
        try:
            seen_during_run.append(all(omni.module_has_active_hooks(m) for m in modules))
            return executor(*args, **kwargs)
        finally:
            for m in modules:
                omni.HookRegistry.get_or_create(m).reset()

    patched = case.patcher.clone()
    patched.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, "test.pass_through", outer_sample)
    out = tiny_models.sample(case, model=patched, steps=6, cfg=3.0)
    assert seen_during_run == [True]
    assert Counting.calls == 6 * (1 + len(dm.blocks) + 1)
    assert torch.equal(out, baseline)
    assert fingerprint(dm) == before
    assert torch.equal(tiny_models.sample(case, steps=6, cfg=3.0), baseline)
