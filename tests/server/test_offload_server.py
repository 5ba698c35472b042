"""CPU Offload end to end through a real ComfyUI server.

The test server runs with ``--cpu``: there is nothing to offload to, so the node must change nothing and say so in
the log line it writes after every sampling run ("OmniHooks CPU Offload (node #10, ...): nothing to offload to: ...")
and in the ``features`` of the run's entry at ``/omni_hooks/runs`` (its own entry when no cache runs with it).
The real offload path on ComfyUI's loaded weights is exercised in-process (tests/host/offload/test_offload_host.py).
"""
from __future__ import annotations

import json
import re
import time

import pytest
import torch

from omnitest.graphs import delay_output, fresh_nonce, tiny_wan_graph
from omnitest.server import assert_clear_node_error

pytestmark = pytest.mark.server

OFFLOAD = "OmniHooks.CPUOffload"
TEACACHE = "OmniHooks.ApplyTeaCache"
STEPS = 12
IDENTITY = "offload-server-identity"
OFFLOAD_LINE = re.compile(r"OmniHooks CPU Offload \(node #(?P<node>\d+), (?P<model>[^,]+), (?P<status>\w+)\): "
                          r"(?P<rest>.*)$")
TEACACHE_LINE = re.compile(r"OmniHooks teacache \(.+\): reused (?P<reused>\d+)/(?P<evaluations>\d+) model evaluations")


def offload(blocks_to_offload: int = -1, prefetch_blocks: int = 1, pin_memory: str = "auto",
            vram_budget_gb: float = 0.0):
    return (OFFLOAD, dict(blocks_to_offload=blocks_to_offload, prefetch_blocks=prefetch_blocks,
                          pin_memory=pin_memory, vram_budget_gb=vram_budget_gb))


def teacache():
    return (TEACACHE, dict(rel_l1_thresh=1.0, start_percent=0.0, end_percent=1.0, cache_device="compute device",
                           model_variant="calibration: " + IDENTITY))


class Lines:
    """The log lines matching ``pattern`` that the server writes from now on."""

    def __init__(self, server, pattern: re.Pattern):
        self.server, self.pattern = server, pattern
        self.mark = len(server.log_text().splitlines())

    def wait(self, expect: int, timeout: float = 10.0) -> list[re.Match]:
        deadline = time.monotonic() + timeout
        while True:
            found = [m for line in self.server.log_text().splitlines()[self.mark:]
                     if (m := self.pattern.search(line))]
            if len(found) >= expect or time.monotonic() > deadline:
                assert len(found) == expect, (f"expected {expect} line(s) matching {self.pattern.pattern!r}, got "
                                              f"{len(found)}\n--- log tail ---\n{self.server.log_tail(40)}")
                return found
            time.sleep(0.05)


@pytest.fixture(scope="module")
def identity(comfy_server) -> None:
    path = comfy_server.base_dir / "user" / "omni_hooks" / "teacache" / f"{IDENTITY}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"kind": "teacache", "family": "wan", "signal": "default",
                                "coefficients": [0, 0, 0, 1, 0]}))


@pytest.fixture(scope="module")
def baseline(comfy_server) -> torch.Tensor:
    comfy_server.ensure_running()
    with comfy_server.client() as client:
        return client.run(tiny_wan_graph(steps=STEPS, nonce=fresh_nonce()).prompt()).latent()


@pytest.fixture(scope="module")
def teacache_alone(comfy_server, identity, baseline) -> torch.Tensor:
    comfy_server.ensure_running()
    with comfy_server.client() as client:
        lines = Lines(comfy_server, TEACACHE_LINE)
        latent = client.run(tiny_wan_graph([teacache()], steps=STEPS, nonce=fresh_nonce()).prompt()).latent()
        (run,) = lines.wait(1)
        assert 0 < int(run["reused"]) < int(run["evaluations"]), run.group(0)  # TeaCache really skips here
    assert not torch.equal(latent, baseline)
    return latent


def run_both_orders(comfy, server, patches) -> list[dict]:
    """The patched sampler "4" and the original sampler "6" in one prompt, once with each running first."""
    graph = tiny_wan_graph(patches, steps=STEPS, compare_original=True, nonce=fresh_nonce())
    assert graph.prompt()["6"]["inputs"]["model"] == ["1", 0]
    runs = []
    for delayed_sampler, delayed_save in (("4", "5"), ("6", "7")):
        prompt = delay_output(graph.set_nonce(fresh_nonce()).prompt(), delayed_sampler, delayed_save)
        lines = Lines(server, OFFLOAD_LINE)
        result = comfy.run(prompt)
        executed = result.executed_nodes
        runs.append({"patched": result.latent("5"), "original": result.latent("7"), "lines": lines.wait(1),
                     "history": comfy.get_json("/omni_hooks/runs", {"prompt_id": result.prompt_id})["runs"],
                     "order": "patched first" if executed.index("4") < executed.index("6") else "original first"})
    assert sorted(r["order"] for r in runs) == ["original first", "patched first"]
    return runs


def test_cpu_offload_alone_gives_the_plain_latent_and_says_there_is_nothing_to_offload_to(comfy, comfy_server,
                                                                                         baseline):
    for run in run_both_orders(comfy, comfy_server, [offload(blocks_to_offload=40)]):
        assert torch.equal(run["patched"], baseline), run["order"]
        assert torch.equal(run["original"], baseline), run["order"]
        (line,) = run["lines"]  # one line: the original sampler's run has no offload
        assert line["node"] == "10" and line["status"] == "success", line.group(0)
        assert line["rest"].startswith("nothing to offload to: ComfyUI runs this model on the CPU"), line.group(0)
        assert "changes nothing" in line["rest"]


def test_a_run_with_cpu_offload_alone_has_its_own_entry_in_the_run_history(comfy):
    """A run with CPU Offload and no cache is listed at /omni_hooks/runs (and by its run id): the offload node, the
    sampler, the status and the offload's card with what it did; the original sampler's run, with no node of ours,
    has no entry."""
    graph = tiny_wan_graph([offload(blocks_to_offload=40)], steps=STEPS, compare_original=True, nonce=fresh_nonce())
    result = comfy.run(graph.prompt())
    (entry,) = comfy.get_json("/omni_hooks/runs", {"prompt_id": result.prompt_id})["runs"]
    assert {k: entry[k] for k in ("prompt_id", "node_id", "node_title", "sampler_node_id", "kind", "status",
                                  "summary", "threshold", "evaluations")} == {
        "prompt_id": result.prompt_id, "node_id": "10", "node_title": "CPU Offload", "sampler_node_id": "4",
        "kind": "offload", "status": "success", "summary": None, "threshold": None, "evaluations": []}
    assert entry["started_at"] <= entry["finished_at"]
    (card,) = entry["features"]
    assert {k: card[k] for k in ("kind", "node_id", "node_title", "headline")} == {
        "kind": "offload", "node_id": "10", "node_title": "CPU Offload", "headline": "nothing offloaded"}
    summary = card["summary"]
    assert summary["status"] == "success" and summary["active"] is False and summary["bytes_moved"] == 0
    # one model call per step (cond and uncond batched) or two (split), every one computed: no cache skips here
    assert summary["calls_computed"] in (STEPS, 2 * STEPS) and summary["calls_skipped"] == 0
    assert any(n.startswith("nothing to offload to") for n in summary["notes"]), summary["notes"]
    assert comfy.get_json(f"/omni_hooks/runs/{entry['run_id']}") == entry
    listed = comfy.get_json("/omni_hooks/runs", {"detail": "0", "limit": "5"})["runs"]
    assert entry["run_id"] in [e["run_id"] for e in listed]


@pytest.mark.parametrize("order", ["offload first", "teacache first"])
def test_cpu_offload_with_apply_teacache_gives_the_teacache_latent(comfy, comfy_server, baseline, teacache_alone,
                                                                    order):
    patches = [offload(), teacache()] if order == "offload first" else [teacache(), offload()]
    node = "10" if order == "offload first" else "11"
    for run in run_both_orders(comfy, comfy_server, patches):
        assert torch.equal(run["patched"], teacache_alone), run["order"]
        assert torch.equal(run["original"], baseline), run["order"]
        (line,) = run["lines"]
        assert line["node"] == node and "nothing to offload to" in line["rest"], line.group(0)
        (cache_run,) = run["history"]  # the TeaCache run of the prompt carries the offload's summary
        (feature,) = cache_run["features"]
        assert feature["kind"] == "offload" and feature["node_id"] == node, feature
        summary = feature["summary"]
        assert summary["active"] is False and summary["bytes_moved"] == 0 and summary["status"] == "success"
        assert any(n.startswith("nothing to offload to") for n in summary["notes"]), summary["notes"]


def test_bad_pin_memory_and_two_offload_nodes_are_clear_errors(comfy):
    error = comfy.node_error(tiny_wan_graph([offload(pin_memory="maybe")], steps=2, nonce=fresh_nonce()).prompt())
    assert_clear_node_error(error, "10", OFFLOAD, "CPU Offload: ", {"pin_memory": "maybe"},
                            ["unknown pin_memory 'maybe'"])
    error.assert_nothing_ran_after("4")
    result = comfy.run(tiny_wan_graph([offload(), offload()], steps=2, nonce=fresh_nonce()).prompt(), check=False)
    assert result.status == "error" and result.error["node_id"] == "11", result.types
    message = result.error["exception_message"]
    assert "CPU Offload (node #11)" in message and "CPU Offload (node #10)" in message, message
    assert "4" not in result.executed_nodes and not result.output_files()
