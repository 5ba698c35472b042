"""The speed-up's recipe and the calibration's trial that picks its forecast (``omni_hooks.caching.speedup``)."""
from __future__ import annotations

import math

import pytest
import torch

from omni_hooks.caching.speedup import (FORECAST, SKIP_CORRECTION, TRIAL_MARGIN_DB, TRIAL_ORDERS, TRIAL_SPEEDUPS,
                                        SpeedupTrials, describe, psnr_db, recipe)

#: one row per tried speed-up: '1st order', '2nd order'
ROWS = ((60.0, 60.0 + TRIAL_MARGIN_DB - 0.01), (50.0, 50.0 + TRIAL_MARGIN_DB), (40.0, 39.0), (30.0, 35.0),
        (20.0, math.inf))


def trials(rows=ROWS) -> SpeedupTrials:
    return SpeedupTrials(30, TRIAL_SPEEDUPS, TRIAL_ORDERS, rows)


def test_the_speedup_takes_first_order_unless_the_trial_nearest_it_found_another_a_margin_closer():
    t = trials()
    assert TRIAL_ORDERS[0] == FORECAST == 1
    expected = {1.0: 1, 2.0: 1, 2.4: 1, 2.5: 2, 3.0: 2, 3.5: 1, 4.0: 1, 4.5: 2, 5.0: 2, 6.0: 2, 20.0: 2}
    for speedup, order in expected.items():
        chosen, why = t.order_for(speedup)
        nearest = min(TRIAL_SPEEDUPS, key=lambda s: abs(math.log(s / speedup)))
        assert chosen == order, speedup
        assert why.startswith(f"the calibration's trial at {nearest:g}x: '1st order' "), why


def test_of_several_orders_a_margin_ahead_the_closest_is_taken():
    t = SpeedupTrials(30, (2.0,), (1, 0, 2), ((40.0, 42.0, 41.5),))
    assert t.order_for(2.0)[0] == 0
    assert SpeedupTrials(30, (2.0,), (1, 0, 2), ((40.0, 40.5, 45.0),)).order_for(2.0)[0] == 2


def test_the_recipe_and_its_words_name_the_trials_choice():
    assert recipe(5.0) == {"speedup": 5.0, "threshold": 0.0, "forward_budget": 0, "forecast_order": FORECAST,
                           "skip_correction": SKIP_CORRECTION}
    assert recipe(5.0, trials())["forecast_order"] == 2 and recipe(3.75, trials())["forecast_order"] == 1
    assert "forecast '1st order' and skip correction" in describe(5.0)
    words = describe(5.0, trials())
    assert "forecast '2nd order' (the calibration's trial at 5x: '1st order' 30.0 dB, '2nd order' 35.0 dB)" in words


def test_a_trial_round_trips_through_its_file_form_and_a_malformed_one_is_refused():
    t = trials()
    data = t.to_data()
    assert data["psnr_db"][-1] == [20.0, "inf"]  # JSON has no infinity: equal latents are written as "inf"
    assert SpeedupTrials.from_data(data) == t
    bad = [None, {}, {**data, "steps": 0}, {**data, "steps": True}, {**data, "speedups": [2.0, 0.5, 3, 4, 5]},
           {**data, "orders": [2, 0]}, {**data, "orders": [1, 3]}, {**data, "psnr_db": data["psnr_db"][:-1]},
           {**data, "psnr_db": [[1.0]] * 5}, {**data, "psnr_db": [["x", 1.0]] * 5},
           {**data, "psnr_db": [[math.nan, 1.0]] * 5}, {**data, "psnr_db": [1.0] * 5}]
    for wrong in bad:
        with pytest.raises(ValueError):
            SpeedupTrials.from_data(wrong)


def test_psnr_is_against_the_wanted_tensors_peak():
    want = torch.tensor([[1.0, -4.0], [2.0, 0.0]])
    got = want + torch.tensor([[0.0, 0.0], [0.0, 0.4]])
    assert psnr_db(got, want) == pytest.approx(10 * math.log10(16 / (0.16 / 4)))
    assert psnr_db(want.clone(), want) == math.inf
