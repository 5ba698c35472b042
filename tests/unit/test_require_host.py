"""``OMNIHOOKS_REQUIRE_HOST=1`` (what .ci/run sets): a host test that skips for lack of a host fails the run; without
it the same test skips in one line."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_host_tests(**env: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/host/test_host_marks.py"]
    return subprocess.run(command, cwd=ROOT, env={**os.environ, "COMFYUI_PATH": str(ROOT / "no-comfyui-here"), **env},
                          capture_output=True, text=True, timeout=120)


def test_without_a_host_host_tests_skip_in_one_line():
    result = run_host_tests(OMNIHOOKS_REQUIRE_HOST="0")
    assert result.returncode == 0, result.stdout[-2000:]
    assert result.stdout.count("SKIPPED 3 test(s): no ComfyUI checkout at COMFYUI_PATH=") == 1, result.stdout[-2000:]


def test_under_require_host_a_skipped_host_test_fails():
    result = run_host_tests(OMNIHOOKS_REQUIRE_HOST="1")
    assert result.returncode != 0, result.stdout[-2000:]
    expected = "host test skipped under OMNIHOOKS_REQUIRE_HOST=1: no ComfyUI checkout"
    assert expected in result.stdout, result.stdout[-2000:]
