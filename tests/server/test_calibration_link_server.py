"""A calibrate node's `name` fed from a link (a primitive node) over the real server: accepted at /prompt (the value
does not exist yet there) and checked when the node runs."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from omnitest.graphs import tiny_wan_graph
from omnitest.server import PromptRejected

pytestmark = pytest.mark.server


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
