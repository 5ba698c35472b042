"""A speed-up: the one setting that says how much faster a run should be; the rest of a cache's config follows.

``recipe(speedup, trials)`` gives the config fields a speed-up sets: the speed-up itself (a forward budget of
``total_steps / speedup`` per run: ``StackCacheConfig.budget_steps``; placed by the calibration's measured trajectory
and the sampler's step weights where the calibration has one, with a sampler that takes Euler steps as the step
profile's plan with the tail it favours, ``budget.tail_plan``, with any other by ``budget.measured_or_tail``; else by
the step profile or the schedule), threshold 0 (the plan alone places the computed steps: a threshold that brings a
planned step forward only cost quality on the benchmark models), the forecast ``FORECAST`` and the skip correction
``SKIP_CORRECTION`` (or the pair the calibration's ``trials`` found better: below), which a sampler that takes Euler
steps applies by its sigma steps and 'uni_pc', 'dpmpp_2m' and 'res_multistep' by their step weights
(``skip_correction``); with any other sampler the run's notes say nothing was corrected.

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

The calibration's trial (``SpeedupTrials``): after its own run, a Calibrate node runs the speed-up at each of
``TRIAL_SPEEDUPS`` with each forecast and skip correction of ``TRIAL_ORDERS`` and ``TRIAL_CORRECTIONS`` (the recipe's
own first) on the same inputs and records how close each came to its own every-step latent (``psnr_db``). A
speed-up then takes the recipe's forecast and correction unless, at the tried speed-up nearest its own, another pair
came ``TRIAL_MARGIN_DB`` or more closer. Which of '1st' and '2nd order' gives the better latent depends on the model,
the sampler and the speed-up, and neither the run's own record ('auto') nor the calibration's sketched trajectory told
them apart on the benchmark models; one sample run with each did. So it did for the correction with the multistep
samplers, which cost up to 2 dB on some models at some speed-ups. Below the margin one prompt's result did not carry
to others (docs/benchmarks.md, "The speed-up's forecast from the calibration's trial").
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .forecast import CANDIDATE_NAMES, ORDERS

FORECAST = 1
SKIP_CORRECTION = 0.5
TRIAL_SPEEDUPS = (2.0, 3.0, 3.75, 5.0, 6.0)  # the speed-ups a calibration tries (the benchmarks' 15 to 5 of 30)
# what it tries at each: forecast TRIAL_ORDERS[j] with skip correction TRIAL_CORRECTIONS[j], the recipe's own first
TRIAL_ORDERS = (FORECAST, 2, FORECAST)
TRIAL_CORRECTIONS = (SKIP_CORRECTION, SKIP_CORRECTION, 0.0)
TRIAL_MARGIN_DB = 1.0  # how much closer another pair must come in the trial for a speed-up to take it


def psnr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    """Peak signal-to-noise ratio of ``got`` against ``want`` in dB (peak: ``want``'s largest magnitude), in float64;
    inf where they are equal."""
    error = torch.mean((got.double() - want.double()) ** 2).item()
    peak = want.double().abs().max().item()
    return math.inf if error == 0 else 10 * math.log10(peak ** 2 / error)


@dataclass(frozen=True)
class SpeedupTrials:
    """A calibration's trial of the speed-up: ``psnr[i][j]``, the PSNR in dB of the run at ``speedups[i]`` with
    forecast ``orders[j]`` and skip correction ``corrections[j]`` against the calibration's own run (every step
    computed), ``steps`` steps each. ``corrections`` left empty: ``SKIP_CORRECTION`` for every forecast (a file from
    before the trial tried the correction). The recipe's own pair (``FORECAST``, ``SKIP_CORRECTION``) is one of them."""

    steps: int
    speedups: tuple[float, ...]
    orders: tuple[int, ...]
    psnr: tuple[tuple[float, ...], ...]
    corrections: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"a speed-up trial's steps is a whole number above 0, got {self.steps!r}")
        if not self.speedups or any(isinstance(s, bool) or not isinstance(s, (int, float)) or not s >= 1
                                    for s in self.speedups):
            raise ValueError("a speed-up trial's speedups are numbers of at least 1")
        if not self.corrections:
            object.__setattr__(self, "corrections", (SKIP_CORRECTION,) * len(self.orders))
        if any(isinstance(o, bool) or o not in ORDERS for o in self.orders) \
                or len(self.corrections) != len(self.orders) \
                or any(isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 <= c <= 1
                       for c in self.corrections) \
                or (FORECAST, SKIP_CORRECTION) not in self.pairs or len(set(self.pairs)) != len(self.pairs):
            raise ValueError(f"a speed-up trial's orders are forecast orders {ORDERS}, each with a skip correction "
                             f"from 0 to 1, no pair twice, the recipe's ({FORECAST}, {SKIP_CORRECTION:g}) among them")
        if len(self.psnr) != len(self.speedups) or any(
                len(row) != len(self.orders)
                or any(isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) for v in row)
                for row in self.psnr):
            raise ValueError("a speed-up trial has one PSNR (a number) per speed-up and forecast")

    @property
    def pairs(self) -> list[tuple[int, float]]:
        """The tried (forecast order, skip correction) pairs, in the order of a ``psnr`` row."""
        return list(zip(self.orders, self.corrections))

    def choice_for(self, speedup: float) -> tuple[int, float, str]:
        """The forecast order and skip correction for a run at ``speedup``, and why, in words: at the tried speed-up
        nearest it (by ratio), the recipe's (``FORECAST``, ``SKIP_CORRECTION``) unless another pair came
        ``TRIAL_MARGIN_DB`` or more closer (the closest such one)."""
        i = min(range(len(self.speedups)), key=lambda k: abs(math.log(self.speedups[k] / speedup)))
        row = dict(zip(self.pairs, self.psnr[i]))
        chosen = own = (FORECAST, SKIP_CORRECTION)
        for pair, value in row.items():
            if value >= row[own] + TRIAL_MARGIN_DB and value > row[chosen]:
                chosen = pair
        tried = ", ".join(f"{pair_words(*pair)} {v:.1f} dB" for pair, v in row.items())
        return (*chosen, f"the calibration's trial at {self.speedups[i]:g}x found: {tried}")

    def to_data(self) -> dict:
        return {"steps": self.steps, "speedups": list(self.speedups), "orders": list(self.orders),
                "corrections": list(self.corrections),
                "psnr_db": [[round(v, 3) if math.isfinite(v) else "inf" for v in row] for row in self.psnr]}

    @classmethod
    def from_data(cls, data) -> "SpeedupTrials":
        """From ``to_data``'s dict (without 'corrections': a file from before the trial tried the correction);
        ValueError for anything else."""
        if not isinstance(data, dict) or not all(isinstance(data.get(k), list) for k in ("speedups", "orders",
                                                                                        "psnr_db")):
            raise ValueError("a speed-up trial is a mapping with 'steps' and 'speedups', 'orders', 'psnr_db' lists")
        rows = data["psnr_db"]
        if not all(isinstance(row, list) for row in rows):
            raise ValueError("a speed-up trial's 'psnr_db' is a list of lists")
        psnr = tuple(tuple(math.inf if v == "inf" else v for v in row) for row in rows)
        corrections = data.get("corrections", [])
        if not isinstance(corrections, list):
            raise ValueError("a speed-up trial's 'corrections' is a list")
        return cls(data.get("steps"), tuple(data["speedups"]), tuple(data["orders"]), psnr, tuple(corrections))


def pair_words(order: int, correction: float) -> str:
    """A tried forecast and skip correction, in the run's notes' words."""
    named = f"'{CANDIDATE_NAMES[order]}'"
    return named if correction == SKIP_CORRECTION else f"{named} with correction {correction:g}"


def recipe(speedup: float, trials: SpeedupTrials | None = None) -> dict[str, Any]:
    """The config fields of a run at ``speedup`` (above 0; the config checks its range), its forecast and skip
    correction from ``trials`` where the calibration has them."""
    order, correction = (FORECAST, SKIP_CORRECTION) if trials is None else trials.choice_for(speedup)[:2]
    return {"speedup": speedup, "threshold": 0.0, "forward_budget": 0, "forecast_order": order,
            "skip_correction": correction}


def describe(speedup: float, trials: SpeedupTrials | None = None) -> str:
    """What a speed-up chose, in words, for the run's notes."""
    order, correction, why = (FORECAST, SKIP_CORRECTION, "") if trials is None else trials.choice_for(speedup)
    return (f"speed-up {speedup:g}x: computes 1 in {speedup:g} steps where the calibration (or the schedule) says "
            f"they matter most for this sampler, forecast '{CANDIDATE_NAMES[order]}' and skip correction "
            f"{correction:g} (euler, uni_pc, dpmpp_2m, res_multistep), "
            + (f"as {why}" if why else "the best overall in the benchmarks")
            + "; speedup 0 gives the threshold and the other inputs back")
