"""Calibrate nodes over the real server: a `name` fed from a link (a primitive node) is accepted at /prompt (the value
does not exist yet there) and checked when the node runs; a fit that is not finite (cfg NaN through the API) is
refused and the earlier file of that name kept."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from omnitest.graphs import tiny_wan_graph
from omnitest.server import PromptRejected

pytestmark = pytest.mark.server


def calibrate(kind: str, name: str, cfg: float = 3.0):
    graph = tiny_wan_graph(steps=8, cfg=cfg)
    graph.sampler.class_type = f"OmniHooks.{kind}Calibrate"
    graph.sampler.set_input("name", name)
    graph.set_nonce(time.monotonic_ns())
    return graph


def calibrate_with_linked_name(name: str):
    graph = tiny_wan_graph(steps=8, cfg=3.0)
    graph.sampler.class_type = "OmniHooks.TeaCacheCalibrate"  # KSampler's inputs, plus a name
    primitive = graph.graph.node("PrimitiveString", node_id=20, value=name)
    graph.sampler.set_input("name", primitive.out(0))
    graph.set_nonce(time.monotonic_ns())
    return graph


def test_a_linked_name_is_accepted_at_prompt_and_saves_under_the_linked_value(comfy, comfy_server):
    result = comfy.run(calibrate_with_linked_name("linked name").prompt(), timeout=300)
    assert result.ok
    assert (Path(comfy_server.base_dir) / "user" / "omni_hooks" / "teacache" / "linked name.json").is_file()


def test_a_bad_linked_name_fails_when_the_node_runs_naming_the_problem(comfy):
    try:
        result = comfy.run(calibrate_with_linked_name("../escape").prompt(), timeout=300, check=False)
    except PromptRejected as e:  # must not be rejected at /prompt: the value is not known there
        pytest.fail(f"a linked name was rejected at /prompt: {e}")
    assert not result.ok
    assert result.error["node_id"] == "4"
    assert "calibration name '../escape' may use letters" in result.error["exception_message"]


@pytest.mark.parametrize("kind", ["TeaCache", "MagCache"])
def test_a_non_finite_fit_is_refused_and_the_earlier_file_kept(comfy, comfy_server, kind):
    path = Path(comfy_server.base_dir) / "user" / "omni_hooks" / kind.lower() / "kept.json"
    assert comfy.run(calibrate(kind, "kept").prompt(), timeout=300).ok
    before = path.read_bytes()
    # cfg NaN through the API, as a client that writes JSON with Python's json module sends it (requests refuses)
    comfy.connect()
    body = json.dumps({"prompt": calibrate(kind, "kept", cfg=float("nan")).prompt(), "client_id": comfy.client_id})
    assert "NaN" in body
    r = comfy.http.post(comfy.url("/prompt"), data=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 200, r.text
    result = comfy.wait(r.json()["prompt_id"], timeout=300)
    assert not result.ok and result.error["node_id"] == "4"
    assert "not saving calibration 'kept'" in result.error["exception_message"], result.error["exception_message"]
    assert "is nan (not a finite number)" in result.error["exception_message"]
    assert path.read_bytes() == before
