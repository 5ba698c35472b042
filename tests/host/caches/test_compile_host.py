"""Apply TeaCache / MagCache with ComfyUI's own torch.compile wrapper (comfy_api.torch_helpers, as the core
TorchCompileModel node applies it): caching still decides per step and the results match the uncompiled run.
Backend "eager" exercises dynamo's tracing (graph breaks, guards) without needing a C compiler."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.host

STEPS = 10


@pytest.fixture(scope="module")
def env(user_dir):
    from omnitest import tiny_models
    from omnitest.pack import pack_module, run_node

    pack_module("nodes.caches.calibration_files").save(
        "teacache", "compile-identity", {"coefficients": [0, 0, 0, 1, 0], "family": "wan", "signal": "default"})
    node = pack_module("nodes.caches.teacache").ApplyTeaCache

    class Env:
        tiny = tiny_models
        runs = pack_module("nodes.stats_store")

        @staticmethod
        def apply(model, threshold, forecast="off"):
            return run_node(node, model=model, rel_l1_thresh=threshold, start_percent=0.0, end_percent=1.0,
                            cache_device="compute device", model_variant="calibration: compile-identity",
                            forecast=forecast)[0]

    yield Env


def compiled(model):
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    clone = model.clone()
    set_torch_compile_wrapper(clone, backend="eager")
    return clone


def reasons(run) -> list[str]:
    return [b["reason"] for e in run["evaluations"] for b in e["branches"]]


@pytest.mark.parametrize("forecast", ["off", "2nd order"])
def test_teacache_under_torch_compile_matches_the_uncompiled_run(env, forecast):
    import torch._dynamo

    torch._dynamo.reset()
    case = env.tiny.build_case("wan21_t2v")
    threshold = 1.5 if forecast != "off" else 1.0  # forecasting needs two computed steps before a skip
    eager_cached = env.tiny.sample(case, model=env.apply(case.patcher, threshold, forecast), steps=STEPS, cfg=3.0)
    eager_run = env.runs.recent_runs(1)[0]
    assert eager_run["summary"]["reused"] > 0
    assert ("forecast" in reasons(eager_run)) == (forecast != "off")
    out = env.tiny.sample(case, model=env.apply(compiled(case.patcher), threshold, forecast), steps=STEPS, cfg=3.0)
    run = env.runs.recent_runs(1)[0]
    assert reasons(run) == reasons(eager_run)
    assert torch.allclose(out, eager_cached, atol=1e-5, rtol=1e-5)
    baseline = env.tiny.sample(case, model=compiled(case.patcher), steps=STEPS, cfg=3.0)
    zero = env.tiny.sample(case, model=env.apply(compiled(case.patcher), 0.0, forecast), steps=STEPS, cfg=3.0)
    assert torch.allclose(zero, baseline, atol=1e-6, rtol=1e-6)
