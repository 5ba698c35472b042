"""Apply TeaCache and TeaCache Calibrate end to end through a real ComfyUI server.

The tiny random Wan model makes the published polynomials explode (nothing would be reused), so these tests use an
identity calibration file written into the server's user directory (the polynomial is then the raw relative L1
change of the modulated input) or a file written by TeaCache Calibrate through /prompt. What the cache did is read
from the line the pack logs after every sampling run ("OmniHooks teacache (...): reused R/E model evaluations ...");
the pack has no HTTP route for its run statistics yet.

Findings these tests rely on (ComfyUI 0.3.64):
* a V3 node's schema is rebuilt on every ``INPUT_TYPES()`` / ``GET_NODE_INFO_V1()`` call, so /object_info lists a
  calibration file as soon as it is written, no restart needed (the browser keeps its copy of the node definitions
  until they are refreshed);
* /prompt validation does not check the value of a V3 combo (``("COMBO", {"options": [...]})``; only V1 list combos
  are checked), so an unknown ``model_variant`` or ``cache_device`` reaches ``execute`` and must fail there, clearly.

The restart test is last in the module; it restarts the shared session server (~10 s).
"""
from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from omnitest.calibrations import why_not_offered
from omnitest.graphs import delay_output, fresh_nonce, tiny_wan_graph, unique_prefix
from omnitest.server import PromptRejected, assert_clear_node_error

pytestmark = pytest.mark.server

APPLY = "OmniHooks.ApplyTeaCache"
CALIBRATE = "OmniHooks.TeaCacheCalibrate"
STEPS = 12
THRESH = 1.0  # with the identity polynomial and 12 steps the tiny model reuses about 5 of 12 evaluations
IDENTITY = "server-identity"
IDENTITY_FILE = {"kind": "teacache", "family": "wan", "signal": "default", "coefficients": [0, 0, 0, 1, 0]}
LOG_LINE = re.compile(r"OmniHooks teacache \((?P<model>.+), threshold (?P<threshold>[^)]+)\): reused "
                      r"(?P<reused>\d+)/(?P<evaluations>\d+) model evaluations \((?P<branches>[^)]*)\)(?P<rest>.*)$")


# --------------------------------------------------------------------------------------------------- helpers

def teacache(rel_l1_thresh: float = THRESH, model_variant: str = "calibration: " + IDENTITY, *,
             start_percent: float = 0.0, end_percent: float = 1.0, cache_device: str = "compute device"):
    return (APPLY, dict(rel_l1_thresh=rel_l1_thresh, start_percent=start_percent, end_percent=end_percent,
                        cache_device=cache_device, model_variant=model_variant))


def teacache_dir(server) -> Path:
    return server.base_dir / "user" / "omni_hooks" / "teacache"


def write_calibration(server, name: str, data) -> None:
    path = teacache_dir(server) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))


@dataclass
class LogRun:
    model: str
    threshold: float
    reused: int
    evaluations: int
    branches: dict[str, tuple[int, int]]
    line: str


class LogWatch:
    """The "OmniHooks teacache" lines the server logs from now on (one per sampling run with a cache)."""

    def __init__(self, server):
        self.server = server
        self.log_path = server.log_path
        self.mark = len(server.log_text().splitlines())

    def runs(self, expect: int = 1, timeout: float = 10.0) -> list[LogRun]:
        assert self.server.log_path == self.log_path, "the server restarted since this LogWatch was made"
        deadline = time.monotonic() + timeout
        while True:
            runs = []
            for line in self.server.log_text().splitlines()[self.mark:]:
                m = LOG_LINE.search(line)
                if m:
                    branches = {}
                    for part in m["branches"].split(", "):
                        label, _, counts = part.rpartition(" ")
                        reused, _, total = counts.partition("/")
                        branches[label] = (int(reused), int(total))
                    runs.append(LogRun(m["model"], float(m["threshold"]), int(m["reused"]), int(m["evaluations"]),
                                       branches, line))
            if len(runs) >= expect or time.monotonic() > deadline:
                assert len(runs) == expect, (f"expected {expect} 'OmniHooks teacache' log line(s), got {len(runs)}:\n"
                                             + "\n".join(r.line for r in runs) + "\n--- log tail ---\n"
                                             + self.server.log_tail(40))
                return runs
            time.sleep(0.05)

    def run(self) -> LogRun:
        return self.runs(1)[0]


def assert_node_error(result, node_id: str, *fragments: str) -> str:
    assert result.status == "error", (result.status, result.types)
    err = result.error
    assert err["node_id"] == node_id and err["node_type"] == APPLY, err
    message = err["exception_message"]
    assert message.startswith("Apply TeaCache"), message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert "4" not in result.executed_nodes and not result.output_files(), "the sampler ran after the error"
    return message


# --------------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def identity(comfy_server) -> str:
    write_calibration(comfy_server, IDENTITY, IDENTITY_FILE)
    return "calibration: " + IDENTITY


@pytest.fixture(scope="module")
def baseline(comfy_server) -> torch.Tensor:
    """The latent of the plain tiny Wan run (no cache) every comparison is made against."""
    comfy_server.ensure_running()
    with comfy_server.client() as client:
        latent = client.run(tiny_wan_graph(steps=STEPS, nonce=fresh_nonce()).prompt()).latent()
    assert torch.isfinite(latent).all()
    return latent


@pytest.fixture(scope="module")
def reference(comfy_server, identity, baseline):
    """A first Apply TeaCache run: its latent and what the log says it did."""
    comfy_server.ensure_running()
    with comfy_server.client() as client:
        watch = LogWatch(comfy_server)
        result = client.run(tiny_wan_graph([teacache()], steps=STEPS, nonce=fresh_nonce()).prompt())
        return result.latent(), watch.run()


# --------------------------------------------------------------------------------------------------- tests

def test_apply_teacache_reuses_steps(comfy, reference, baseline):
    latent, run = reference
    assert run.evaluations == STEPS
    assert 0 < run.reused < STEPS - 1, run.line  # the first and last steps are always computed
    assert run.threshold == THRESH and "calibration: " + IDENTITY in run.model
    assert set(run.branches) == {"cond", "uncond"}, run.line  # cfg 2: both branches, decided together here
    assert all(total == STEPS for _, total in run.branches.values())
    assert torch.isfinite(latent).all() and latent.shape == baseline.shape
    assert not torch.equal(latent, baseline)  # reused steps change the result a little
    assert (latent - baseline).abs().max() < 10 * baseline.abs().max()


def test_threshold_zero_is_the_plain_run(comfy, comfy_server, baseline):
    watch = LogWatch(comfy_server)
    result = comfy.run(tiny_wan_graph([teacache(0.0, "wan2.1_t2v_1.3B")], steps=STEPS, nonce=fresh_nonce()).prompt())
    run = watch.run()
    assert run.reused == 0 and run.evaluations == STEPS and "threshold is 0" in run.line
    assert torch.equal(result.latent(), baseline)


def test_original_model_in_the_same_prompt_gives_the_baseline(comfy, comfy_server, reference, baseline):
    """A second KSampler on the loader's MODEL, in the same prompt, is bit-identical to a plain run, whether it runs
    before or after the TeaCache sampler (each prompt delays one of the two chains, see ``delay_output``)."""
    ref_latent, ref_run = reference
    wan = tiny_wan_graph([teacache()], steps=STEPS, compare_original=True, nonce=fresh_nonce())
    assert wan.prompt()["4"]["inputs"]["model"] == ["10", 0] and wan.prompt()["6"]["inputs"]["model"] == ["1", 0]
    orders = []
    for delayed_sampler, delayed_save in (("4", "5"), ("6", "7")):
        prompt = delay_output(wan.set_nonce(fresh_nonce()).prompt(), delayed_sampler, delayed_save)
        watch = LogWatch(comfy_server)
        result = comfy.run(prompt)
        run = watch.run()  # exactly one cache run: the original sampler has none
        executed = result.executed_nodes
        assert "4" in executed and "6" in executed, executed
        orders.append("TeaCache first" if executed.index("4") < executed.index("6") else "original first")
        assert torch.equal(result.latent("7"), baseline), f"original sampler differs ({orders[-1]})"
        assert torch.equal(result.latent("5"), ref_latent), f"TeaCache sampler differs ({orders[-1]})"
        assert (run.reused, run.evaluations) == (ref_run.reused, ref_run.evaluations)
    assert sorted(orders) == ["TeaCache first", "original first"], f"both orders should have run: {orders}"


def test_two_chained_apply_teacache_fail_clearly_and_the_next_prompt_is_clean(comfy, comfy_server, reference,
                                                                             baseline):
    ref_latent, ref_run = reference
    chained = tiny_wan_graph([teacache(), teacache(0.5)], steps=STEPS, nonce=fresh_nonce())
    assert chained.prompt()["11"]["inputs"]["model"] == ["10", 0]
    result = comfy.run(chained.prompt(), check=False)
    assert result.status == "error"
    err = result.error
    assert err["node_id"] == "11" and err["node_type"] == APPLY, err
    message = err["exception_message"]
    assert "#11" in message and "#10" in message and "already has Apply TeaCache" in message, message
    assert "4" not in result.executed_nodes and not result.output_files()

    # the next prompts run clean: the plain model gives the baseline, Apply TeaCache behaves as before
    assert torch.equal(comfy.run(tiny_wan_graph(steps=STEPS, nonce=fresh_nonce()).prompt()).latent(), baseline)
    watch = LogWatch(comfy_server)
    again = comfy.run(tiny_wan_graph([teacache()], steps=STEPS, nonce=fresh_nonce()).prompt())
    assert watch.run().reused == ref_run.reused
    assert torch.equal(again.latent(), ref_latent)


def test_interrupt_during_sampling_leaves_the_model_restored(comfy, comfy_server, reference, baseline):
    ref_latent, ref_run = reference
    long_steps = 2000
    watch = LogWatch(comfy_server)
    # same Apply TeaCache inputs as the reference: ComfyUI serves the same MODEL clone from its cache
    pid = comfy.queue(tiny_wan_graph([teacache()], steps=long_steps, nonce=fresh_nonce()).prompt())
    comfy.wait_for_message(lambda m: m.get("type") == "progress" and (m.get("data") or {}).get("prompt_id") == pid
                           and m["data"].get("node") == "4" and m["data"].get("value", 0) >= 20, timeout=90)
    comfy.interrupt(pid)
    result = comfy.wait(pid, timeout=60)
    assert result.status == "interrupted", result.types
    assert not result.output_files()
    interrupted = watch.run()  # the run's statistics are still logged, with the steps done so far
    assert 20 <= interrupted.evaluations < long_steps, interrupted.line

    # the model is exactly as before: plain sampling is bit-identical, a TeaCache run starts fresh
    assert torch.equal(comfy.run(tiny_wan_graph(steps=STEPS, nonce=fresh_nonce()).prompt()).latent(), baseline)
    watch = LogWatch(comfy_server)
    fresh = comfy.run(tiny_wan_graph([teacache()], steps=STEPS, nonce=fresh_nonce()).prompt())
    run = watch.run()
    assert (run.reused, run.evaluations) == (ref_run.reused, ref_run.evaluations), run.line
    assert torch.equal(fresh.latent(), ref_latent)


BAD_FILES = {
    "bad-json": "{not json",
    "bad-list": [0, 0, 0, 1, 0],
    "bad-no-coefficients": {"kind": "teacache", "family": "wan"},
    "bad-short": {"kind": "teacache", "family": "wan", "coefficients": [1.0]},
    "bad-text": {"kind": "teacache", "family": "wan", "coefficients": "0 0 0 1 0"},
    "bad-signal": {"kind": "teacache", "family": "wan", "signal": "nope", "coefficients": [0, 0, 0, 1, 0]},
    "bad-flux": {"kind": "teacache", "family": "flux", "signal": "default", "coefficients": [0, 0, 0, 1, 0]},
}

BAD_INPUTS = [
    pytest.param(dict(rel_l1_thresh=0.2, model_variant="flux"), ("'flux'", "flux models", "wan"), id="flux-on-wan"),
    pytest.param(dict(model_variant="no-such-variant"), ("unknown model_variant",), id="unknown-variant"),
    pytest.param(dict(start_percent=0.8, end_percent=0.2), ("start_percent", "end_percent"), id="window"),
    pytest.param(dict(cache_device="gpu 7"), ("cache_device", "gpu 7"), id="cache-device"),
    pytest.param(dict(model_variant="calibration: not-there"), ("not-there", "does not exist"), id="missing-file"),
    pytest.param(dict(model_variant="calibration: bad-json"), ("bad-json.json", "cannot be read"), id="bad-json"),
    pytest.param(dict(model_variant="calibration: bad-list"), ("bad-list.json", "JSON object"), id="bad-list"),
    pytest.param(dict(model_variant="calibration: bad-no-coefficients"), ("'bad-no-coefficients'", "coefficients"),
                 id="no-coefficients"),
    pytest.param(dict(model_variant="calibration: bad-short"), ("'bad-short'", "5 finite numbers"), id="short"),
    pytest.param(dict(model_variant="calibration: bad-text"), ("'bad-text'", "5 finite numbers"), id="text"),
    pytest.param(dict(model_variant="calibration: bad-signal"), ("'bad-signal'", "signal 'nope'"), id="signal"),
    pytest.param(dict(model_variant="calibration: bad-flux"), ("'bad-flux'", "flux model"), id="other-family"),
]


@pytest.fixture(scope="module")
def bad_files(comfy_server):
    for name, data in BAD_FILES.items():
        write_calibration(comfy_server, name, data)


@pytest.mark.parametrize("inputs,fragments", BAD_INPUTS)
def test_bad_input_is_a_clear_error_naming_the_node(comfy, identity, bad_files, inputs, fragments):
    """An execution error of Apply TeaCache, or (a value not among its options, which newer ComfyUI checks at /prompt)
    a rejection naming the node and the input; a file not offered has the reason in the server log."""
    kwargs = dict(rel_l1_thresh=THRESH, model_variant=identity) | inputs
    error = comfy.node_error(tiny_wan_graph([teacache(**kwargs)], steps=STEPS, nonce=fresh_nonce()).prompt())
    file = inputs.get("model_variant", "").removeprefix("calibration: ")
    why = why_not_offered(comfy.server.log_text(), file) if file in BAD_FILES else None
    assert_clear_node_error(error, "10", APPLY, "Apply TeaCache", inputs, fragments, why)
    error.assert_nothing_ran_after("4")


@pytest.mark.parametrize("value,error_type", [(-2.0, "value_smaller_than_min"), (11.0, "value_bigger_than_max")])
def test_out_of_range_threshold_is_rejected_by_validation(comfy, identity, value, error_type):
    with pytest.raises(PromptRejected) as info:
        comfy.queue(tiny_wan_graph([teacache(value, identity)], steps=STEPS).prompt())
    errors = info.value.node_errors["10"]
    assert errors["class_type"] == APPLY
    assert [(e["type"], e["extra_info"]["input_name"]) for e in errors["errors"]] == [(error_type, "rel_l1_thresh")]


def test_errors_leave_the_server_clean(comfy, reference, baseline):
    """After all the failed prompts above: plain and TeaCache runs are unchanged."""
    ref_latent, _ = reference
    assert torch.equal(comfy.run(tiny_wan_graph(steps=STEPS, nonce=fresh_nonce()).prompt()).latent(), baseline)
    assert torch.equal(comfy.run(tiny_wan_graph([teacache()], steps=STEPS, nonce=fresh_nonce()).prompt()).latent(),
                       ref_latent)


def test_calibrate_name_is_validated_only_once(comfy):
    wan = tiny_wan_graph(steps=STEPS)
    prompt = wan.prompt()
    prompt["4"] = {"class_type": CALIBRATE, "inputs": {**prompt["4"]["inputs"], "name": "../escape"}}
    with pytest.raises(PromptRejected) as info:
        comfy.queue(prompt)
    errors = info.value.node_errors["4"]["errors"]
    assert len(errors) == 1 and "TeaCache Calibrate" in errors[0]["details"], errors
    assert errors[0]["extra_info"]["input_name"] == "name"
    prompt["4"]["inputs"] |= {"name": "fine name", "steps": 4}  # below the node's minimum of 8 steps
    with pytest.raises(PromptRejected) as info:
        comfy.queue(prompt)
    assert [e["type"] for e in info.value.node_errors["4"]["errors"]] == ["value_smaller_than_min"]


def test_calibrate_through_prompt_then_apply_and_it_survives_a_restart(comfy_server, comfy, baseline):
    # keep this test last: it restarts the shared server
    name = f"server-cal-{uuid.uuid4().hex[:8]}"
    option = "calibration: " + name
    assert option not in comfy.object_info(APPLY)["input"]["required"]["model_variant"][1]["options"]

    calibrate = tiny_wan_graph(steps=STEPS, nonce=fresh_nonce(), prefix=unique_prefix("calibrate"))
    prompt = calibrate.prompt()
    prompt["4"] = {"class_type": CALIBRATE, "inputs": {**prompt["4"]["inputs"], "name": name}}
    result = comfy.run(prompt)
    path = teacache_dir(comfy_server) / f"{name}.json"
    assert path.is_file(), list(teacache_dir(comfy_server).glob("*"))
    data = json.loads(path.read_text())
    assert data["kind"] == "teacache" and data["family"] == "wan" and len(data["coefficients"]) == 5
    assert data["points"] >= 2 * (STEPS - 2) and data["sampler"]["steps"] == STEPS
    assert any(name in text for text in result.outputs["4"]["text"]), result.outputs
    assert torch.equal(result.latent("5"), baseline)  # calibration computes every step: a plain run

    # offered at once: V3 schemas are rebuilt for every /object_info and every /prompt validation
    assert option in comfy.object_info(APPLY)["input"]["required"]["model_variant"][1]["options"]
    apply = tiny_wan_graph([teacache(-1.0, option)], steps=STEPS, nonce=fresh_nonce())  # -1: the file's threshold
    watch = LogWatch(comfy_server)
    before = comfy.run(apply.prompt())
    run_before = watch.run()
    assert 0 < run_before.reused < STEPS and option in run_before.model, run_before.line
    latent_before = before.latent()

    comfy_server.restart()
    assert path.is_file() and json.loads(path.read_text()) == data
    assert option in comfy.object_info(APPLY)["input"]["required"]["model_variant"][1]["options"]
    watch = LogWatch(comfy_server)
    after = comfy.run(apply.set_nonce(fresh_nonce()).set_prefix(unique_prefix("after_restart")).prompt())
    run_after = watch.run()
    assert (run_after.reused, run_after.evaluations) == (run_before.reused, run_before.evaluations)
    assert torch.equal(after.latent(), latent_before)
    assert torch.equal(comfy.run(tiny_wan_graph(steps=STEPS, nonce=fresh_nonce()).prompt()).latent(), baseline)
