"""Cache statistics over the real server: websocket events, the /omni_hooks/runs route, headless reads by prompt id."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from omnitest.graphs import tiny_wan_graph

pytestmark = pytest.mark.server

CALIBRATION = "stats-identity"
STEPS = 12


@pytest.fixture(scope="module", autouse=True)
def identity_calibration(comfy_server):
    folder = Path(comfy_server.base_dir) / "user" / "omni_hooks" / "teacache"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{CALIBRATION}.json").write_text(json.dumps(
        {"kind": "teacache", "family": "wan", "signal": "default", "coefficients": [0, 0, 0, 1, 0]}))


def teacache(threshold: float):
    graph = tiny_wan_graph([("OmniHooks.ApplyTeaCache", {
        "rel_l1_thresh": threshold, "start_percent": 0.0, "end_percent": 1.0, "cache_device": "compute device",
        "model_variant": f"calibration: {CALIBRATION}"})], steps=STEPS, cfg=3.0)
    return graph.set_nonce(time.monotonic_ns())


def test_route_reports_the_same_totals_as_the_events(comfy):
    result = comfy.run(teacache(1.0).prompt())
    steps = result.events("omni_hooks.step")
    (run_event,) = result.events("omni_hooks.run")
    assert len(steps) == run_event["summary"]["evaluations"] == STEPS
    assert sum(not s["computed"] for s in steps) == run_event["summary"]["reused"] > 0
    assert [s["step"] for s in steps] == list(range(STEPS))
    assert all(s["prompt_id"] == result.prompt_id and s["node_id"] == "10" and s["sampler_node_id"] == "4"
               for s in steps)
    (route,) = comfy.get_json("/omni_hooks/runs", {"prompt_id": result.prompt_id})["runs"]
    assert route["summary"] == run_event["summary"]
    assert route["status"] == "success" and route["run_id"] == run_event["run_id"]
    assert [e["computed"] for e in route["evaluations"]] == [s["computed"] for s in steps]
    assert comfy.get_json(f"/api/omni_hooks/runs/{route['run_id']}")["summary"] == route["summary"]


def test_a_headless_run_without_a_client_is_readable_by_prompt_id(comfy):
    r = comfy.post("/prompt", {"prompt": teacache(1.0).prompt()})  # no client_id: a plain API user
    r.raise_for_status()
    prompt_id = r.json()["prompt_id"]
    comfy.history(prompt_id, timeout=120)
    (run,) = comfy.get_json("/api/omni_hooks/runs", {"prompt_id": prompt_id})["runs"]
    assert run["summary"]["evaluations"] == STEPS and run["summary"]["reused"] > 0
    assert run["prompt_id"] == prompt_id and run["kind"] == "teacache"


def test_a_run_that_reused_nothing_carries_the_warning(comfy):
    result = comfy.run(teacache(0.0).prompt())
    (run_event,) = result.events("omni_hooks.run")
    assert run_event["summary"]["reused"] == 0
    assert any("nothing was reused" in w and "threshold is 0" in w for w in run_event["summary"]["warnings"])


def test_route_errors_and_limits(comfy):
    assert comfy.get("/omni_hooks/runs/no-such-run").status_code == 404
    assert comfy.get("/omni_hooks/runs", {"limit": "many"}).status_code == 400
    assert len(comfy.get_json("/omni_hooks/runs", {"limit": 1})["runs"]) <= 1
    assert comfy.get_json("/omni_hooks/runs", {"prompt_id": "unknown"})["runs"] == []
