"""Cache statistics out of a run: a log line, websocket events to the client that queued the prompt, and a bounded
history of runs served over HTTP.

Events (``PromptServer.send_sync``, to the prompt's client only):
  * ``omni_hooks.step``: after every model evaluation; ``{run_id, prompt_id, node_id, sampler_node_id, kind, model,
    step, total_steps, computed, seconds, branches: [{branch, computed, reason, metric, threshold}]}``
  * ``omni_hooks.run``: when a run ends (also after an error or interrupt); the history entry below.
Routes (registered at import, so also under ``/api``):
  * ``GET /omni_hooks/runs?prompt_id=<id>&limit=<n>``: ``{"runs": [entry, ...]}``, newest first;
  * ``GET /omni_hooks/runs/{run_id}``: one entry, 404 if unknown.
An entry: ``{run_id, prompt_id, node_id, sampler_node_id, kind, model, status, started_at, finished_at, summary,
evaluations}`` (``summary`` as ``CacheRunStats.summary()``).

Publishing never breaks a run: no server, no client or a failing send is logged once and ignored. Nothing here
touches a tensor, so the hot path gains no device sync.
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from dataclasses import asdict
from typing import Any

log = logging.getLogger("OmniHooks")

HISTORY_LIMIT = 100
STEP_EVENT = "omni_hooks.step"
RUN_EVENT = "omni_hooks.run"

_lock = threading.Lock()
_history: "collections.OrderedDict[str, dict[str, Any]]" = collections.OrderedDict()
_run_numbers = itertools.count(1)
_send_failed = False


def _server():
    try:
        from server import PromptServer
    except Exception:  # not inside a ComfyUI server (tests, scripts)
        return None
    return getattr(PromptServer, "instance", None)


def _send(event: str, data: dict[str, Any]) -> None:
    global _send_failed
    server = _server()
    if server is None:
        return
    try:
        server.send_sync(event, data, getattr(server, "client_id", None))
    except Exception as e:  # a publishing problem must never fail sampling
        if not _send_failed:
            log.warning("OmniHooks: could not publish cache statistics (%s); continuing without", e)
            _send_failed = True


def _executing() -> tuple[str | None, str | None]:
    try:
        from comfy_execution.utils import get_executing_context
    except Exception:
        return None, None
    context = get_executing_context()
    return (context.prompt_id, context.node_id) if context is not None else (None, None)


def _header(session) -> dict[str, Any]:
    return {"run_id": session.run_id, "prompt_id": session.prompt_id, "node_id": session.feature.node_id,
            "sampler_node_id": session.sampler_node_id, "kind": session.stats.kind, "model": session.stats.model}


def run_started(session) -> None:
    session.run_id = f"run-{next(_run_numbers)}"
    session.prompt_id, session.sampler_node_id = _executing()
    session.started_at = time.time()


def step_finished(session, record) -> None:
    """After every model evaluation (hot path): one small message, no tensor access."""
    _send(STEP_EVENT, {**_header(session), "step": record.step, "total_steps": record.total_steps,
                       "computed": record.computed, "seconds": record.seconds,
                       "branches": [asdict(b) for b in record.branches]})


def run_finished(session, status: str = "success") -> dict[str, Any]:
    stats = session.stats
    if stats.evaluations:
        log.info("OmniHooks %s", stats.log_line())
    entry = {**_header(session), "status": status, "started_at": getattr(session, "started_at", None),
             "finished_at": time.time(), **stats.to_dict()}
    with _lock:
        _history[entry["run_id"]] = entry
        while len(_history) > HISTORY_LIMIT:
            _history.popitem(last=False)
    _send(RUN_EVENT, entry)
    return entry


def recent_runs(limit: int = 10, prompt_id: str | None = None) -> list[dict[str, Any]]:
    """Newest first; only those of ``prompt_id`` if given."""
    with _lock:
        entries = [e for e in reversed(_history.values()) if prompt_id is None or e["prompt_id"] == prompt_id]
    return entries[:max(limit, 0)]


def get_run(run_id: str) -> dict[str, Any] | None:
    with _lock:
        return _history.get(run_id)


def register_routes() -> None:
    """Add the HTTP routes to ComfyUI's server (call at import time, before the server adds its routes)."""
    server = _server()
    if server is None:
        return
    from aiohttp import web

    routes = server.routes

    @routes.get("/omni_hooks/runs")
    async def list_runs(request: web.Request) -> web.Response:
        try:
            limit = min(int(request.query.get("limit", "20")), HISTORY_LIMIT)
        except ValueError:
            return web.json_response({"error": "limit must be an integer"}, status=400)
        return web.json_response({"runs": recent_runs(limit, request.query.get("prompt_id"))})

    @routes.get("/omni_hooks/runs/{run_id}")
    async def one_run(request: web.Request) -> web.Response:
        entry = get_run(request.match_info["run_id"])
        if entry is None:
            return web.json_response({"error": "unknown run id"}, status=404)
        return web.json_response(entry)
