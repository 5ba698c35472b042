"""TeaCache on a toy DiT: decisions, residual reuse, branches, composition, calibration."""
from __future__ import annotations

import pytest
import torch

from omni_hooks import HookPhase, HookRegistry, ModelHook, module_has_active_hooks
from omnitest.hooks import count_calls_on
from omni_hooks.blockstack import BlockStack, StackSignal, TensorArg, skip_returning
from omni_hooks.teacache import (
    CallContext,
    TeaCacheConfig,
    apply_teacache_hook,
    fit_coefficients,
    recommended_threshold,
)

ALWAYS_COMPUTE = (0.0, 0.0, 0.0, 0.0, 1.0)   # f == 1 >= any threshold below 1
ALWAYS_REUSE = (0.0, 0.0, 0.0, 0.0, 0.0)     # f == 0
IDENTITY = (0.0, 0.0, 0.0, 1.0, 0.0)


class Block(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.mod = torch.nn.Linear(dim, dim)
        self.lin = torch.nn.Linear(dim, dim)
        self.calls = 0

    def forward(self, x, *, t):
        self.calls += 1
        x = x.clone()
        x += torch.tanh(self.lin(x) * (1 + self.mod(t)[:, None]))  # in place, like Flux single blocks
        return x


class ToyDiT(torch.nn.Module):
    """embed -> time_proj(t) -> blocks(x, t=...) -> tail(x, t); the shape of the hosts' DiTs."""

    def __init__(self, dim=8, depth=3):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(dim, dim)
        self.time_proj = torch.nn.Linear(1, dim)
        self.blocks = torch.nn.ModuleList(Block(dim) for _ in range(depth))
        self.tail = torch.nn.Linear(dim, dim)

    def forward(self, x, timestep):
        t = self.time_proj(timestep[:, None])
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, t=t)
        return self.tail(h)


def toy_stack(model: ToyDiT) -> BlockStack:
    return BlockStack(blocks=list(model.blocks), tail=model.tail, head_hidden=TensorArg("x", 0),
                      tail_hidden=TensorArg("input", 0), skip_block=skip_returning(TensorArg("x", 0)))


def signal_from_time_embedding() -> StackSignal:
    return StackSignal(compute=lambda block, args, kwargs, captured: kwargs["t"])


def run_steps(model, run, timesteps, x, branches=("c",), labels=None, total=None):
    outputs = []
    for step, ts in enumerate(timesteps):
        run.begin_call(CallContext(branches=list(branches), labels=list(labels or branches), step=step,
                                total_steps=total or len(timesteps)))
        try:
            outputs.append(model(x, torch.full((x.shape[0],), ts)))
        finally:
            run.end_call()
    return outputs


TIMESTEPS = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5]


def test_always_compute_coefficients_match_the_plain_model_bit_for_bit():
    model = ToyDiT()
    x = torch.randn(2, 5, 8)
    expected = [model(x, torch.full((2,), ts)) for ts in TIMESTEPS]
    run = apply_teacache_hook(toy_stack(model), TeaCacheConfig(0.5, ALWAYS_COMPUTE), signal_from_time_embedding())
    got = run_steps(model, run, TIMESTEPS, x)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert run.stats.computed == len(TIMESTEPS) and run.stats.reused == 0


def test_threshold_zero_never_reuses_and_is_bit_identical():
    model = ToyDiT()
    x = torch.randn(2, 5, 8)
    expected = [model(x, torch.full((2,), ts)) for ts in TIMESTEPS]
    run = apply_teacache_hook(toy_stack(model), TeaCacheConfig(0.0, ALWAYS_REUSE), signal_from_time_embedding())
    got = run_steps(model, run, TIMESTEPS, x)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert run.stats.reused == 0
    assert "threshold is 0" in run.stats.why_nothing_was_reused()


def test_always_reuse_skips_every_middle_step_and_forces_first_and_last():
    model = ToyDiT()
    x = torch.randn(1, 5, 8)
    run = apply_teacache_hook(toy_stack(model), TeaCacheConfig(0.5, ALWAYS_REUSE), signal_from_time_embedding())
    run_steps(model, run, TIMESTEPS, x)
    computed = [e.computed for e in run.stats.evaluations]
    assert computed == [True, False, False, False, False, True]
    assert [b.calls for b in model.blocks] == [2, 2, 2]
    assert [e.branches[0].reason for e in run.stats.evaluations][0] == "first"
    assert run.stats.evaluations[-1].branches[0].reason == "forced"


def test_reused_step_equals_its_head_input_plus_the_cached_residual():
    model = ToyDiT()
    x = torch.randn(1, 5, 8)
    tail_inputs, head_inputs = [], []
    model.tail.register_forward_pre_hook(lambda m, args: tail_inputs.append(args[0].clone()))
    model.blocks[0].register_forward_pre_hook(lambda m, args, kwargs: head_inputs.append(args[0].clone()),
                                              with_kwargs=True)
    run = apply_teacache_hook(toy_stack(model), TeaCacheConfig(0.5, ALWAYS_REUSE), signal_from_time_embedding())
    outputs = run_steps(model, run, TIMESTEPS[:3], x)
    assert [e.computed for e in run.stats.evaluations] == [True, False, True]
    residual = tail_inputs[0] - head_inputs[0]  # what the computed step's blocks added
    assert torch.equal(run.branch_state("c").previous_residual, tail_inputs[2] - head_inputs[2])
    with torch.no_grad():
        assert torch.equal(outputs[1], model.tail(head_inputs[1] + residual))


def test_identity_polynomial_accumulates_until_the_threshold():
    model = ToyDiT()
    x = torch.randn(1, 5, 8)
    run = apply_teacache_hook(toy_stack(model), TeaCacheConfig(0.05, IDENTITY), signal_from_time_embedding())
    run_steps(model, run, [1.0, 0.999, 0.998, 0.5, 0.499, 0.1], x)
    reasons = [e.branches[0].reason for e in run.stats.evaluations]
    assert reasons[0] == "first" and reasons[1] == "reuse" and reasons[3] == "threshold"
    metrics = [e.branches[0].metric for e in run.stats.evaluations]
    assert metrics[2] > metrics[1] > 0  # accumulates while reusing


def test_computed_count_never_rises_with_the_threshold():
    x = torch.randn(1, 5, 8)
    timesteps = [1 - i / 20 for i in range(20)]
    counts = []
    for thresh in [0.0, 0.01, 0.05, 0.1, 0.3, 1.0]:
        model = ToyDiT()
        run = apply_teacache_hook(toy_stack(model), TeaCacheConfig(thresh, IDENTITY), signal_from_time_embedding())
        run_steps(model, run, timesteps, x)
        counts.append(run.stats.computed)
    assert counts == sorted(counts, reverse=True) and counts[0] == 20 and counts[-1] < 20


def test_each_branch_has_its_own_state_and_any_compute_computes_all():
    model = ToyDiT()
    run = apply_teacache_hook(toy_stack(model), TeaCacheConfig(0.5, ALWAYS_REUSE, force_last_step=False),
                              signal_from_time_embedding())
    x = torch.randn(2, 5, 8)
    run_steps(model, run, TIMESTEPS[:3], x, branches=("u1", "u2"), labels=("uncond", "cond"))
    assert sorted(run.states.contexts()) == ["u1", "u2"]
    assert [run.branch_state(k).cnt for k in ("u1", "u2")] == [3, 3]
    assert [e.computed for e in run.stats.evaluations] == [True, False, False]
    assert [b.branch for b in run.stats.evaluations[1].branches] == ["uncond", "cond"]
    # a new branch appearing (e.g. cond/uncond split into separate calls) is computed on its own first call
    run.begin_call(CallContext(branches=["u1", "u3"], labels=["uncond", "cond.1"], step=3, total_steps=10))
    model(x, torch.full((2,), 0.4))
    record = run.end_call()
    assert record.computed and [b.reason for b in record.branches] == ["other-branch", "first"]


def test_per_branch_residuals_are_kept_apart():
    model = ToyDiT()
    run = apply_teacache_hook(toy_stack(model), TeaCacheConfig(0.5, ALWAYS_REUSE, force_last_step=False),
                              signal_from_time_embedding())
    x = torch.randn(2, 5, 8)
    run_steps(model, run, TIMESTEPS[:1], x, branches=("a", "b"))
    ra, rb = run.branch_state("a").previous_residual, run.branch_state("b").previous_residual
    assert ra.shape == rb.shape == (1, 5, 8) and not torch.equal(ra, rb)


def test_changed_resolution_computes_instead_of_reusing():
    model = ToyDiT()
    run = apply_teacache_hook(toy_stack(model), TeaCacheConfig(0.5, ALWAYS_REUSE, force_last_step=False),
                              signal_from_time_embedding())
    run_steps(model, run, TIMESTEPS[:2], torch.randn(1, 5, 8))
    run.begin_call(CallContext(["c"], ["c"], step=2, total_steps=6))
    out = model(torch.randn(1, 7, 8), torch.full((1,), 0.5))
    record = run.end_call()
    assert out.shape == (1, 7, 8)
    assert record.computed and record.branches[0].reason == "shape"


def test_window_outside_start_end_is_computed():
    model = ToyDiT()
    cfg = TeaCacheConfig(0.5, ALWAYS_REUSE, start_percent=0.5, end_percent=1.0, force_last_step=False)
    run = apply_teacache_hook(toy_stack(model), cfg, signal_from_time_embedding())
    run_steps(model, run, TIMESTEPS, torch.randn(1, 5, 8))
    assert [e.branches[0].reason for e in run.stats.evaluations] == [
        "first", "window", "window", "reuse", "reuse", "reuse"]


def test_outside_a_call_the_hooks_pass_through():
    model = ToyDiT()
    x = torch.randn(1, 5, 8)
    expected = model(x, torch.ones(1))
    run = apply_teacache_hook(toy_stack(model), TeaCacheConfig(0.5, ALWAYS_REUSE), signal_from_time_embedding())
    run_steps(model, run, TIMESTEPS[:2], x)
    assert torch.equal(model(x, torch.ones(1)), expected)
    assert run.stats.evaluations.__len__() == 2


def test_capture_module_feeds_the_signal():
    model = ToyDiT()
    seen = []

    def compute(block, args, kwargs, captured):
        seen.append(captured)
        return captured

    run = apply_teacache_hook(toy_stack(model), TeaCacheConfig(0.5, ALWAYS_REUSE),
                              StackSignal(compute=compute, capture=model.time_proj))
    run_steps(model, run, TIMESTEPS[:2], torch.randn(1, 5, 8))
    assert seen[0].shape == (1, 1) and seen[1].item() == pytest.approx(0.9)


def test_remove_restores_every_module_exactly():
    model = ToyDiT()
    before = {name: set(m.__dict__) for name, m in model.named_modules()}
    run = apply_teacache_hook(toy_stack(model), TeaCacheConfig(0.5, ALWAYS_REUSE),
                              StackSignal(compute=lambda b, a, k, c: c, capture=model.time_proj))
    run_steps(model, run, TIMESTEPS[:2], torch.randn(1, 5, 8))
    run.remove()
    assert {name: set(m.__dict__) for name, m in model.named_modules()} == before
    assert not any(module_has_active_hooks(m) for m in model.modules())


@pytest.mark.parametrize("phase", [HookPhase.PLACEMENT, HookPhase.OBSERVATION])
def test_composes_with_a_pre_forward_only_hook_on_the_same_block(phase):
    """Regression for vllm-omni #1868: with an offload-like hook present TeaCache must still skip; and a placement
    hook (what block offload is) runs only on the calls whose blocks really run, so a skipped step moves no weights.
    An observation hook sees every call."""

    model = ToyDiT()
    hooks = count_calls_on(model.blocks, phase, name="sequential_offload")
    run = apply_teacache_hook(toy_stack(model), TeaCacheConfig(0.5, ALWAYS_REUSE), signal_from_time_embedding())
    run_steps(model, run, TIMESTEPS, torch.randn(1, 5, 8))
    assert run.stats.reused == len(TIMESTEPS) - 2
    expected = run.stats.computed if phase is HookPhase.PLACEMENT else len(TIMESTEPS)
    assert [h.calls for h in hooks] == [expected] * len(hooks)
    run.remove()
    assert module_has_active_hooks(model.blocks[0])  # the other pack's hook stays


def test_a_second_forward_override_on_the_stack_is_refused_and_nothing_is_left_behind():
    class OtherCache(ModelHook):
        def new_forward(self, module, *args, **kwargs):
            return self.fn_ref.original_forward(*args, **kwargs)

    model = ToyDiT()
    HookRegistry.get_or_create(model.blocks[1]).register_hook("mag_cache_block_hook", OtherCache())
    with pytest.raises(RuntimeError, match="mag_cache_block_hook"):
        apply_teacache_hook(toy_stack(model), TeaCacheConfig(0.5, ALWAYS_REUSE), signal_from_time_embedding())
    assert not module_has_active_hooks(model.blocks[0]) and not module_has_active_hooks(model.tail)
    assert module_has_active_hooks(model.blocks[1])


def test_cache_device_holds_residuals():
    model = ToyDiT()
    run = apply_teacache_hook(toy_stack(model), TeaCacheConfig(0.5, ALWAYS_REUSE, cache_device=torch.device("cpu")),
                              signal_from_time_embedding())
    run_steps(model, run, TIMESTEPS[:3], torch.randn(1, 5, 8))
    assert run.branch_state("c").previous_residual.device.type == "cpu"
    assert run.stats.cache_bytes > 0


def test_calibration_records_pairs_computes_everything_and_fits():
    model = ToyDiT()
    run = apply_teacache_hook(toy_stack(model), TeaCacheConfig(0.5, ALWAYS_REUSE, calibrate=True),
                              signal_from_time_embedding())
    timesteps = [1 - i / 12 for i in range(12)]
    run_steps(model, run, timesteps, torch.randn(2, 5, 8), branches=("a", "b"))
    assert run.stats.reused == 0
    series = run.calibration_series()
    assert [len(branch) for branch in series] == [len(timesteps) - 1] * 2
    pairs = [pair for branch in series for pair in branch]
    assert all(x > 0 and y > 0 for x, y in pairs)
    coefficients = fit_coefficients(pairs)
    assert len(coefficients) == 5


def test_a_calibrations_recommended_threshold_gives_its_speed_up_on_the_run_it_measured():
    """Replayed by TeaCache itself on the run the calibration measured, the recommended threshold computes about
    1/1.8 of the steps (RECOMMENDED_SPEEDUP, the published recommendations' speed-up), and a threshold a little
    above it computes fewer: the recommendation is the largest that keeps that many."""
    import math

    model = ToyDiT()
    timesteps = [1 - (i / 30) ** 1.5 for i in range(30)]  # uneven changes, as a real schedule's
    x = torch.randn(2, 5, 8)
    calibrating = apply_teacache_hook(toy_stack(model), TeaCacheConfig(0.0, IDENTITY, calibrate=True),
                                      signal_from_time_embedding())
    run_steps(model, calibrating, timesteps, x, branches=("c", "u"))
    series = calibrating.calibration_series()
    calibrating.remove()
    coefficients = fit_coefficients([pair for branch in series for pair in branch])
    threshold = recommended_threshold(coefficients, series)
    assert threshold > 0

    def computed_steps(value: float) -> int:  # of the decisions (a step's branches may decide as one)
        run = apply_teacache_hook(toy_stack(model), TeaCacheConfig(value, tuple(coefficients), ret_steps=0,
                                                                   force_last_step=False),
                                  signal_from_time_embedding())
        try:
            run_steps(model, run, timesteps, x, branches=("c", "u"))
            assert len(run.stats.evaluations) == len(timesteps)
            return sum(e.computed for e in run.stats.evaluations)
        finally:
            run.remove()

    wanted = math.ceil(len(timesteps) / 1.8)
    assert wanted <= computed_steps(threshold) <= wanted + 1
    assert computed_steps(threshold * 1.05) < computed_steps(threshold)
    assert recommended_threshold(coefficients, [[], []]) == 0.2  # nothing to replay: the default


def test_fit_recovers_a_known_polynomial_and_refuses_too_few_points():
    truth = [2.0, -1.0, 0.5, 3.0, 0.1]
    import numpy as np
    xs = np.linspace(0.01, 0.5, 30)
    pairs = [(float(x), float(np.polyval(truth, x))) for x in xs]
    assert fit_coefficients(pairs) == pytest.approx(truth, rel=1e-6, abs=1e-6)
    with pytest.raises(ValueError, match="distinct"):
        fit_coefficients(pairs[:3])


@pytest.mark.parametrize("kwargs, message", [
    ({"threshold": -0.1}, "threshold"),
    ({"coefficients": (1.0, 2.0)}, "exactly 5"),
    ({"start_percent": 0.8, "end_percent": 0.2}, "start_percent"),
])
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TeaCacheConfig(**kwargs)


def test_a_stack_whose_output_changes_shape_is_always_computed_and_says_why():
    class Slicing(ToyDiT):
        def forward(self, x, timestep):
            t = self.time_proj(timestep[:, None])
            h = self.embed(x)
            for block in self.blocks:
                h = block(h, t=t)
            return self.tail(h[:, 1:])  # e.g. reference tokens dropped before the final layer

    model = Slicing()
    x = torch.randn(1, 5, 8)
    expected = [model(x, torch.full((1,), ts)) for ts in TIMESTEPS]
    run = apply_teacache_hook(toy_stack(model), TeaCacheConfig(0.5, ALWAYS_REUSE), signal_from_time_embedding())
    got = run_steps(model, run, TIMESTEPS, x)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert run.stats.reused == 0 and run.stats.stack_shape_mismatch
    assert "another shape than its input" in run.stats.why_nothing_was_reused()
