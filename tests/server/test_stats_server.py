"""Cache statistics over the real server: websocket events, the /omni_hooks/runs route, headless reads by prompt id;
always strict JSON, with the node's title and workflow of each run."""
from __future__ import annotations

import json
import time

import pytest

from omnitest.calibrations import IDENTITY_TEACACHE, OVERFLOWING_TEACACHE, write_calibration
from omnitest.graphs import tiny_wan_graph
from omnitest.strict import strict_json

pytestmark = pytest.mark.server

CALIBRATION = "stats-identity"
OVERFLOW = "stats-overflow"
STEPS = 12


@pytest.fixture(scope="module", autouse=True)
def calibrations(comfy_server):
    write_calibration(comfy_server.base_dir, "teacache", CALIBRATION, IDENTITY_TEACACHE)
    write_calibration(comfy_server.base_dir, "teacache", OVERFLOW, OVERFLOWING_TEACACHE)


def teacache(threshold: float, calibration: str = CALIBRATION, title: str | None = None):
    graph = tiny_wan_graph([("OmniHooks.ApplyTeaCache", {
        "rel_l1_thresh": threshold, "start_percent": 0.0, "end_percent": 1.0, "cache_device": "compute device",
        "model_variant": f"calibration: {calibration}"})], steps=STEPS, cfg=3.0)
    graph.patches[0].title = title
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


def test_an_overflowing_metric_is_sent_and_served_as_strict_json(comfy):
    result = comfy.run(teacache(1.0, OVERFLOW).prompt())
    for event in result.events("omni_hooks.step") + result.events("omni_hooks.run"):
        json.dumps(event, allow_nan=False)  # a bare Infinity on the wire would have been read as a float inf
    (run_event,) = result.events("omni_hooks.run")
    metrics = [b["metric"] for e in run_event["evaluations"] for b in e["branches"]]
    assert "Infinity" in metrics and all(m is None or isinstance(m, (int, float, str)) for m in metrics)
    assert any("not a finite number" in w for w in run_event["summary"]["warnings"])
    listed = strict_json(comfy.get("/omni_hooks/runs", {"limit": 100}).text)["runs"]
    assert run_event["run_id"] in [r["run_id"] for r in listed]  # the history still loads with it among them
    entry = strict_json(comfy.get(f"/omni_hooks/runs/{run_event['run_id']}").text)
    assert entry["evaluations"] == run_event["evaluations"]


def test_a_run_names_its_node_title_and_workflow(comfy):
    titled = comfy.run(teacache(1.0, title="My TeaCache").prompt(),
                       extra_data={"extra_pnginfo": {"workflow": {"id": "wf-1234", "nodes": []}}})
    (run,) = titled.events("omni_hooks.run")
    assert (run["node_title"], run["workflow_id"], run["threshold"]) == ("My TeaCache", "wf-1234", 1.0)
    assert titled.events("omni_hooks.step")[0]["node_title"] == "My TeaCache"
    plain = comfy.run(teacache(1.0).prompt())  # an API user: no title, no workflow
    (run,) = plain.events("omni_hooks.run")
    assert (run["node_title"], run["workflow_id"]) == ("Apply TeaCache", None)


def test_the_list_without_detail_leaves_out_the_evaluations(comfy):
    result = comfy.run(teacache(1.0).prompt())
    (full,) = comfy.get_json("/omni_hooks/runs", {"prompt_id": result.prompt_id})["runs"]
    (light,) = comfy.get_json("/omni_hooks/runs", {"prompt_id": result.prompt_id, "detail": 0})["runs"]
    assert len(full["evaluations"]) == STEPS and full["detail"] == "evaluations"
    assert light["evaluations"] == [] and light["summary"] == full["summary"] and light["run_id"] == full["run_id"]
    assert comfy.get("/omni_hooks/runs", {"detail": "some"}).status_code == 400
