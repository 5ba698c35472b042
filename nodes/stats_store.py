"""Where finished and running cache runs are kept and announced: the log line, and a bounded history of runs."""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

log = logging.getLogger("OmniHooks")

HISTORY_LIMIT = 50
_lock = threading.Lock()
_history: "collections.OrderedDict[str, dict[str, Any]]" = collections.OrderedDict()
_counter = 0


def _run_id(session) -> str:
    return getattr(session, "run_id", "")


def run_started(session) -> None:
    global _counter
    with _lock:
        _counter += 1
        session.run_id = f"run-{_counter}"
        session.started_at = time.time()


def step_finished(session, record) -> None:
    """Called after every model call of a run (hot path: nothing here may sync a device)."""


def run_finished(session) -> None:
    stats = session.stats
    if stats.evaluations:
        log.info("OmniHooks %s", stats.log_line())
    entry = {"run_id": _run_id(session), "node_id": session.cache.node_id, "kind": stats.kind,
             "started_at": getattr(session, "started_at", None), "finished_at": time.time(), **stats.to_dict()}
    with _lock:
        _history[entry["run_id"]] = entry
        while len(_history) > HISTORY_LIMIT:
            _history.popitem(last=False)


def recent_runs(limit: int = 10) -> list[dict[str, Any]]:
    with _lock:
        return list(_history.values())[-limit:][::-1]
