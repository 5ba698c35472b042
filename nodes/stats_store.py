"""Run statistics: a log line, websocket events to the client that queued the prompt, and a bounded history of runs
served over HTTP. Every sampling run with any of this pack's features has one entry; each feature contributes its own
part (a ``FeatureReport``) when the run ends (``nodes.features.SamplingRun``).

Events (``PromptServer.send_sync``, to the prompt's client only):
  * ``omni_hooks.step``: after every model evaluation of a cache; ``{run_id, prompt_id, node_id, node_title,
    workflow_id, sampler_node_id, kind, model, threshold, started_at, step, total_steps, computed, seconds, branches:
    [{branch, computed, reason, metric, threshold, candidate}]}`` (at most ``STEP_BRANCHES_LIMIT`` branches,
    ``branches_omitted`` counts the rest);
  * ``omni_hooks.run``: when a run ends (also after an error or interrupt); the history entry below.
Routes (registered at import, so also under ``/api``):
  * ``GET /omni_hooks/runs?prompt_id=<id>&limit=<n>&detail=<0|1>``: ``{"runs": [entry, ...]}``, newest first;
    ``detail=0`` leaves out ``evaluations`` and ``timeline`` (what a list of runs needs);
  * ``GET /omni_hooks/runs/{run_id}``: one entry, 404 if unknown.
An entry: ``{run_id, prompt_id, node_id, node_title, workflow_id, sampler_node_id, kind, model, threshold, status,
started_at, finished_at, summary, detail, evaluations, timeline}``, plus ``features`` (``[{kind, node_id, node_title,
summary, headline}]``: one card per feature that reports one, e.g. CPU Offload, Sequence Parallel) and the features'
top-level fields (``world_size``). The run's node (``node_id``, ``kind``) is its cache's, else its sequence-parallel
or offload node's. With a cache, ``model`` and ``threshold`` are the cache's, ``summary`` is
``CacheRunStats.summary()`` (over every evaluation) and ``detail`` says what the per-evaluation part holds:
``"evaluations"`` (every record, ``timeline`` None), ``"timeline"`` (a run too long to keep each record:
``evaluations`` is empty and ``timeline`` is ``CacheRunStats.timeline()``) or ``"summary"`` (neither fits: both
empty). Without a cache, ``summary`` is None, ``evaluations`` empty and ``threshold`` None: the cards say what ran.
``node_title`` is the node's title in the prompt (``_meta.title``) and ``workflow_id`` the id of the UI workflow it
was queued from, when the client sent them.

Everything sent or served is valid JSON (``omni_hooks.caching.stats.json_safe``: non-finite numbers become "NaN",
"Infinity", "-Infinity"). Sizes are bounded: an entry is at most ``ENTRY_BYTES_LIMIT`` of JSON (so is the run event),
the history at most ``HISTORY_LIMIT`` entries and ``HISTORY_BYTES_LIMIT`` bytes (oldest dropped first).

Publishing never breaks a run: no server, no client or a failing send is logged once and ignored. Nothing here
touches a tensor, so the hot path gains no device sync.
"""
from __future__ import annotations

import collections
import itertools
import json
import logging
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

from ..omni_hooks.caching.stats import CacheRunStats, json_safe

log = logging.getLogger("OmniHooks")

HISTORY_LIMIT = 100
HISTORY_BYTES_LIMIT = 8 * 1024 * 1024
DETAIL_BYTES_LIMIT = 256 * 1024   # every evaluation is kept while they take at most this much JSON (~1000 with CFG)
ENTRY_BYTES_LIMIT = 384 * 1024
TIMELINE_BINS = 240
STEP_BRANCHES_LIMIT = 32
STEP_EVENT = "omni_hooks.step"
RUN_EVENT = "omni_hooks.run"

_lock = threading.Lock()
_history: "collections.OrderedDict[str, dict[str, Any]]" = collections.OrderedDict()
_sizes: dict[str, int] = {}  # run_id -> JSON bytes of its entry
_run_numbers = itertools.count(1)
_send_failed = False


def json_bytes(value: Any) -> int:
    """Size of ``value`` as strict JSON (raises ``ValueError`` on a non-finite number: pass ``json_safe`` data)."""
    return len(json.dumps(value, allow_nan=False, separators=(",", ":")).encode())


def dumps(value: Any) -> str:
    """Strict JSON of ``value`` for responses: non-finite numbers become text first, never ``Infinity``."""
    return json.dumps(json_safe(value), allow_nan=False)


def _server():
    """ComfyUI's running ``PromptServer``, or None outside a server (tests, scripts, a sequence-parallel worker).

    Looked up where ComfyUI's ``main.py`` imported it, never imported here: outside a server the import fails, and a
    failed import is attempted (compiled) again on every call, milliseconds per run."""
    module = sys.modules.get("server")
    prompt_server = getattr(module, "PromptServer", None)
    return getattr(prompt_server, "instance", None)


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


def _prompt_context(prompt_id: str | None, node_id: str | None) -> tuple[str | None, str | None]:
    """(the node's title in the prompt, the id of the UI workflow it came from) of a running prompt, if known."""
    if prompt_id is None:  # not a prompt's run (a script, a sequence-parallel worker rank): no server to ask
        return None, None
    queue = getattr(_server(), "prompt_queue", None)
    if queue is None:
        return None, None
    try:
        running, _ = queue.get_current_queue_volatile()
    except Exception:
        return None, None
    for item in running:  # (number, prompt_id, prompt, extra_data, outputs, ...)
        if len(item) > 3 and item[1] == prompt_id:
            prompt, extra = item[2] if isinstance(item[2], dict) else {}, item[3] if isinstance(item[3], dict) else {}
            meta = (prompt.get(str(node_id)) or {}).get("_meta") or {}
            workflow = (extra.get("extra_pnginfo") or {}).get("workflow") or {}
            title = meta.get("title") if isinstance(meta, dict) else None
            workflow_id = workflow.get("id") if isinstance(workflow, dict) else None
            return (title if isinstance(title, str) else None,
                    workflow_id if isinstance(workflow_id, str) else None)
    return None, None


@dataclass(frozen=True)
class RunHeader:
    """Which run this is: the fields its events and its entry start with. The run's node is its cache's, else that
    of the feature the run lifecycle names (``SamplingRun.open``)."""

    run_id: str
    prompt_id: str | None
    node_id: str | None
    node_title: str | None     # the node's title in the prompt, else the node's own title
    workflow_id: str | None
    sampler_node_id: str | None
    kind: str                  # the node's feature kind ("teacache", "offload", ...)
    started_at: float

    @cached_property
    def fields(self) -> dict[str, Any]:
        """Its fields as a dict, made once: every step's event starts with them (do not mutate)."""
        return asdict(self)


@dataclass
class FeatureReport:
    """What one feature contributes to its run's entry (``FeatureSession.report``, when the run has ended)."""

    kind: str
    node_id: str | None
    node_title: str
    card: dict[str, Any] | None = None     # its summary: one item of the entry's ``features`` (a card in the panel)
    headline: str | None = None            # what it did in a few words (the panel's list of runs)
    fields: dict[str, Any] = field(default_factory=dict)  # top-level fields of the entry, e.g. ``world_size``
    stats: CacheRunStats | None = None     # a cache's statistics: the entry's model, threshold, summary, evaluations

    @classmethod
    def of(cls, feature, **parts: Any) -> "FeatureReport":
        """The report of ``feature`` (an ``AppliedFeature``) with ``parts``."""
        return cls(kind=feature.kind, node_id=feature.node_id, node_title=feature.node_title, **parts)

    def feature_entry(self) -> dict[str, Any]:
        """Its item of the entry's ``features``: ``{kind, node_id, node_title, summary[, headline]}``."""
        item = {"kind": self.kind, "node_id": self.node_id, "node_title": self.node_title, "summary": self.card}
        if self.headline:
            item["headline"] = self.headline
        return item


class StepTotals:
    """Per sampler step, sums of a feature's numbers over that step's model calls (e.g. bytes moved, seconds), for
    the panel's per-step strip of a feature's card. ``add(step, calls=1, **numbers)`` after each call (``step`` None
    when the host cannot tell: its calls count under None); ``to_list()`` is JSON-safe, ordered by step, at most
    ``limit`` items: longer runs merge neighbouring steps (``first_step``..``last_step``, numbers added)."""

    def __init__(self) -> None:
        self._by_step: dict[int | None, dict[str, float]] = {}

    def add(self, step: int | None, **numbers: float) -> None:
        totals = self._by_step.setdefault(step, {})
        for name, value in {"calls": 1, **numbers}.items():
            totals[name] = totals.get(name, 0) + value

    def to_list(self, limit: int = TIMELINE_BINS) -> list[dict[str, Any]]:
        items = [{"first_step": step, "last_step": step, **totals} for step, totals in
                 sorted(self._by_step.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))]
        size = -(-len(items) // max(limit, 1))
        if size <= 1:
            return json_safe(items)
        merged = []
        for i in range(0, len(items), size):
            group = items[i:i + size]
            item = {"first_step": group[0]["first_step"], "last_step": group[-1]["last_step"]}
            for other in group:
                for name, value in other.items():
                    if name not in ("first_step", "last_step"):
                        item[name] = item.get(name, 0) + value
            merged.append(item)
        return json_safe(merged)


def _cache_fields(stats: CacheRunStats) -> dict[str, Any]:
    return {"kind": stats.kind, "model": stats.model, "threshold": stats.threshold}


def run_started(feature) -> RunHeader:
    """A run whose node left ``feature`` (an ``AppliedFeature``) has started: its header (a new ``run_id``)."""
    prompt_id, sampler_node_id = _executing()
    title, workflow_id = _prompt_context(prompt_id, feature.node_id)
    return RunHeader(run_id=f"run-{next(_run_numbers)}", prompt_id=prompt_id, node_id=feature.node_id,
                     node_title=title or feature.node_title, workflow_id=workflow_id, sampler_node_id=sampler_node_id,
                     kind=feature.kind, started_at=time.time())


def step_finished(header: RunHeader, stats: CacheRunStats, record) -> None:
    """After every model evaluation of a cache (hot path): one small message, no tensor access."""
    branches = [asdict(b) for b in record.branches[:STEP_BRANCHES_LIMIT]]
    event = {**header.fields, **_cache_fields(stats), "step": record.step, "total_steps": record.total_steps,
             "computed": record.computed, "seconds": record.seconds, "branches": branches}
    if len(record.branches) > STEP_BRANCHES_LIMIT:
        event["branches_omitted"] = len(record.branches) - STEP_BRANCHES_LIMIT
    _send(STEP_EVENT, json_safe(event))


def bounded_entry(header: dict[str, Any], stats: CacheRunStats | None,
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON-safe history entry of a run, at most ``ENTRY_BYTES_LIMIT`` bytes of JSON.

    A cache's statistics (``stats``; None for a run without a cache: ``summary`` None, no evaluations): every
    evaluation while they fit in ``DETAIL_BYTES_LIMIT``; else a timeline of ``TIMELINE_BINS`` bins; else (thousands
    of branches) the summary alone, with long lists cut; ``detail`` says which. ``extra`` (further top-level fields,
    e.g. the features' cards) is kept unless it alone breaks the bound, then each of its fields becomes None and a
    warning says so.
    """
    summary = stats.summary() if stats is not None else None
    entry = json_safe({**header, **(extra or {}), "summary": summary, "detail": "evaluations", "timeline": None})
    evaluations = stats.to_dict()["evaluations"] if stats is not None else []
    if json_bytes(evaluations) <= DETAIL_BYTES_LIMIT:
        entry["evaluations"] = evaluations
    else:
        entry.update(detail="timeline", evaluations=[], timeline=stats.timeline(TIMELINE_BINS))
    if stats is not None and json_bytes(entry) > ENTRY_BYTES_LIMIT:
        summary = entry["summary"]
        entry.update(detail="summary", evaluations=[], timeline=None)
        summary["warnings"] = [w[:500] for w in summary["warnings"][:20]]
        summary["notes"] = [n[:500] for n in summary["notes"][:20]]
        summary["branches"] = dict(list(summary["branches"].items())[:STEP_BRANCHES_LIMIT])
    if json_bytes(entry) > ENTRY_BYTES_LIMIT:
        for key in extra or {}:
            entry[key] = None
        warning = f"the run's {', '.join(extra or {})} statistics were too large to keep"
        if entry["summary"] is not None:
            entry["summary"]["warnings"].append(warning)
        else:
            log.warning("OmniHooks: %s", warning)
    return entry


def run_finished(header: RunHeader, status: str, reports: list[FeatureReport]) -> dict[str, Any]:
    """Log, keep and publish the run's entry from every feature's report (``bounded_entry``).

    A cache's report gives the entry's ``model``, ``threshold``, ``summary`` and per-evaluation part; every report
    with a card is an item of ``features``; every report's ``fields`` are top-level fields.
    """
    stats = next((r.stats for r in reports if r.stats is not None), None)
    if stats is not None and stats.evaluations:
        log.info("OmniHooks %s", stats.log_line())
    head = {**header.fields, "model": "", "threshold": None, **(_cache_fields(stats) if stats else {}),
            "status": status, "finished_at": time.time()}
    extra: dict[str, Any] = {}
    for report in reports:
        extra.update(report.fields)
    cards = [r.feature_entry() for r in reports if r.card]
    if cards:
        extra["features"] = cards
    entry = bounded_entry(head, stats, extra)
    size = json_bytes(entry)
    with _lock:
        _history[entry["run_id"]] = entry
        _sizes[entry["run_id"]] = size
        while len(_history) > 1 and (len(_history) > HISTORY_LIMIT or sum(_sizes.values()) > HISTORY_BYTES_LIMIT):
            run_id, _ = _history.popitem(last=False)
            _sizes.pop(run_id, None)
    _send(RUN_EVENT, entry)
    return entry


def without_detail(entry: dict[str, Any]) -> dict[str, Any]:
    """An entry without its per-evaluation part (what a list of runs needs)."""
    return {**entry, "evaluations": [], "timeline": None}


def recent_runs(limit: int = 10, prompt_id: str | None = None) -> list[dict[str, Any]]:
    """Newest first; only those of ``prompt_id`` if given."""
    with _lock:
        entries = [e for e in reversed(_history.values()) if prompt_id is None or e["prompt_id"] == prompt_id]
    return entries[:max(limit, 0)]


def history_bytes() -> int:
    """JSON bytes of every entry kept."""
    with _lock:
        return sum(_sizes.values())


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

    def respond(data: Any, status: int = 200) -> web.Response:
        return web.json_response(data, status=status, dumps=dumps)

    @routes.get("/omni_hooks/runs")
    async def list_runs(request: web.Request) -> web.Response:
        try:
            limit = min(int(request.query.get("limit", "20")), HISTORY_LIMIT)
        except ValueError:
            return respond({"error": "limit must be an integer"}, status=400)
        detail = request.query.get("detail", "1")
        if detail not in ("0", "1"):
            return respond({"error": "detail must be 0 or 1"}, status=400)
        runs = recent_runs(limit, request.query.get("prompt_id"))
        return respond({"runs": runs if detail == "1" else [without_detail(e) for e in runs]})

    @routes.get("/omni_hooks/runs/{run_id}")
    async def one_run(request: web.Request) -> web.Response:
        entry = get_run(request.match_info["run_id"])
        if entry is None:
            return respond({"error": "unknown run id"}, status=404)
        return respond(entry)
