"""The forecast error benchmark (``benchmarks/bench_forecast_errors.py``) on this ComfyUI, on the small trained model
at 8 steps: it observes every skipped step of both branches, forcing an order changes the run, forcing the order the
cache uses changes nothing, the per-step closest order has the smallest summed squares, and the calibration's user
directory is removed when it ends."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from omnitest.comfy_path import PACK_ROOT, comfyui_path

pytestmark = pytest.mark.host

STEPS, PROMPTS, BRANCHES = 8, 4, 2  # cond and uncond at cfg 3


def test_the_benchmark_observes_every_skip_and_forcing_the_caches_own_order_changes_nothing(tmp_path):
    out = tmp_path / "errors.json"
    command = [sys.executable, "bench_forecast_errors.py", "--model", "small", "--steps", str(STEPS), "--cache", "tea",
               "--threshold", "0.2", "--forecast", "1st order", "--json", str(out)]
    scratch = tmp_path / "tmp"  # the calibration's user directory goes here, and is gone when the benchmark ends
    scratch.mkdir()
    env = {**os.environ, "COMFYUI_PATH": str(comfyui_path()), "TMPDIR": str(scratch)}
    done = subprocess.run(command, cwd=PACK_ROOT / "benchmarks", env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not list(scratch.glob("omnihooks-quality-*"))
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert list(rows) == ["reuse", "1st order", "2nd order", "Taylor", "Chebyshev fit", "the cache's choice",
                          "closest to the reference"]
    skipped_steps = STEPS - result["evaluations"]
    assert skipped_steps > 0
    assert result["skipped_branch_steps"] == round(BRANCHES * PROMPTS * skipped_steps)
    own, first, reuse = rows["the cache's choice"], rows["1st order"], rows["reuse"]
    assert own == first  # forcing the order the cache chose anyway: the same errors, the same latent
    assert reuse["psnr_mean"] != first["psnr_mean"] and reuse["summed"] != first["summed"]
    closest = rows["closest to the reference"]["root_of_squares"]
    assert all(closest <= row["root_of_squares"] + 1e-12 for row in rows.values())
