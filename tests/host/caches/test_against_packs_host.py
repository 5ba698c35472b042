"""The goal against the forecasting packs, on this ComfyUI: on each of the quality benchmark's four trained models
(``benchmarks/cache_quality_model.py``), at 8, 10 and 12 of 30 forwards, this pack's best setting whose worst prompt
is within 2 dB of its mean (chosen from the committed sweeps: ``docs/cache_quality*.json`` and
``docs/skip_correction/``) is run again here, and beats the best point of the three forecasting packs (their
committed sweeps, ``docs/forecasting_packs*.json``: the packs are not part of the repository) by at least 3 dB in the
mean, within the forward count, with its worst prompt still within 2 dB of its mean."""
from __future__ import annotations

import json

import pytest

from omnitest.comfy_path import PACK_ROOT
from omnitest.quality import benchmark_module, benchmark_modules, psnr_db

pytestmark = pytest.mark.host

MARGIN_DB = 3.0
FORWARDS = (8, 10, 12)
STEPS = 30


def setting_model(bench, case, row: dict):
    """The MODEL of one row of the quality benchmark's sweep, as the benchmark made it."""
    name = row["configuration"]
    apply = bench.mag if name.startswith("MagCache") else bench.tea
    forecast = name.rsplit("forecast ", 1)[1]
    return apply(case, row["threshold"], forecast, row["budget"], row.get("skip_correction", 0.0))


@pytest.mark.parametrize("name", ["small", "wide", "deep", "long"])
def test_the_consistent_setting_beats_the_best_pack_by_3_db(name, own_user_directory):
    bench, models = benchmark_modules()
    packs = benchmark_module("bench_forecasting_packs")
    docs = PACK_ROOT / "docs"
    ours_file = packs.result_name("cache_quality", name, STEPS) + ".json"
    ours = [r for folder in (docs, docs / "skip_correction") for r in json.loads((folder / ours_file).read_text())
            if "EasyCache" not in r["configuration"]]
    theirs = json.loads((docs / (packs.result_name("forecasting_packs", name, STEPS) + ".json")).read_text())
    spec = models.MODELS[name]
    case, counter = bench.calibrated_case(spec, STEPS)
    reference, _ = bench.sample_all(spec, case, None, counter, STEPS)
    for forwards in FORWARDS:
        row = packs.best(ours, forwards, consistent=True)
        pack = packs.best(theirs, forwards)
        assert row is not None and pack is not None, forwards
        outs, evaluations = bench.sample_all(spec, case, setting_model(bench, case, row), counter, STEPS)
        psnrs = [psnr_db(o, r) for o, r in zip(outs, reference)]
        mean = sum(psnrs) / len(psnrs)
        what = f"{name}, at most {forwards}: {row['configuration']} {row['threshold']:g} (budget {row['budget']})"
        assert sum(evaluations) / len(evaluations) <= forwards, what
        assert mean >= packs.psnr(pack["psnr_mean"]) + MARGIN_DB, f"{what}: {mean:.2f} dB, {pack['configuration']} " \
            f"{pack['psnr_mean']:.2f}"
        assert min(psnrs) >= mean - packs.WORST_GAP_DB, f"{what}: worst prompt {min(psnrs):.2f}, mean {mean:.2f}"
