"""The forward budget through Apply TeaCache and Apply MagCache on this ComfyUI, on the quality benchmark's four trained
models (``benchmarks/cache_quality_model.py``) calibrated as the benchmark calibrates them: at 30 and at 8 steps every
budget computes its number of steps within one (whatever the threshold, MagCache's retention and K, or the few-step
rule say), the run's statistics say so and where the steps went, and a calibration file carries the step profile the
plan places them by."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from omnitest.cache_nodes import last_summary
from omnitest.quality import benchmark_modules

pytestmark = pytest.mark.host

BUDGETS = {30: (3, 6, 10, 16, 25), 8: (2, 4, 6, 8)}
PROMPT = 1  # one prompt per run: the count does not depend on it


@pytest.mark.parametrize("steps", [30, 8])
@pytest.mark.parametrize("name", ["small", "wide", "deep", "long"])
def test_a_budget_computes_its_number_of_steps_within_one(name, steps, own_user_directory):
    import folder_paths

    bench, models = benchmark_modules()
    spec = models.MODELS[name]
    case, counter = bench.calibrated_case(spec, steps)
    saved = json.loads((Path(folder_paths.get_user_directory()) / "omni_hooks" / "teacache" / "quality.json")
                       .read_text())
    assert len(saved["step_profile"]["changes"]) == steps  # the calibration measured every step's change
    for budget in BUDGETS[steps]:
        runs = {"TeaCache 0.1 auto": bench.tea(case, 0.1, "auto", budget),
                "TeaCache 0 off": bench.tea(case, 0.0, "off", budget),
                "MagCache 0.06 1st order": bench.mag(case, 0.06, "1st order", budget)}
        for what, model in runs.items():
            _, evaluations = bench.sample_all(spec, case, model, counter, steps, classes=[PROMPT])
            assert abs(evaluations[0] - budget) <= 1, f"{name}, {steps} steps, {what}: budget {budget}, " \
                                                      f"computed {evaluations[0]}"
            summary = last_summary()
            assert summary["budget"]["steps"] == budget and len(summary["budget"]["computed"]) == evaluations[0]
            assert summary["budget"]["calibrated"] is True
            assert summary["budget"]["computed"][0] == 0 and summary["budget"]["computed"][-1] == steps - 1
            assert any(n.startswith(f"forward budget {budget}: computed") for n in summary["notes"])
