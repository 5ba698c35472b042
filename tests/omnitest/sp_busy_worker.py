"""A Sequence Parallel worker for tests: the pack's own ``worker.py``, whose rank takes ``OMNIHOOKS_TEST_BUSY_S``
seconds to check a "call" command while the file ``OMNIHOOKS_TEST_BUSY_FLAG`` names exists (it removes the file
first): a worker alive and busy, as one that builds a large model. Run it as ``worker.py`` is run (same arguments);
rank 0 starts it in place of ``worker.py`` when a test points ``group.WORKER_SCRIPT`` here."""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import time
from pathlib import Path

WORKER = Path(__file__).resolve().parents[2] / "nodes" / "sequence_parallel" / "worker.py"
BUSY_S = "OMNIHOOKS_TEST_BUSY_S"
BUSY_FLAG = "OMNIHOOKS_TEST_BUSY_FLAG"


def _load_worker():
    spec = importlib.util.spec_from_file_location("omnihooks_sp_busy_worker_script", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    worker = _load_worker()
    load_pack = worker._load_pack

    def load_pack_with_a_busy_rank():
        pack = load_pack()
        rank = importlib.import_module(f"{pack.__name__}.nodes.sequence_parallel.rank")
        prepare = rank.WorkerRank.prepare

        def busy_prepare(self, command):
            flag = os.environ.get(BUSY_FLAG)
            if command.op == "call" and flag and os.path.exists(flag):
                os.remove(flag)
                time.sleep(float(os.environ[BUSY_S]))
            prepare(self, command)

        rank.WorkerRank.prepare = busy_prepare
        return pack

    worker._load_pack = load_pack_with_a_busy_rank
    return worker.main()


if __name__ == "__main__":
    sys.exit(main())
