"""The statistics store (nodes/stats_store.py): strict JSON out, entries and history bounded in bytes as well as count,
long runs summarised, every published message bounded."""
from __future__ import annotations

import collections
import json
import math
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.host


@pytest.fixture
def store(monkeypatch):
    from omnitest.pack import pack_module

    store = pack_module("nodes.stats_store")
    sent: list[tuple[str, dict]] = []

    class Server:  # records what would go over the websocket, as ComfyUI's send_sync receives it
        client_id = "page"

        def send_sync(self, event, data, sid=None):
            sent.append((event, json.loads(json.dumps(data, allow_nan=False))))

    monkeypatch.setattr(store, "_history", collections.OrderedDict())
    monkeypatch.setattr(store, "_sizes", {})
    monkeypatch.setattr(store, "_server", lambda: Server())
    store.sent = sent
    return store


def applied(kind: str, category: str, title: str, node_id: str):
    from omnitest.pack import pack_module

    features = pack_module("nodes.features")
    return features.AppliedFeature(kind, features.Category(category), title, node_id, None)


def finished_run(store, evaluations: int, threshold: float = 0.2, metric: float = 0.1, branches=("cond", "uncond"),
                 reports=()) -> dict:
    """A cache's run as the run lifecycle publishes it: its header, a step event per evaluation, and the cache's
    report with ``reports`` (other features') at the end."""
    from omnitest.pack import pack_module

    stats_mod = pack_module("omni_hooks.caching.stats")
    config = pack_module("omni_hooks.caching.config").StackCacheConfig(threshold=threshold, model_label="tiny") \
        if math.isfinite(threshold) else SimpleNamespace(model_label="tiny", threshold=threshold, notes=(),
                                                          skip_correction=0.0)
    stats = stats_mod.CacheRunStats("teacache", config)
    feature = applied("teacache", "cache", "Apply TeaCache", "10")
    header = store.run_started(feature)
    for i in range(evaluations):
        computed = i % 3 == 0
        record = stats_mod.EvaluationRecord(
            step=i, total_steps=evaluations, computed=computed, seconds=0.01,
            branches=[stats_mod.BranchDecision(b, computed, "threshold" if computed else "reuse", metric, threshold)
                      for b in branches])
        stats.record(record)
        store.step_finished(header, stats, record)
    return store.run_finished(header, "success", [*reports, store.FeatureReport.of(feature, stats=stats)])


def test_an_infinite_threshold_is_sent_and_kept_as_strict_json(store):
    entry = finished_run(store, 6, threshold=math.inf, metric=math.nan)
    json.dumps(entry, allow_nan=False)
    assert entry["summary"]["threshold"] == "Infinity" and entry["threshold"] == "Infinity"
    assert entry["evaluations"][1]["branches"][0]["metric"] == "NaN"
    steps = [data for event, data in store.sent if event == store.STEP_EVENT]
    assert len(steps) == 6 and steps[0]["threshold"] == "Infinity" and steps[0]["branches"][0]["metric"] == "NaN"
    assert store.dumps({"runs": store.recent_runs(5)}).count("Infinity") >= 1
    json.loads(store.dumps({"x": math.inf}), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


def test_a_10000_step_run_is_summarised_into_a_bounded_entry_and_message(store):
    entry = finished_run(store, 10_000)
    size = store.json_bytes(entry)
    assert size <= store.ENTRY_BYTES_LIMIT
    assert entry["detail"] == "timeline" and entry["evaluations"] == []
    bins = entry["timeline"]["bins"]
    assert len(bins) <= store.TIMELINE_BINS
    assert sum(b["evaluations"] for b in bins) == entry["summary"]["evaluations"] == 10_000
    assert sum(b["computed"] for b in bins) == entry["summary"]["computed"]
    (run_event,) = [data for event, data in store.sent if event == store.RUN_EVENT]
    assert len(json.dumps(run_event)) <= store.ENTRY_BYTES_LIMIT
    assert max(len(json.dumps(data)) for _, data in store.sent) <= store.ENTRY_BYTES_LIMIT


def test_a_short_run_keeps_every_evaluation(store):
    entry = finished_run(store, 30)
    assert entry["detail"] == "evaluations" and len(entry["evaluations"]) == 30 and entry["timeline"] is None


def test_history_is_bounded_by_total_bytes_as_well_as_count(store, monkeypatch):
    monkeypatch.setattr(store, "HISTORY_BYTES_LIMIT", 600_000)
    ids = [finished_run(store, 900)["run_id"] for _ in range(8)]  # ~150-250 KB each, far under 100 entries
    kept = [e["run_id"] for e in store.recent_runs(100)]
    assert store.history_bytes() <= 600_000
    assert 1 <= len(kept) < 8 and kept == ids[::-1][:len(kept)]  # the newest survive, oldest dropped first


def test_history_is_bounded_by_count(store, monkeypatch):
    monkeypatch.setattr(store, "HISTORY_LIMIT", 3)
    ids = [finished_run(store, 2)["run_id"] for _ in range(5)]
    assert [e["run_id"] for e in store.recent_runs(10)] == ids[::-1][:3]


def test_thousands_of_branches_fall_back_to_the_summary_and_cut_step_events(store):
    branches = tuple(f"cond.{i}" for i in range(3000))
    entry = finished_run(store, 40, branches=branches)
    assert entry["detail"] == "summary" and store.json_bytes(entry) <= store.ENTRY_BYTES_LIMIT
    step = next(data for event, data in store.sent if event == store.STEP_EVENT)
    assert len(step["branches"]) == store.STEP_BRANCHES_LIMIT
    assert step["branches_omitted"] == 3000 - store.STEP_BRANCHES_LIMIT


def test_other_features_reports_travel_with_the_entry_and_never_break_its_bound(store):
    offload = store.FeatureReport("offload", "12", "CPU Offload", card={"moved_bytes": 10}, headline="2/4 blocks")
    sp = store.FeatureReport("sequence_parallel", "13", "Sequence Parallel", card={"calls": 3},
                             fields={"world_size": 2})
    entry = finished_run(store, 5, reports=[offload, sp])
    assert entry["features"] == [
        {"kind": "offload", "node_id": "12", "node_title": "CPU Offload", "summary": {"moved_bytes": 10},
         "headline": "2/4 blocks"},
        {"kind": "sequence_parallel", "node_id": "13", "node_title": "Sequence Parallel", "summary": {"calls": 3}}]
    assert entry["world_size"] == 2
    assert (entry["kind"], entry["node_id"], entry["model"], entry["summary"]["evaluations"]) == ("teacache", "10",
                                                                                                  "tiny", 5)
    huge = store.FeatureReport("offload", "12", "CPU Offload", card={"log": "x" * store.ENTRY_BYTES_LIMIT})
    entry = finished_run(store, 5, reports=[huge])
    assert entry["features"] is None and store.json_bytes(entry) <= store.ENTRY_BYTES_LIMIT
    assert any("features statistics were too large" in w for w in entry["summary"]["warnings"])


def test_a_run_without_a_cache_is_an_entry_of_its_features_cards(store):
    feature = applied("offload", "offload", "CPU Offload", "12")
    header = store.run_started(feature)
    report = store.FeatureReport.of(feature, card={"blocks_offloaded": 3, "bytes_moved": 2048},
                                    headline="3/4 blocks offloaded")
    entry = store.run_finished(header, "interrupted", [report])
    assert {k: entry[k] for k in ("kind", "node_id", "node_title", "status", "model", "threshold", "summary",
                                  "evaluations", "timeline")} == {
        "kind": "offload", "node_id": "12", "node_title": "CPU Offload", "status": "interrupted", "model": "",
        "threshold": None, "summary": None, "evaluations": [], "timeline": None}
    assert entry["features"] == [report.feature_entry()] and entry["features"][0]["summary"]["bytes_moved"] == 2048
    assert store.recent_runs(1) == [entry] and store.get_run(header.run_id) == entry
    assert [data for event, data in store.sent] == [entry]  # the run event; no step events without a cache
    huge = store.FeatureReport.of(feature, card={"log": "x" * store.ENTRY_BYTES_LIMIT})
    entry = store.run_finished(store.run_started(feature), "success", [huge])
    assert entry["features"] is None and store.json_bytes(entry) <= store.ENTRY_BYTES_LIMIT


def test_the_list_without_detail_drops_evaluations(store):
    finished_run(store, 10)
    (entry,) = store.recent_runs(1)
    light = store.without_detail(entry)
    assert light["evaluations"] == [] and light["summary"] == entry["summary"] and len(entry["evaluations"]) == 10

