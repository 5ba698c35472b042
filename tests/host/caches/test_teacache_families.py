"""Apply TeaCache on every tiny model inside a real ComfyUI (in-process).

Per tiny model (at least one per registered family): its family is detected from the model itself; threshold 0 is
bit-identical to no node; the number of computed steps never rises with the threshold while the first and last steps
are always computed; every run leaves the diffusion model exactly as it found it; and the family's stack description
is right (a reused call on an unchanged input reproduces the computed one, and every block's skip has the shape of
what the block returns).
"""
from __future__ import annotations

import pytest
import torch

from omnitest.tiny_models import CASE_FAMILY, CASES

pytestmark = pytest.mark.host

STEPS = 8
THRESHOLDS = [0.0, 0.05, 0.2, 0.5, 1.0, 3.0]


def identity_name(family: str) -> str:
    return f"tiny-identity-{family}"


@pytest.fixture(scope="module")
def env(user_dir):
    from omnitest import tiny_models
    from omnitest.pack import pack_module, run_node

    node_module = pack_module("nodes.caches.teacache")
    files = pack_module("nodes.caches.calibration_files")
    families = pack_module("nodes.families")
    # Published polynomials are fitted on real weights; on random tiny weights they explode. The identity polynomial
    # makes the decision the raw relative L1 change of each family's signal, which a threshold sweep can exercise.
    for family in sorted(set(CASE_FAMILY.values())):
        files.save("teacache", identity_name(family),
                   {"coefficients": [0, 0, 0, 1, 0], "family": family, "signal": "default"})

    class Env:
        tiny = tiny_models
        teacache = node_module
        detect = staticmethod(families.detect)
        Unsupported = families.UnsupportedModelError

        @staticmethod
        def apply(model, family, rel_l1_thresh=0.0):
            return run_node(node_module.ApplyTeaCache, model=model, rel_l1_thresh=rel_l1_thresh, start_percent=0.0,
                            end_percent=1.0, cache_device="compute device",
                            model_variant=files.option(identity_name(family)))[0]

        @staticmethod
        def last_run():
            return pack_module("nodes.stats_store").recent_runs(1)[0]

    yield Env


@pytest.fixture(scope="module", params=CASES)
def case(request, env):
    return env.tiny.build_case(request.param)


def cfg_of(case) -> float:
    """CFG > 1 so that cond and uncond are batched into one call (guidance-distilled families too: it is allowed)."""
    return case.cfg if case.cfg > 1 else 2.5


def module_fingerprint(dm: torch.nn.Module):
    return {name: sorted(m.__dict__) for name, m in dm.named_modules()}


# -- (a) detection ---------------------------------------------------------------------------------------------------

def test_detects_the_family(env, case):
    # which variant and coefficients each family's models get: tests/host/families/test_families_host.py
    detected = env.detect(case.patcher)
    assert detected.family.name == case.family, detected.describe()
    stack = detected.build_stack(case.diffusion_model)
    assert len(stack.blocks) >= 2


@pytest.mark.parametrize("name", ["flux_schnell", "chroma"])
def test_auto_without_published_coefficients_says_what_to_do(env, name):
    case = env.tiny.build_case(name)
    with pytest.raises(ValueError, match="TeaCache Calibrate"):
        run_node_auto(env, case.patcher)


def run_node_auto(env, model):
    from omnitest.pack import run_node
    return run_node(env.teacache.ApplyTeaCache, model=model, rel_l1_thresh=-1.0, start_percent=0.0, end_percent=1.0,
                    cache_device="compute device", model_variant="auto")[0]


def window_reasons(run) -> list[tuple[float, bool, set[str]]]:
    """Per evaluation: its position in the run (0..1), whether it was computed, its branches' reasons."""
    return [(e["step"] / max(e["total_steps"] - 1, 1), e["computed"], {b["reason"] for b in e["branches"]})
            for e in run["evaluations"]]


@pytest.mark.parametrize("case_name, variant, window", [
    ("flux_kontext", "flux-kontext", (0.2, 0.9)),   # the published Flux Kontext window, chosen by name
    ("hidream", "auto", (0.1, 1.0)),                # 'auto' picks HiDream I1 full, published from 0.1
])
def test_the_published_window_applies_where_the_inputs_keep_their_defaults(env, case_name, variant, window):
    from omnitest.pack import run_node

    case = env.tiny.build_case(case_name)
    patched = run_node(env.teacache.ApplyTeaCache, model=case.patcher, rel_l1_thresh=1e9, start_percent=0.0,
                       end_percent=1.0, cache_device="compute device", model_variant=variant)[0]
    config = patched.model_options["transformer_options"]["omni_hooks.features"][0].config
    assert (config.start_percent, config.end_percent) == window
    env.tiny.sample(case, model=patched, steps=20)
    evaluations = window_reasons(env.last_run())
    outside = [e for e in evaluations if not window[0] <= e[0] <= window[1]]
    assert outside and all(computed and reasons == {"window"} for _, computed, reasons in outside
                           if reasons != {"forced"} and reasons != {"first"})
    assert all(computed for _, computed, _ in outside)
    assert not any("window" in reasons for position, _, reasons in evaluations if window[0] <= position <= window[1])


def test_auto_on_a_run_with_reference_latents_uses_flux_kontexts_entry_and_window(env):
    """Flux Kontext has Flux dev's weights: 'auto' builds both entries and a run whose conditioning carries reference
    latents (ReferenceLatent, as Kontext's workflows have) uses Kontext's, computing every step outside 0.2-0.9."""
    from omnitest.pack import run_node

    def apply(case):
        return run_node(env.teacache.ApplyTeaCache, model=case.patcher, rel_l1_thresh=1e9, start_percent=0.0,
                        end_percent=1.0, cache_device="compute device", model_variant="auto")[0]

    kontext = env.tiny.build_case("flux_kontext")
    patched = apply(kontext)
    config = patched.model_options["transformer_options"]["omni_hooks.features"][0].config
    assert (config.start_percent, config.end_percent) == (0.0, 1.0) and config.model_label.endswith(", flux")
    assert (config.with_reference.start_percent, config.with_reference.end_percent) == (0.2, 0.9)
    env.tiny.sample(kontext, model=patched, steps=20)
    run = env.last_run()
    assert run["summary"]["model"].endswith(", flux-kontext")
    evaluations = window_reasons(run)
    outside = [e for e in evaluations if not 0.2 <= e[0] <= 0.9]
    assert outside and all(computed for _, computed, _ in outside)
    assert any(not computed for position, computed, _ in evaluations if 0.2 <= position <= 0.9)

    dev = env.tiny.build_case("flux")  # no reference latents: Flux dev's entry, no window
    env.tiny.sample(dev, model=apply(dev), steps=20)
    run = env.last_run()
    assert run["summary"]["model"].endswith(", flux")
    assert any(not computed for position, computed, _ in window_reasons(run) if position < 0.2)


def test_the_users_own_window_keeps_priority(env):
    from omnitest.pack import run_node

    case = env.tiny.build_case("flux_kontext")
    patched = run_node(env.teacache.ApplyTeaCache, model=case.patcher, rel_l1_thresh=0.3, start_percent=0.5,
                       end_percent=1.0, cache_device="compute device", model_variant="flux-kontext")[0]
    config = patched.model_options["transformer_options"]["omni_hooks.features"][0].config
    assert (config.start_percent, config.end_percent) == (0.5, 0.9)  # start is the user's, end the published one


def test_auto_picks_the_published_coefficients(env):
    case = env.tiny.build_case("ltxv")
    patched = run_node_auto(env, case.patcher)
    config = patched.model_options["transformer_options"]["omni_hooks.features"][0].config
    assert config.model_label.endswith(", ltxv") and config.threshold == 0.06


def test_a_variant_of_another_family_is_a_clear_error(env):
    from omnitest.pack import run_node
    case = env.tiny.build_case("chroma")
    with pytest.raises(ValueError, match="'flux' is for flux models, but this MODEL is chroma"):
        run_node(env.teacache.ApplyTeaCache, model=case.patcher, rel_l1_thresh=0.3, start_percent=0.0,
                 end_percent=1.0, cache_device="compute device", model_variant="flux")


def test_unsupported_models_are_a_clear_error(env):
    import comfy.model_patcher
    import comfy.ops
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel

    class Base(torch.nn.Module):
        def __init__(self, dm):
            super().__init__()
            self.diffusion_model = dm

    # a real (tiny) SD-style UNet: ComfyUI's own class, no residual block stack
    unet = UNetModel(image_size=8, in_channels=4, model_channels=32, out_channels=4, num_res_blocks=[1],
                     channel_mult=(1,), num_head_channels=8, transformer_depth=[0], transformer_depth_output=[0, 0],
                     transformer_depth_middle=-2,
                     operations=comfy.ops.disable_weight_init)
    cpu = torch.device("cpu")
    for dm, name in [(unet, "UNetModel"), (torch.nn.Linear(2, 2), "Linear")]:
        patcher = comfy.model_patcher.ModelPatcher(Base(dm), cpu, cpu)
        with pytest.raises(env.Unsupported, match=rf"^{name} \(Base\) is not a diffusion transformer.*Flux"):
            env.detect(patcher)
        with pytest.raises(ValueError, match=rf"Apply TeaCache: {name} .*Supported families"):
            run_node_auto(env, patcher)


# -- (b) threshold 0 ---------------------------------------------------------------------------------------------------

def test_threshold_zero_is_bit_identical_to_no_node(env, case):
    cfg = cfg_of(case)
    baseline = env.tiny.sample(case, steps=STEPS, cfg=cfg)
    family = case.family
    out = env.tiny.sample(case, model=env.apply(case.patcher, family, 0.0), steps=STEPS, cfg=cfg)
    assert torch.equal(out, baseline)
    run = env.last_run()
    summary = run["summary"]
    assert summary["computed"] == STEPS * case.calls_per_step and summary["reused"] == 0, summary
    # both CFG branches went through one batched call per step (or, batch size 1, one call each) and were tracked
    # separately
    assert set(summary["branches"]) == {"cond", "uncond"}, summary["branches"]
    assert [e["step"] for e in run["evaluations"]] == case.call_steps(STEPS)


# -- (c) threshold sweep -----------------------------------------------------------------------------------------------

def test_computed_steps_never_rise_with_the_threshold(env, case):
    cfg = cfg_of(case)
    family = case.family
    counts = []
    for thresh in THRESHOLDS:
        env.tiny.sample(case, model=env.apply(case.patcher, family, thresh), steps=STEPS, cfg=cfg)
        run = env.last_run()
        evaluations = run["evaluations"]
        assert [e["step"] for e in evaluations] == case.call_steps(STEPS), (thresh, evaluations)
        assert evaluations[0]["computed"] and evaluations[-1]["computed"], thresh
        assert not any("cannot be cached" in w for w in run["summary"]["warnings"]), run["summary"]["warnings"]
        counts.append(run["summary"]["computed"])
    assert counts == sorted(counts, reverse=True), counts
    assert counts[0] == STEPS * case.calls_per_step and counts[-1] < counts[0], counts


# -- (d) nothing left behind -------------------------------------------------------------------------------------------

def test_runs_leave_the_model_exactly_as_before(env, case):
    cfg = cfg_of(case)
    dm = case.diffusion_model
    baseline = env.tiny.sample(case, steps=STEPS, cfg=cfg)
    before = module_fingerprint(dm)  # after a first run: ComfyUI's loader marks modules on first load
    family = case.family
    patched = env.apply(case.patcher, family, 0.5)
    assert module_fingerprint(dm) == before  # executing the node touches nothing
    for thresh in (0.5, 3.0):
        env.tiny.sample(case, model=env.apply(case.patcher, family, thresh), steps=STEPS, cfg=cfg)
        assert module_fingerprint(dm) == before
    env.tiny.sample(case, model=patched, steps=STEPS, cfg=cfg)
    assert module_fingerprint(dm) == before
    assert torch.equal(env.tiny.sample(case, steps=STEPS, cfg=cfg), baseline)


# -- (e) the family's stack description is right ----------------------------------------------------------------------

def test_a_reused_call_on_the_same_input_reproduces_the_computed_call(env, case):
    """Call the diffusion model twice on identical inputs with TeaCache on: the first call computes, the second
    reuses (its signal did not change). Reuse gives the tail `head input + (tail input - head input)` of the first
    call, so both outputs agree up to float rounding. This fails if a skip_block returns the wrong structure, if the
    head/tail arguments are the wrong tensors, or if an in-place block corrupts the stored head input."""
    import comfy.patcher_extension as pe
    from omnitest.pack import pack_module

    teacache = pack_module("omni_hooks.teacache")
    detected = env.detect(case.patcher)
    outputs, records = [], []

    def twice(executor, *args, **kwargs):
        dm = executor.class_obj
        config = teacache.TeaCacheConfig(threshold=1e9, coefficients=(0, 0, 0, 1, 0), ret_steps=0,
                                         force_last_step=False)
        signal = detected.family.signals["default"](dm)
        run = teacache.apply_teacache_hook(detected.build_stack(dm), config, signal)
        result = None
        try:
            # outside a call the hooks pass through: a model that keeps its text prefix's keys and values across calls
            # (HiDream-O1) fills them here, so that both calls below see the same tokens
            executor(*args, **kwargs)
            for _ in range(2):
                run.begin_call(teacache.CallContext(branches=["all"], labels=["all"]))
                output = executor(*args, **kwargs)
                # a copy now: a model may rewrite its output list after this wrapper (MiniMax-H3's audio velocity)
                outputs.append(env.tiny.packed_latent(output).clone())
                records.append(run.end_call())
                result = output if result is None else result
        finally:
            run.remove()
        return result

    model = case.patcher.clone()
    model.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "test.twice", twice)
    env.tiny.sample(case, model=model, steps=1, cfg=cfg_of(case))
    assert [r.computed for r in records[:2]] == [True, False]
    first, second = outputs[:2]
    assert second.shape == first.shape
    assert not torch.equal(first, torch.zeros_like(first))
    torch.testing.assert_close(second, first, rtol=1e-4, atol=1e-4)


def test_skip_block_returns_what_each_block_returns(env, case):
    """For every block of the stack, skip_block on the block's real call has the structure of the block's real output:
    a tensor or a tuple of the same length, element for element of the same shape (an even number of swapped
    (image, text) skips would cancel out in the end-to-end check above; this catches it)."""
    detected = env.detect(case.patcher)
    stack = detected.build_stack(case.diffusion_model)
    seen = []

    def record(block, args, kwargs, output):
        if len(seen) < len(stack.blocks):
            seen.append((block, stack.skip_block(block, args, kwargs), output))

    handles = [b.register_forward_hook(record, with_kwargs=True) for b in stack.blocks]
    try:
        env.tiny.sample(case, steps=1, cfg=cfg_of(case))
    finally:
        for h in handles:
            h.remove()
    assert [b for b, _, _ in seen] == list(stack.blocks)  # execution order, every block called
    for block, skipped, real in seen:
        if isinstance(real, torch.Tensor):
            assert isinstance(skipped, torch.Tensor) and skipped.shape == real.shape, type(block).__name__
        else:
            assert isinstance(skipped, tuple) and len(skipped) == len(real), type(block).__name__
            # a non-tensor element (HiDream-O1's keys and values, which the model discards after a skipped call) by type
            assert ([s.shape if isinstance(s, torch.Tensor) else type(s) for s in skipped]
                    == [r.shape if isinstance(r, torch.Tensor) else type(r) for r in real]), type(block).__name__
