"""`./run demo` (tools/demo.py) end to end, shortened to 8 steps: it runs, reports what the cache did, and every file
it names still exists after it ends (the server's own folder does not)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from omnitest.comfy_path import PACK_ROOT

pytestmark = pytest.mark.server


def test_the_demo_runs_and_every_path_it_prints_exists_afterwards():
    result = subprocess.run([sys.executable, "-m", "tools.demo", "--steps", "8"], cwd=PACK_ROOT, capture_output=True,
                            text=True, timeout=600)
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert re.search(r"TeaCache: reused \d+ of 8 model evaluations", out), out
    paths = re.findall(r"(/[\w./-]+\.log)", out)
    assert paths, out
    for path in paths:
        assert Path(path).is_file(), f"the demo printed {path}, which is gone after it ended"
    assert "ComfyUI stopped" in out
