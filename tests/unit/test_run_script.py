"""`./run tests` runs the web panel's logic tests with Node, then pytest, on every Node LTS: Node 22 and newer read
`node --test <folder>` as a file pattern and failed before pytest ever ran.

Runs with the `node` on PATH, and with each Node found in the folders of OMNIHOOKS_TEST_NODE_DIRS (colon-separated
bin folders, e.g. after `npm install --prefix /tmp/node22 node@22`: /tmp/node22/node_modules/.bin).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools.comfy_host import find_host

ROOT = Path(__file__).resolve().parents[2]


def node_dirs() -> list[str]:
    dirs = [d for d in os.environ.get("OMNIHOOKS_TEST_NODE_DIRS", "").split(":") if d]
    system = shutil.which("node")
    if system:
        dirs.insert(0, str(Path(system).parent))
    return [d for d in dict.fromkeys(dirs) if (Path(d) / "node").exists()]


def fake_venv(tmp_path: Path) -> Path:
    """A venv folder whose python is this interpreter and that counts as installed (so ./run installs nothing)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    (venv / ".installed").touch()
    os.utime(venv / ".installed", (4_000_000_000, 4_000_000_000))  # newer than requirements-test.txt
    return venv


def host_env() -> dict[str, str]:
    """COMFYUI_PATH at the host this run found, so that ./run (in a copy too) finds it and fetches nothing."""
    root = find_host()
    return {"COMFYUI_PATH": str(root)} if root is not None else {}


@pytest.mark.parametrize("node_dir", node_dirs() or [pytest.param(None, marks=pytest.mark.skip("no node on PATH"))])
def test_run_tests_runs_the_web_tests_and_then_pytest(tmp_path, node_dir):
    version = subprocess.run([str(Path(node_dir) / "node"), "--version"], capture_output=True, text=True).stdout
    env = {**os.environ, **host_env(), "OMNIHOOKS_VENV": str(fake_venv(tmp_path)),
           "PATH": f"{node_dir}:{os.environ['PATH']}"}
    result = subprocess.run([str(ROOT / "run"), "tests", "-q", "-p", "no:cacheprovider",
                             "tests/unit/test_stats_json.py"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, f"node {version}: {out[-3000:]}"
    web_passed = re.search(r"^# pass (\d+)$", out, re.M)
    assert web_passed and int(web_passed.group(1)) > 0 and re.search(r"^# fail 0$", out, re.M), out[-3000:]
    assert re.search(r"\d+ passed", out), out[-3000:]


def test_a_failing_web_test_fails_the_run_after_pytest_ran(tmp_path):
    if not node_dirs():
        pytest.skip("no node on PATH")
    copy = tmp_path / "repo"
    shutil.copytree(ROOT, copy,
                    ignore=shutil.ignore_patterns(".venv", ".git", ".hosts", "test-artifacts", "__pycache__"))
    (copy / "tests" / "web" / "zz_fails.test.mjs").write_text(
        'import { test } from "node:test";\nimport assert from "node:assert";\n'
        'test("fails on purpose", () => assert.equal(1, 2));\n')
    env = {**os.environ, **host_env(), "OMNIHOOKS_VENV": str(fake_venv(tmp_path))}
    result = subprocess.run([str(copy / "run"), "tests", "-q", "-p", "no:cacheprovider",
                             "tests/unit/test_stats_json.py"],
                            cwd=copy, env=env, capture_output=True, text=True, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode != 0 and re.search(r"\d+ passed", out), out[-3000:]
    assert "web panel logic tests FAILED" in out, out[-3000:]
