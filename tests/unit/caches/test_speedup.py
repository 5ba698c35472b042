"""The speed-up's recipe and the calibration's trial that picks its forecast (``omni_hooks.caching.speedup``)."""
from __future__ import annotations

import math

import pytest
import torch

from omni_hooks.caching.speedup import (FORECAST, SKIP_CORRECTION, TRIAL_CORRECTIONS, TRIAL_MARGIN_DB, TRIAL_ORDERS,
                                        TRIAL_SPEEDUPS, SpeedupTrials, describe, psnr_db, recipe)

M = TRIAL_MARGIN_DB
#: one row per tried speed-up: '1st order', '2nd order', '1st order' without the correction
ROWS = ((60.0, 60.0 + M - 0.01, 60.0 + M - 0.01), (50.0, 50.0 + M, 50.0), (40.0, 39.0, 40.0 + M - 0.01),
        (30.0, 35.0, 30.0 + M), (20.0, math.inf, 20.0))


def trials(rows=ROWS) -> SpeedupTrials:
    return SpeedupTrials(30, TRIAL_SPEEDUPS, TRIAL_ORDERS, rows, TRIAL_CORRECTIONS)


def test_the_trial_tries_the_recipes_own_pair_first_then_second_order_and_no_correction():
    assert list(zip(TRIAL_ORDERS, TRIAL_CORRECTIONS)) == [(FORECAST, SKIP_CORRECTION), (2, SKIP_CORRECTION),
                                                           (FORECAST, 0.0)]
    assert FORECAST == 1


def test_the_speedup_takes_the_recipe_unless_the_trial_nearest_it_found_another_pair_a_margin_closer():
    t = trials()
    expected = {1.0: (1, 0.5), 2.0: (1, 0.5), 2.4: (1, 0.5), 2.5: (2, 0.5), 3.0: (2, 0.5), 3.5: (1, 0.5),
                4.0: (1, 0.5), 4.5: (2, 0.5), 5.0: (2, 0.5), 6.0: (2, 0.5), 20.0: (2, 0.5)}
    for speedup, pair in expected.items():
        order, correction, why = t.choice_for(speedup)
        nearest = min(TRIAL_SPEEDUPS, key=lambda s: abs(math.log(s / speedup)))
        assert (order, correction) == pair, speedup
        assert why.startswith(f"the calibration's trial at {nearest:g}x found: '1st order' "), why
        assert "'1st order' with correction 0 " in why, why


def test_of_several_pairs_a_margin_ahead_the_closest_is_taken_and_the_correction_may_be_dropped():
    t = SpeedupTrials(30, (2.0,), (1, 0, 2), ((40.0, 42.0, 41.5),))
    assert t.choice_for(2.0)[:2] == (0, SKIP_CORRECTION)
    assert SpeedupTrials(30, (2.0,), (1, 0, 2), ((40.0, 40.5, 45.0),)).choice_for(2.0)[:2] == (2, SKIP_CORRECTION)
    assert trials(((60.0, 61.0, 61.5),) * 5).choice_for(2.0)[:2] == (1, 0.0)
    assert trials(((60.0, 61.5, 61.5),) * 5).choice_for(2.0)[:2] == (2, 0.5)  # a tie keeps the one tried first


def test_the_recipe_and_its_words_name_the_trials_choice():
    assert recipe(5.0) == {"speedup": 5.0, "threshold": 0.0, "forward_budget": 0, "forecast_order": FORECAST,
                           "skip_correction": SKIP_CORRECTION}
    assert recipe(5.0, trials())["forecast_order"] == 2 and recipe(3.75, trials())["forecast_order"] == 1
    dropped = trials(((60.0, 59.0, 62.0),) * 5)
    assert recipe(2.0, dropped) == {**recipe(2.0), "skip_correction": 0.0}
    assert "forecast '1st order' and skip correction 0.5 (" in describe(5.0)
    assert "the best overall in the benchmarks" in describe(5.0)
    words = describe(5.0, trials())
    assert ("forecast '2nd order' and skip correction 0.5 (euler, uni_pc, dpmpp_2m, res_multistep), as the "
            "calibration's trial at 5x found: '1st order' 30.0 dB, '2nd order' 35.0 dB, '1st order' with correction "
            "0 31.0 dB;") in words, words
    assert "forecast '1st order' and skip correction 0 (" in describe(2.0, dropped)


def test_a_trial_round_trips_through_its_file_form_and_a_malformed_one_is_refused():
    t = trials()
    data = t.to_data()
    assert data["psnr_db"][-1] == [20.0, "inf", 20.0]  # JSON has no infinity: equal latents are written as "inf"
    assert data["corrections"] == list(TRIAL_CORRECTIONS)
    assert SpeedupTrials.from_data(data) == t
    row = [1.0, 1.0, 1.0]
    bad = [None, {}, {**data, "steps": 0}, {**data, "steps": True}, {**data, "speedups": [2.0, 0.5, 3, 4, 5]},
           {**data, "orders": [2, 0, 1], "corrections": [0.5, 0.5, 0.0]}, {**data, "orders": [1, 3, 1]},
           {**data, "orders": [1, True, 1]}, {**data, "corrections": [0.5, 0.5]}, {**data, "corrections": 0.5},
           {**data, "corrections": [0.5, 0.5, 1.5]}, {**data, "corrections": [0.5, "x", 0.0]},
           {**data, "corrections": [0.0, 0.5, 0.0], "orders": [1, 2, 2]}, {**data, "corrections": [0.5, 0.5, 0.5],
                                                                            "orders": [1, 2, 1]},
           {**data, "psnr_db": data["psnr_db"][:-1]}, {**data, "psnr_db": [[1.0]] * 5},
           {**data, "psnr_db": [["x", 1.0, 1.0]] * 5}, {**data, "psnr_db": [[math.nan, 1.0, 1.0]] * 5},
           {**data, "psnr_db": row * 5}]
    for wrong in bad:
        with pytest.raises(ValueError):
            SpeedupTrials.from_data(wrong)


def test_a_file_from_before_the_trial_tried_the_correction_reads_as_forecasts_with_the_correction():
    """The last release's trial: 'orders' [1, 2] and no 'corrections'. Its choices are what they were."""
    old = {"steps": 30, "speedups": list(TRIAL_SPEEDUPS), "orders": [1, 2],
           "psnr_db": [[60.0, 60.5], [50.0, 51.0], [40.0, 39.0], [30.0, 35.0], [20.0, "inf"]]}
    t = SpeedupTrials.from_data(old)
    assert t.corrections == (SKIP_CORRECTION, SKIP_CORRECTION)
    assert [t.choice_for(s)[:2] for s in TRIAL_SPEEDUPS] == [(1, 0.5), (2, 0.5), (1, 0.5), (2, 0.5), (2, 0.5)]
    assert "with correction" not in t.choice_for(2.0)[2]


def test_psnr_is_against_the_wanted_tensors_peak():
    want = torch.tensor([[1.0, -4.0], [2.0, 0.0]])
    got = want + torch.tensor([[0.0, 0.0], [0.0, 0.4]])
    assert psnr_db(got, want) == pytest.approx(10 * math.log10(16 / (0.16 / 4)))
    assert psnr_db(want.clone(), want) == math.inf
