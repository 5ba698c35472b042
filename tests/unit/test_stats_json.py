"""Run statistics as JSON: always valid (non-finite numbers as text), and long runs summarised into a timeline."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import torch

from omni_hooks.caching.stats import BranchDecision, CacheRunStats, EvaluationRecord, json_safe


def strict(value) -> str:
    return json.dumps(value, allow_nan=False)


def run_with(threshold: float, metrics: list[float | None], reasons: list[str] | None = None) -> CacheRunStats:
    # the fields of a cache config the statistics read (a real config refuses a threshold that is not finite)
    stats = CacheRunStats("teacache", SimpleNamespace(model_label="test", threshold=threshold, notes=(),
                                                      skip_correction=0.0))
    for i, metric in enumerate(metrics):
        reason = reasons[i] if reasons else ("reuse" if i % 2 else "threshold")
        computed = reason != "reuse"
        stats.record(EvaluationRecord(step=i, total_steps=len(metrics), computed=computed,
                                      seconds=0.1 if computed else 0.001,
                                      branches=[BranchDecision("cond", computed, reason, metric, threshold),
                                                BranchDecision("uncond", computed, reason, None, threshold)]))
    return stats


def test_non_finite_numbers_become_text_and_everything_else_stays():
    value = {"a": math.inf, "b": -math.inf, "c": math.nan, "d": 1.5, "e": [1, None, True, "x"], 3: (np.float32(2.5),),
             "f": np.int64(7), "g": torch.tensor(float("inf")), "h": np.float64("nan")}
    safe = json_safe(value)
    assert safe == {"a": "Infinity", "b": "-Infinity", "c": "NaN", "d": 1.5, "e": [1, None, True, "x"], "3": [2.5],
                    "f": 7, "g": "Infinity", "h": "NaN"}
    strict(safe)  # raises on any NaN/Infinity left


def test_a_run_with_an_infinite_threshold_and_nan_metrics_serialises_strictly():
    stats = run_with(math.inf, [math.nan, 0.5, math.inf, None])
    with_nan = stats.to_dict()
    text = strict(with_nan)
    assert '"threshold": "Infinity"' in text
    assert with_nan["summary"]["threshold"] == "Infinity"
    assert [e["branches"][0]["metric"] for e in with_nan["evaluations"]] == ["NaN", 0.5, "Infinity", None]
    assert stats.summary()["threshold"] == math.inf  # the Python API keeps numbers
    assert "threshold inf" in stats.log_line()
    (warning,) = [w for w in stats.summary()["warnings"] if "not a finite number" in w]
    assert warning.startswith("the measured change was not a finite number in 2 branch evaluation(s)")


def test_a_finite_run_has_no_overflow_warning():
    assert not [w for w in run_with(0.3, [0.1, 0.2, None]).summary()["warnings"] if "finite" in w]
    (warning,) = run_with(math.nan, [None]).summary()["warnings"][:1]
    assert warning.startswith("the threshold is nan")


def test_timeline_bins_keep_counts_reasons_and_metric_peaks():
    reasons = ["first", "reuse", "reuse", "threshold", "reuse", "max-skips", "reuse", "forced"]
    stats = run_with(0.3, [None, 0.1, 0.2, 0.4, 0.1, 0.25, math.nan, 0.2], reasons)
    timeline = stats.timeline(max_bins=3)
    strict(timeline)
    assert timeline["bin_size"] == 3
    bins = timeline["bins"]
    assert [(b["first_step"], b["last_step"], b["evaluations"], b["computed"]) for b in bins] == [
        (0, 2, 3, 1), (3, 5, 3, 2), (6, 7, 2, 1)]
    cond = [b["branches"]["cond"] for b in bins]
    assert cond[0]["reasons"] == {"first": 1, "reuse": 2} and cond[0]["reused"] == 2
    assert cond[1]["reasons"] == {"threshold": 1, "reuse": 1, "max-skips": 1}
    assert [c["metric_max"] for c in cond] == [0.2, 0.4, 0.2]  # NaN is not a peak
    assert bins[1]["branches"]["uncond"]["metric_max"] is None
    assert sum(b["evaluations"] for b in bins) == len(stats.evaluations)
    assert sum(b["computed"] for b in bins) == stats.computed
    assert math.isclose(sum(b["seconds"] for b in bins), stats.model_seconds)


def test_timeline_of_a_10000_step_run_is_small():
    stats = run_with(0.2, [0.1] * 10_000)
    full = len(strict(stats.to_dict()))
    timeline = stats.timeline(max_bins=240)
    assert len(timeline["bins"]) <= 240
    assert len(strict(timeline)) < full / 20
