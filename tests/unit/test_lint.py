"""The code keeps the style the team agreed on: ``ruff check`` (its rules in pyproject.toml, [tool.ruff]) passes on
the whole repository. ruff comes with the test requirements (requirements-test.txt)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_check_passes():
    assert importlib.util.find_spec("ruff") is not None, (
        f"ruff is not installed in {sys.prefix}: pip install -r requirements-test.txt (./run tests does)")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
