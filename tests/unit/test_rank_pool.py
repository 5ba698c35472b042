"""The test rank pool leaves nothing behind, also when the process that owns it is killed before it can close it."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil

TESTS = Path(__file__).resolve().parents[1]
OWNER = """
import os, sys
sys.path.insert(0, {tests!r})
from omnitest.rank_pool import RankPool
pool = RankPool(2)
from omnitest.processes import free_port
pool.run(free_port)  # started: both ranks answered
print(" ".join(str(c.pid) for c in __import__("psutil").Process().children(recursive=True)), flush=True)
os._exit(9)  # killed, as by a deadline or a signal: no fixture closes the pool
"""


def test_the_ranks_end_when_the_pools_process_is_killed():
    owner = subprocess.run([sys.executable, "-c", OWNER.format(tests=str(TESTS))], capture_output=True, text=True,
                           timeout=120)
    pids = [int(p) for p in owner.stdout.split()]
    assert owner.returncode == 9 and len(pids) >= 2, owner.stderr
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                                              for p in pids):
        time.sleep(0.2)
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    for p in alive:
        psutil.Process(p).kill()
    assert not alive
