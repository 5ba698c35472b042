"""MagCache on toy models: diffusers' MagCache tests re-stated, step policy, branches, calibration."""
from __future__ import annotations

import math
import weakref

import pytest
import torch

from omni_hooks import HookPhase, module_has_active_hooks
from omnitest.hooks import count_calls_on
from omni_hooks.blockstack import BlockStack, StackSignal, TensorArg, skip_returning
from omni_hooks.magcache import (
    CallContext,
    MagCacheConfig,
    MagRatioTable,
    apply_mag_cache_hook,
    interleave,
    nearest_interp,
    residual_change,
    split_interleaved,
)
from omni_hooks.teacache import TeaCacheConfig, apply_teacache_hook

X = TensorArg("x", 0)
ENC = TensorArg("enc", 1)
TAIL = TensorArg("input", 0)  # torch.nn.Identity.forward(input)


# -- the diffusers test models: a block returns 2x, so its residual is its input ---------------------------------------

class DoubleBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return 2 * x


class TupleDoubleBlock(torch.nn.Module):
    def forward(self, x, enc):
        return 2 * x, enc


class Stack(torch.nn.Module):
    def __init__(self, depth=2, block=DoubleBlock):
        super().__init__()
        self.blocks = torch.nn.ModuleList(block() for _ in range(depth))
        self.tail = torch.nn.Identity()

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.tail(x)


class TupleStack(Stack):
    def __init__(self):
        super().__init__(depth=1, block=TupleDoubleBlock)

    def forward(self, x, enc=None):
        enc = torch.zeros_like(x) if enc is None else enc
        for block in self.blocks:
            x, enc = block(x, enc)
        return self.tail(x)


def stack_of(model) -> BlockStack:
    skip = skip_returning(X, ENC) if isinstance(model, TupleStack) else skip_returning(X)
    return BlockStack(blocks=list(model.blocks), tail=model.tail, head_hidden=X, tail_hidden=TAIL, skip_block=skip,
                      clone_head_input=False)


RUNS: "weakref.WeakKeyDictionary[torch.nn.Module, object]" = weakref.WeakKeyDictionary()


def apply(model, **config):
    """MagCache on a toy ``Stack``; ``value`` brackets each call of the model as a call of the branch "default"
    without a step (the run counts the branch's calls, starting afresh after ``num_inference_steps``)."""
    RUNS[model] = run = apply_mag_cache_hook(stack_of(model), MagCacheConfig(**config))
    return run


def value(model, v: float) -> float:
    run = RUNS[model]
    run.begin_call(CallContext(branches=["default"], labels=["default"]))
    try:
        return model(torch.tensor([[v]])).item()
    finally:
        run.end_call()


# -- 5.9: ported -------------------------------------------------------------------------------------------------------

def test_missing_ratios_without_calibrate_is_an_error_that_says_what_to_do():
    with pytest.raises(ValueError, match="calibrate"):
        MagCacheConfig(threshold=0.1)
    MagCacheConfig(calibrate=True)  # calibration needs no ratios


def test_a_skipped_step_is_its_input_plus_the_cached_residual():
    model = Stack()
    apply(model, mag_ratios=[1.0, 1.0], threshold=100.0, num_inference_steps=2, retention_ratio=0.0,
          max_skip_steps=5)
    assert value(model, 10.0) == 40.0  # computed: residual 30
    assert value(model, 11.0) == 41.0  # skipped: 11 + 30, not 44
    assert [b.calls for b in model.blocks] == [1, 1]


def test_retention_one_computes_every_step():
    model = Stack()
    apply(model, mag_ratios=[1.0, 1.0], threshold=100.0, num_inference_steps=2, retention_ratio=1.0,
          max_skip_steps=5)
    assert value(model, 10.0) == 40.0
    assert value(model, 11.0) == 44.0


def test_tuple_blocks_pass_the_encoder_stream_through():
    model = TupleStack()
    apply(model, mag_ratios=[1.0, 1.0], threshold=100.0, num_inference_steps=2, retention_ratio=0.0,
          max_skip_steps=5)
    assert value(model, 10.0) == 20.0
    assert value(model, 11.0) == 21.0


def test_state_starts_afresh_after_n_steps():
    model = Stack()
    apply(model, mag_ratios=[1.0, 1.0], threshold=100.0, num_inference_steps=2, retention_ratio=0.0,
          max_skip_steps=5)
    value(model, 1.0)
    value(model, 1.0)
    assert value(model, 2.0) == 8.0  # a new generation: computed


def test_calibration_records_and_emits_after_n_steps():
    model = Stack()
    run = apply(model, calibrate=True, num_inference_steps=2)
    value(model, 10.0)
    assert run.branch_state("default").norm_ratios == [1.0]
    value(model, 11.0)
    assert run.branch_state("default").norm_ratios == []
    result = run.get_calibration_result()["default"]
    assert result["ratios"] == pytest.approx([1.0, 33.0 / 30.0])
    assert result["stds"] == [0.0, 0.0] and result["cos_dists"] == pytest.approx([0.0, 0.0], abs=1e-6)
    assert run.stats.reused == 0


# -- 5.9: added --------------------------------------------------------------------------------------------------------

def test_a_single_block_stack_advances_its_step_on_a_skip():
    model = Stack(depth=1)
    run = apply(model, mag_ratios=[1.0] * 3, threshold=100.0, num_inference_steps=3, retention_ratio=0.0,
                max_skip_steps=5)
    assert [value(model, 1.0) for _ in range(4)] == [2.0, 2.0, 2.0, 2.0]
    assert [e.computed for e in run.stats.evaluations] == [True, False, False, True]  # 4th call: new generation
    assert model.blocks[0].calls == 2
    assert run.branch_state("default").calls == 1


def test_middle_blocks_never_add_the_residual():
    model = Stack(depth=3)  # 8x: residual of 10 is 70
    apply(model, mag_ratios=[1.0, 1.0], threshold=100.0, num_inference_steps=2, retention_ratio=0.0,
          max_skip_steps=5)
    assert value(model, 10.0) == 80.0
    assert value(model, 11.0) == 81.0  # x + r, not x + 3r


def test_nearest_interp_lengths_endpoints_and_rounding():
    flux = [1.0] + [1.0 + i / 100 for i in range(1, 28)]
    out = nearest_interp(flux, 10)
    assert len(out) == 10 and out[0] == flux[0] and out[-1] == flux[-1]
    assert nearest_interp(flux, 28) == flux
    assert nearest_interp(flux, 1) == flux[-1:]
    assert len(nearest_interp(flux, 60)) == 60
    # scale 0.5: indices 0, 0.5, 1, 1.5, 2 round half to even -> 0, 0, 1, 2, 2
    assert nearest_interp([10.0, 20.0, 30.0], 5) == [10.0, 10.0, 20.0, 30.0, 30.0]
    with pytest.raises(ValueError):
        nearest_interp([], 3)


def test_interleaved_tables_interpolate_per_branch():
    table = [1.0, 1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4]  # c: 1, .9, .7, .5   u: 1, .8, .6, .4
    parts = split_interleaved(table)
    assert parts == {"cond": [1.0, 0.9, 0.7, 0.5], "uncond": [1.0, 0.8, 0.6, 0.4]}
    assert interleave(parts) == table
    ratios = MagRatioTable.from_values(table, interleaved=True)
    assert ratios.for_branch("cond", 4) == [1.0, 0.9, 0.7, 0.5]
    assert ratios.for_branch("uncond.1", 4) == [1.0, 0.8, 0.6, 0.4]
    assert ratios.for_branch("uncond", 7) == nearest_interp([1.0, 0.8, 0.6, 0.4], 7)
    assert ratios.for_branch("something", 2) == [1.0, 0.5]  # unknown kinds read the cond curve
    flat = MagRatioTable.from_values([1.0, 0.5])
    assert flat.for_branch("uncond", 2) == flat.for_branch("cond", 2) == [1.0, 0.5]
    with pytest.raises(ValueError, match="even"):
        split_interleaved([1.0, 1.0, 1.0])


# -- explicit calls (a host that knows branches and steps) ------------------------------------------------------------

class ToyBlock(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin = torch.nn.Linear(dim, dim)

    def forward(self, x, *, t):
        x = x.clone()
        x += torch.tanh(self.lin(x) * (1 + t[:, None, None]))  # in place, like Flux single blocks
        return x


class ToyDiT(torch.nn.Module):
    def __init__(self, dim=8, depth=3):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(dim, dim)
        self.blocks = torch.nn.ModuleList(ToyBlock(dim) for _ in range(depth))
        self.tail = torch.nn.Linear(dim, dim)

    def forward(self, x, timestep):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, t=timestep)
        return self.tail(h)


def toy_stack(model: ToyDiT) -> BlockStack:
    return BlockStack(blocks=list(model.blocks), tail=model.tail, head_hidden=X, tail_hidden=TAIL,
                      skip_block=skip_returning(X))


def run_steps(model, run, steps, x, branches=("cond",), labels=None):
    outputs = []
    for step in range(steps):
        run.begin_call(CallContext(branches=list(branches), labels=list(labels or branches), step=step,
                                total_steps=steps))
        try:
            outputs.append(model(x, torch.full((x.shape[0],), 1 - step / steps)))
        finally:
            run.end_call()
    return outputs


def explicit(model, **config):
    return apply_mag_cache_hook(toy_stack(model), MagCacheConfig(**config))


def computed(run):
    return [e.computed for e in run.stats.evaluations]


def test_threshold_zero_never_skips_and_is_bit_identical():
    model = ToyDiT()
    x = torch.randn(2, 5, 8)
    expected = [model(x, torch.full((2,), 1 - s / 8)) for s in range(8)]
    run = explicit(model, threshold=0.0, mag_ratios=[1.0] * 8, retention_ratio=0.0, max_skip_steps=8)
    got = run_steps(model, run, 8, x, branches=("c", "u"), labels=("cond", "uncond"))
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert run.stats.reused == 0 and "threshold is 0" in run.stats.why_nothing_was_reused()


def test_k_bounds_consecutive_skips_and_zero_never_skips():
    model = ToyDiT()
    x = torch.randn(1, 5, 8)
    run = explicit(model, threshold=1.0, mag_ratios=[1.0] * 8, retention_ratio=0.0, max_skip_steps=2)
    run_steps(model, run, 8, x)
    assert computed(run) == [True, False, False, True, False, False, True, False]
    assert [e.branches[0].reason for e in run.stats.evaluations][:4] == ["first", "reuse", "reuse", "max-skips"]
    run.remove()
    run = explicit(model, threshold=1.0, mag_ratios=[1.0] * 8, retention_ratio=0.0, max_skip_steps=0)
    run_steps(model, run, 8, x)
    assert all(computed(run))
    assert "(K)" in run.stats.why_nothing_was_reused()


def test_retention_computes_the_first_steps():
    model = ToyDiT()
    run = explicit(model, threshold=1.0, mag_ratios=[1.0] * 8, retention_ratio=0.5, max_skip_steps=8)
    run_steps(model, run, 8, torch.randn(1, 5, 8))
    assert computed(run) == [True] * 4 + [False] * 4  # int(0.5 * 8 + 0.5) = 4
    assert {e.branches[0].reason for e in run.stats.evaluations[:4]} == {"retention"}


def test_window_outside_start_end_is_computed():
    model = ToyDiT()
    run = explicit(model, threshold=1.0, mag_ratios=[1.0] * 8, retention_ratio=0.0, max_skip_steps=8,
                   start_percent=0.0, end_percent=0.5)
    run_steps(model, run, 8, torch.randn(1, 5, 8))
    assert computed(run) == [True, False, False, False, True, True, True, True]


def test_error_accumulates_from_the_ratio_product():
    model = ToyDiT()
    run = explicit(model, threshold=0.2, mag_ratios=[1.0] + [0.9] * 7, retention_ratio=0.0, max_skip_steps=8)
    run_steps(model, run, 4, torch.randn(1, 5, 8))
    metrics = [e.branches[0].metric for e in run.stats.evaluations]
    # t1: ratio .9, err .1 -> reuse; t2: ratio .81, err .1 + .19 = .29 > .2 -> compute; t3: restarts at .1
    assert metrics[1:] == pytest.approx([0.1, 0.29, 0.1])
    assert computed(run) == [True, False, True, False]


def test_skipped_steps_never_rise_as_the_threshold_falls():
    x = torch.randn(1, 5, 8)
    reused = []
    for threshold in [1.0, 0.5, 0.2, 0.1, 0.06, 0.04, 0.0]:
        model = ToyDiT()
        run = explicit(model, threshold=threshold, mag_ratios=[0.95] * 20, retention_ratio=0.1, max_skip_steps=10)
        run_steps(model, run, 20, x)
        reused.append(run.stats.reused)
    assert reused == sorted(reused, reverse=True) and reused[0] > reused[-3] > 0 and reused[-1] == 0


def test_a_reused_step_equals_its_head_input_plus_the_cached_residual():
    model = ToyDiT()
    x = torch.randn(1, 5, 8)
    tail_inputs, head_inputs = [], []
    model.tail.register_forward_pre_hook(lambda m, args: tail_inputs.append(args[0].clone()))
    model.blocks[0].register_forward_pre_hook(lambda m, args, kwargs: head_inputs.append(args[0].clone()),
                                              with_kwargs=True)
    run = explicit(model, threshold=1.0, mag_ratios=[1.0] * 3, retention_ratio=0.0, max_skip_steps=1)
    outputs = run_steps(model, run, 3, x)
    assert computed(run) == [True, False, True]
    residual = tail_inputs[0] - head_inputs[0]
    with torch.no_grad():
        assert torch.equal(outputs[1], model.tail(head_inputs[1] + residual))
    assert torch.equal(run.branch_state("cond").previous_residual, tail_inputs[2] - head_inputs[2])


def test_each_branch_reads_its_own_curve_and_any_compute_computes_all():
    model = ToyDiT()
    # cond curve flat (err 0), uncond curve 0.5 (err .5 > threshold): every call computes because of uncond
    table = [1.0, 1.0] + [1.0, 0.5] * 5
    run = explicit(model, threshold=0.3, mag_ratios=table, interleaved=True, retention_ratio=0.0, max_skip_steps=8)
    run_steps(model, run, 6, torch.randn(2, 5, 8), branches=("c", "u"), labels=("cond", "uncond"))
    assert all(computed(run))
    second = run.stats.evaluations[1].branches
    assert [(b.branch, b.reason) for b in second] == [("cond", "other-branch"), ("uncond", "threshold")]
    assert second[0].metric == 0.0 and second[1].metric == pytest.approx(0.5)
    ra, rb = run.branch_state("c").previous_residual, run.branch_state("u").previous_residual
    assert ra.shape == rb.shape == (1, 5, 8) and not torch.equal(ra, rb)
    run.remove()
    # alone (no CFG) a cond branch reads the flat cond curve and skips; an uncond one never does
    for label, expected in (("cond", [True] + [False] * 5), ("uncond", [True] * 6)):
        run = explicit(model, threshold=0.3, mag_ratios=table, interleaved=True, retention_ratio=0.0,
                       max_skip_steps=8)
        run_steps(model, run, 6, torch.randn(1, 5, 8), branches=("k",), labels=(label,))
        assert computed(run) == expected, label
        run.remove()


def test_branch_state_is_isolated_across_separate_calls():
    model = ToyDiT()
    run = explicit(model, threshold=1.0, mag_ratios=[1.0] * 6, retention_ratio=0.0, max_skip_steps=8)
    x = torch.randn(1, 5, 8)
    for step in range(3):  # cond and uncond in separate calls (ComfyUI does this when their shapes differ)
        for key, label in (("c", "cond"), ("u", "uncond")):
            run.begin_call(CallContext([key], [label], step=step, total_steps=6))
            model(x + (0 if key == "c" else 1), torch.full((1,), 1.0))
            run.end_call()
    assert computed(run) == [True, True, False, False, False, False]
    assert run.branch_state("c").calls == run.branch_state("u").calls == 3
    assert not torch.equal(run.branch_state("c").previous_residual, run.branch_state("u").previous_residual)


def test_a_step_going_backwards_starts_a_new_generation():
    model = ToyDiT()
    run = explicit(model, threshold=1.0, mag_ratios=[1.0] * 4, retention_ratio=0.0, max_skip_steps=8)
    x = torch.randn(1, 5, 8)
    run_steps(model, run, 4, x)
    run_steps(model, run, 4, x)
    assert computed(run) == [True, False, False, False] * 2


def test_outside_a_call_explicit_runs_pass_through():
    model = ToyDiT()
    x = torch.randn(1, 5, 8)
    expected = model(x, torch.ones(1))
    run = explicit(model, threshold=1.0, mag_ratios=[1.0] * 4, retention_ratio=0.0)
    run_steps(model, run, 2, x)
    assert torch.equal(model(x, torch.ones(1)), expected) and len(run.stats.evaluations) == 2


def test_changed_resolution_computes_instead_of_reusing():
    model = ToyDiT()
    run = explicit(model, threshold=1.0, mag_ratios=[1.0] * 6, retention_ratio=0.0, max_skip_steps=8)
    run_steps(model, run, 2, torch.randn(1, 5, 8))
    run.begin_call(CallContext(["cond"], ["cond"], step=2, total_steps=6))
    out = model(torch.randn(1, 7, 8), torch.ones(1))
    record = run.end_call()
    assert out.shape == (1, 7, 8) and record.computed and record.branches[0].reason == "shape"


def test_cache_device_holds_residuals():
    model = ToyDiT()
    run = explicit(model, threshold=1.0, mag_ratios=[1.0] * 3, retention_ratio=0.0, cache_device=torch.device("cpu"))
    run_steps(model, run, 3, torch.randn(1, 5, 8))
    assert run.branch_state("cond").previous_residual.device.type == "cpu" and run.stats.cache_bytes > 0


# -- calibration metrics -----------------------------------------------------------------------------------------------

class ScaledResidualBlock(torch.nn.Module):
    """Adds ``s * direction``: the residual's magnitude ratio is s_t / s_{t-1}, its direction fixed (or flipped)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.register_buffer("direction", torch.randn(1, 4, 6, generator=g))

    def forward(self, x, *, s):
        return x + s * self.direction


class ScaledModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([ScaledResidualBlock()])
        self.tail = torch.nn.Identity()

    def forward(self, x, s):
        return self.tail(self.blocks[0](x, s=s))


def test_calibration_measures_ratio_spread_and_cosine_distance():
    model = ScaledModel()
    stack = BlockStack(blocks=list(model.blocks), tail=model.tail, head_hidden=X, tail_hidden=TAIL,
                       skip_block=skip_returning(X))
    run = apply_mag_cache_hook(stack, MagCacheConfig(calibrate=True))
    scales = [2.0, 1.0, 0.5, -0.5]
    x = torch.randn(1, 4, 6)
    for step, s in enumerate(scales):
        run.begin_call(CallContext(["u"], ["uncond"], step=step, total_steps=len(scales)))
        model(x, s)
        run.end_call()
    result = run.get_calibration_result()["uncond"]
    assert result["ratios"] == pytest.approx([1.0, 0.5, 0.5, 1.0], rel=1e-5)
    assert result["stds"] == pytest.approx([0.0] * 4, abs=1e-5)
    assert result["cos_dists"] == pytest.approx([0.0, 0.0, 0.0, 2.0], abs=1e-5)
    assert run.stats.reused == 0
    run.remove()
    assert run.get_calibration_result()["uncond"]["ratios"] == pytest.approx([1.0, 0.5, 0.5, 1.0], rel=1e-5)


def test_residual_change_matches_a_direct_computation():
    g = torch.Generator().manual_seed(0)
    cur, prev = torch.randn(2, 7, 5, generator=g), torch.randn(2, 7, 5, generator=g)
    ratio, std, cos_dis = residual_change(cur, prev)
    per_token = cur.norm(dim=-1) / (prev.norm(dim=-1) + 1e-8)
    assert ratio == pytest.approx(per_token.mean().item(), rel=1e-6)
    assert std == pytest.approx(per_token.std().item(), rel=1e-6)
    cos = torch.nn.functional.cosine_similarity(cur, prev, dim=-1)
    assert cos_dis == pytest.approx((1 - cos).mean().item(), rel=1e-6)
    assert math.isfinite(residual_change(torch.ones(3), torch.ones(3))[1])


# -- composition -------------------------------------------------------------------------------------------------------

def test_remove_restores_every_module_exactly():
    model = ToyDiT()
    before = {name: set(m.__dict__) for name, m in model.named_modules()}
    run = explicit(model, threshold=1.0, mag_ratios=[1.0] * 3)
    run_steps(model, run, 3, torch.randn(1, 5, 8))
    run.remove()
    assert {name: set(m.__dict__) for name, m in model.named_modules()} == before
    assert not any(module_has_active_hooks(m) for m in model.modules())


@pytest.mark.parametrize("phase", [HookPhase.PLACEMENT, HookPhase.OBSERVATION])
def test_composes_with_a_pre_forward_only_hook_on_the_same_block(phase):
    """A placement hook (block offload) runs only on computed calls; an observation hook on every call."""

    model = ToyDiT()
    hooks = count_calls_on(model.blocks, phase, name="sequential_offload")
    run = explicit(model, threshold=1.0, mag_ratios=[1.0] * 6, retention_ratio=0.0, max_skip_steps=8)
    run_steps(model, run, 6, torch.randn(1, 5, 8))
    assert run.stats.reused == 5
    expected = 1 if phase is HookPhase.PLACEMENT else 6
    assert [h.calls for h in hooks] == [expected] * len(hooks)
    run.remove()
    assert module_has_active_hooks(model.blocks[0])


def test_teacache_and_magcache_on_the_same_blocks_is_refused_naming_both():
    model = ToyDiT()
    tea = apply_teacache_hook(toy_stack(model), TeaCacheConfig(0.5),
                              StackSignal(compute=lambda block, args, kwargs, captured: kwargs["t"]))
    with pytest.raises(RuntimeError, match=r"'teacache'.*'mag_cache_leader_block_hook'"):
        explicit(model, threshold=1.0, mag_ratios=[1.0])
    tea.remove()
    run = explicit(model, threshold=1.0, mag_ratios=[1.0])
    with pytest.raises(RuntimeError, match=r"'mag_cache_leader_block_hook'.*'teacache'"):
        apply_teacache_hook(toy_stack(model), TeaCacheConfig(0.5),
                            StackSignal(compute=lambda block, args, kwargs, captured: kwargs["t"]))
    run.remove()
    assert not any(module_has_active_hooks(m) for m in model.modules())


@pytest.mark.parametrize("kwargs, message", [
    ({"threshold": -0.1}, "threshold"),
    ({"max_skip_steps": -1}, "max_skip_steps"),
    ({"max_skip_steps": 1.5}, "max_skip_steps"),
    ({"retention_ratio": 1.5}, "retention_ratio"),
    ({"num_inference_steps": 0}, "num_inference_steps"),
    ({"start_percent": 0.8, "end_percent": 0.2}, "start_percent"),
    ({"mag_ratios": [1.0, 1.0, 1.0], "interleaved": True}, "even"),
    ({"mag_ratios": [1.0, float("nan")]}, "finite"),
])
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MagCacheConfig(**{"mag_ratios": [1.0], **kwargs})
