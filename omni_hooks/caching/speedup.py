"""A speed-up: the one setting that says how much faster a run should be; the rest of a cache's config follows.

``recipe(speedup)`` gives the config fields a speed-up sets: the speed-up itself (a forward budget of
``total_steps / speedup`` per run: ``StackCacheConfig.budget_steps``; placed by the calibration's measured trajectory
and the sampler's step weights where the calibration has one, with a sampler that takes Euler steps as the step
profile's plan with the tail it favours, ``budget.tail_plan``, with any other by ``budget.measured_or_tail``; else by
the step profile or the schedule), threshold 0 (the plan alone places the computed steps: a threshold that brings a
planned step forward only cost quality on the benchmark models), the forecast ``FORECAST`` and the skip correction
``SKIP_CORRECTION``, which a sampler that takes Euler steps applies by its sigma steps and 'uni_pc', 'dpmpp_2m' and
'res_multistep' by their step weights (``skip_correction``); with any other sampler the run's notes say nothing was
corrected.

Why these (docs/benchmarks.md, "One setting for the speed-up"): under forward budgets of 15, 10 and 8 of 30 steps
(2x to 3.75x), on the four trained benchmark models, '1st order' with skip correction 0.5 was within 1 dB of the best
forecast and correction of the sweep in 11 of 12 cells with euler, and '1st order' (the correction then did nothing)
in 10 of 12 with uni_pc and 9 of 12 with dpmpp_2m and res_multistep, placed by the step profile. Where it missed,
mostly '2nd order' was ahead (by up to 4.4 dB), which was behind by up to 6.4 on another model; 'auto' was behind by
up to 9.4. The measured placement then moved uni_pc's speed-up up by a mean 4.0 dB over 2x to 6x, and the skip
correction weighed by the step weights by a further 2.3 dB at 2x to 3.75x (dpmpp_2m and res_multistep: 0.8 to 0.9);
euler's tail plan moved its speed-up up by a mean 2.1 dB over 2x to 6x, to within 1 dB of the best in 12 of 12, and
the tail plan where it rates better uni_pc's on the deep model at 3.75x by 6.6 dB
(docs/benchmarks.md, "The speed-up's plan with euler").
"""
from __future__ import annotations

from typing import Any

from .forecast import CANDIDATE_NAMES

FORECAST = 1
SKIP_CORRECTION = 0.5


def recipe(speedup: float) -> dict[str, Any]:
    """The config fields of a run at ``speedup`` (above 0; the config checks its range)."""
    return {"speedup": speedup, "threshold": 0.0, "forward_budget": 0, "forecast_order": FORECAST,
            "skip_correction": SKIP_CORRECTION}


def describe(speedup: float) -> str:
    """What a speed-up chose, in words, for the run's notes."""
    return (f"speed-up {speedup:g}x: computes 1 in {speedup:g} steps where the calibration (or the schedule) says "
            f"they matter most for this sampler, forecast '{CANDIDATE_NAMES[FORECAST]}' and skip correction "
            f"{SKIP_CORRECTION:g} (euler, uni_pc, dpmpp_2m, res_multistep), the best overall in the benchmarks; "
            "speedup 0 gives the threshold and the other inputs back")
