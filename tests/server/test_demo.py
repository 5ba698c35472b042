"""`./run demo` (tools/demo.py) end to end, shortened to 8 steps: it runs a fresh Apply TeaCache (its speed-up, read
from the server), reports what the cache did and what the speed-up chose, and every file it names still exists after
it ends (the server's own folder does not); `--threshold` runs the published-threshold path instead."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from omnitest.comfy_path import PACK_ROOT

pytestmark = pytest.mark.server


def demo(*args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "tools.demo", "--steps", "8", *args], cwd=PACK_ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_the_demo_runs_a_fresh_node_and_every_path_it_prints_exists_afterwards():
    out = demo()
    assert "Apply TeaCache (speedup 2)" in out, out
    assert re.search(r"TeaCache: reused [1-9]\d* of 8 model evaluations", out), out
    assert "note: speed-up 2x" in out, out
    assert "as the calibration's trial at 2x found: '1st order' " in out, out  # the calibration tried the speed-up
    paths = re.findall(r"(/[\w./-]+\.log)", out)
    assert paths, out
    for path in paths:
        assert Path(path).is_file(), f"the demo printed {path}, which is gone after it ended"
    assert "ComfyUI stopped" in out


def test_the_demo_runs_the_threshold_path_when_given_a_threshold():
    out = demo("--threshold", "0.1")
    assert "Apply TeaCache (rel_l1_thresh 0.1)" in out, out
    assert re.search(r"TeaCache: reused \d+ of 8 model evaluations", out), out
    assert "note: speed-up" not in out, out
