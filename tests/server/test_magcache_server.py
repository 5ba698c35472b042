"""Apply MagCache and MagCache Calibrate end to end through a real ComfyUI server.

No published curve fits the tiny random Wan model (it has no released size, so 'auto' refuses), so these tests use a
flat calibration file written into the server's user directory (ratio 0.95 per step: the accumulated error, and
with it every decision, is known in advance) or a file written by MagCache Calibrate through /prompt. What the cache
did is read from ``GET /omni_hooks/runs?prompt_id=<id>`` (``nodes/stats_store.py``), never from the log.

With the flat curve, threshold 0.3, K = 2 and retention 0.2 over 12 steps the decisions are fixed: steps 0-1 are
retained, then two reuses and one computed step (K reached) in turn, and the last step, the schedule's largest
sigma step, is always computed (large steps), so 6 of 12 evaluations are reused. The tiny model's own calibrated
ratios stay within 1 +- 0.011, so any threshold above ~0.03 gives the same K-limited pattern.

The restart test is last in the module; it restarts the shared session server (~10 s).
"""
from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch

from omnitest.calibrations import why_not_offered
from omnitest.graphs import delay_output, fresh_nonce, tiny_wan_graph, unique_prefix
from omnitest.server import TINY_WAN_NAME, PromptRejected, assert_clear_node_error

pytestmark = pytest.mark.server

APPLY = "OmniHooks.ApplyMagCache"
CALIBRATE = "OmniHooks.MagCacheCalibrate"
TEACACHE = "OmniHooks.ApplyTeaCache"
STEPS = 12
THRESH = 0.3
FLAT = "server-flat"
FLAT_FILE = {"kind": "magcache", "family": "wan", "mag_ratios": [1.0] + [0.95] * (STEPS - 1)}
# computed (True) / reused (False) per step for the flat curve, THRESH, K = 2, retention 0.2; the last step is large
FLAT_PATTERN = [True, True, False, False, True, False, False, True, False, False, True, True]


# --------------------------------------------------------------------------------------------------- helpers

def magcache(threshold: float = THRESH, curve: str = "calibration: " + FLAT, *, max_skip_steps: int = 2,
             retention_ratio: float = 0.2, start_percent: float = 0.0, end_percent: float = 1.0,
             cache_device: str = "compute device"):
    return (APPLY, dict(threshold=threshold, max_skip_steps=max_skip_steps, retention_ratio=retention_ratio,
                        start_percent=start_percent, end_percent=end_percent, cache_device=cache_device, curve=curve))


def teacache(model_variant: str = "wan2.1_t2v_1.3B"):
    return (TEACACHE, dict(rel_l1_thresh=0.2, start_percent=0.0, end_percent=1.0, cache_device="compute device",
                           model_variant=model_variant))


def magcache_dir(server) -> Path:
    return server.base_dir / "user" / "omni_hooks" / "magcache"


def write_calibration(server, name: str, data) -> None:
    path = magcache_dir(server) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))


def runs_of(client, result) -> list[dict]:
    """The cache runs of one prompt from ``/omni_hooks/runs``, in the order they ran."""
    runs = client.get_json("/omni_hooks/runs", {"prompt_id": result.prompt_id})["runs"]
    return list(reversed(runs))


def only_run(client, result) -> dict:
    runs = runs_of(client, result)
    assert len(runs) == 1, [(r["run_id"], r["sampler_node_id"], r["summary"]["model"]) for r in runs]
    return runs[0]


def pattern(run: dict) -> list[bool]:
    return [e["computed"] for e in run["evaluations"]]


def calibrate_prompt(name: str, *, steps: int = STEPS, preview: bool = False) -> dict:
    """The tiny Wan graph with MagCache Calibrate ("4") in place of the KSampler; ``preview`` adds a core
    PreviewAny ("9") showing the curve text (output 1), as the calibration example workflow does."""
    prompt = tiny_wan_graph(steps=steps, nonce=fresh_nonce(), prefix=unique_prefix("mag_calibrate")).prompt()
    inputs = {k: v for k, v in prompt["4"]["inputs"].items() if k != "denoise"}  # the node has no denoise
    prompt["4"] = {"class_type": CALIBRATE, "inputs": {**inputs, "name": name}}
    if preview:
        prompt["9"] = {"class_type": "PreviewAny", "inputs": {"source": ["4", 1]}}
    return prompt


def assert_conflict(result, node_id: str, node_type: str, title: str, other: str, other_id: str) -> str:
    assert result.status == "error", (result.status, result.types)
    err = result.error
    assert err["node_id"] == node_id and err["node_type"] == node_type, err
    message = err["exception_message"]
    assert message.startswith(f"{title} (node #{node_id}): this MODEL already has {other} (node #{other_id})"), \
        message
    assert "Only one cache" in message, message
    assert "4" not in result.executed_nodes and not result.output_files(), "the sampler ran after the error"
    return message


# --------------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def flat(comfy_server) -> str:
    write_calibration(comfy_server, FLAT, FLAT_FILE)
    return "calibration: " + FLAT


@pytest.fixture(scope="module")
def baseline(comfy_server) -> torch.Tensor:
    """The latent of the plain tiny Wan run (no cache) every comparison is made against."""
    comfy_server.ensure_running()
    with comfy_server.client() as client:
        latent = client.run(tiny_wan_graph(steps=STEPS, nonce=fresh_nonce()).prompt()).latent()
    assert torch.isfinite(latent).all()
    return latent


@pytest.fixture(scope="module")
def reference(comfy_server, flat, baseline):
    """A first Apply MagCache run with the flat curve: its latent and its route entry."""
    comfy_server.ensure_running()
    with comfy_server.client() as client:
        result = client.run(tiny_wan_graph([magcache()], steps=STEPS, nonce=fresh_nonce()).prompt())
        return result.latent(), only_run(client, result)


# --------------------------------------------------------------------------------------------------- tests

def test_apply_magcache_skips_steps(comfy, reference, baseline):
    latent, run = reference
    summary = run["summary"]
    assert run["kind"] == "magcache" and run["status"] == "success"
    assert run["node_id"] == "10" and run["sampler_node_id"] == "4"
    assert "calibration: " + FLAT in summary["model"] and summary["threshold"] == THRESH
    assert [e["step"] for e in run["evaluations"]] == list(range(STEPS))
    assert {e["total_steps"] for e in run["evaluations"]} == {STEPS}
    assert pattern(run) == FLAT_PATTERN
    assert summary["evaluations"] == STEPS and summary["reused"] == FLAT_PATTERN.count(False)
    assert summary["branches"] == {"cond": {"computed": 6, "reused": 6}, "uncond": {"computed": 6, "reused": 6}}
    reasons = [{b["reason"] for b in e["branches"]} for e in run["evaluations"]]
    assert reasons[:2] == [{"retention"}, {"retention"}] and reasons[4] == {"max-skips"}, reasons
    assert reasons[-1] == {"large-step"}, reasons
    assert not summary["warnings"], summary["warnings"]
    assert torch.isfinite(latent).all() and latent.shape == baseline.shape
    assert not torch.equal(latent, baseline)  # reused steps change the result a little
    assert (latent - baseline).abs().max() < 10 * baseline.abs().max()


def test_threshold_zero_is_the_plain_run(comfy, flat, baseline):
    result = comfy.run(tiny_wan_graph([magcache(0.0)], steps=STEPS, nonce=fresh_nonce()).prompt())
    run = only_run(comfy, result)
    assert run["summary"]["reused"] == 0 and run["summary"]["evaluations"] == STEPS
    assert any("threshold is 0" in w for w in run["summary"]["warnings"]), run["summary"]["warnings"]
    assert torch.equal(result.latent(), baseline)


def test_original_model_in_the_same_prompt_gives_the_baseline(comfy, reference, baseline):
    """A second KSampler on the loader's MODEL, in the same prompt, is bit-identical to a plain run, whether it runs
    before or after the MagCache sampler (each prompt delays one of the two chains, see ``delay_output``)."""
    ref_latent, ref_run = reference
    wan = tiny_wan_graph([magcache()], steps=STEPS, compare_original=True, nonce=fresh_nonce())
    assert wan.prompt()["4"]["inputs"]["model"] == ["10", 0] and wan.prompt()["6"]["inputs"]["model"] == ["1", 0]
    orders = []
    for delayed_sampler, delayed_save in (("4", "5"), ("6", "7")):
        result = comfy.run(delay_output(wan.set_nonce(fresh_nonce()).prompt(), delayed_sampler, delayed_save))
        run = only_run(comfy, result)  # exactly one cache run: the original sampler has none
        executed = result.executed_nodes
        assert "4" in executed and "6" in executed, executed
        orders.append("MagCache first" if executed.index("4") < executed.index("6") else "original first")
        assert torch.equal(result.latent("7"), baseline), f"original sampler differs ({orders[-1]})"
        assert torch.equal(result.latent("5"), ref_latent), f"MagCache sampler differs ({orders[-1]})"
        assert run["sampler_node_id"] == "4" and pattern(run) == pattern(ref_run)
    assert sorted(orders) == ["MagCache first", "original first"], f"both orders should have run: {orders}"


@pytest.mark.parametrize("first,second", [
    pytest.param((TEACACHE, "Apply TeaCache"), (APPLY, "Apply MagCache"), id="teacache-then-magcache"),
    pytest.param((APPLY, "Apply MagCache"), (TEACACHE, "Apply TeaCache"), id="magcache-then-teacache"),
    pytest.param((APPLY, "Apply MagCache"), (APPLY, "Apply MagCache"), id="magcache-twice"),
])
def test_two_caches_on_one_model_fail_clearly_and_the_next_prompt_is_clean(comfy, reference, baseline, first,
                                                                          second):
    ref_latent, ref_run = reference
    specs = {APPLY: magcache(), TEACACHE: teacache()}
    chained = tiny_wan_graph([specs[first[0]], specs[second[0]]], steps=STEPS, nonce=fresh_nonce())
    assert chained.prompt()["11"]["inputs"]["model"] == ["10", 0]
    result = comfy.run(chained.prompt(), check=False)
    assert_conflict(result, "11", second[0], second[1], first[1], "10")
    assert runs_of(comfy, result) == []  # no sampling run started

    # the next prompts run clean: the plain model gives the baseline, Apply MagCache behaves as before
    assert torch.equal(comfy.run(tiny_wan_graph(steps=STEPS, nonce=fresh_nonce()).prompt()).latent(), baseline)
    again = comfy.run(tiny_wan_graph([magcache()], steps=STEPS, nonce=fresh_nonce()).prompt())
    assert pattern(only_run(comfy, again)) == pattern(ref_run)
    assert torch.equal(again.latent(), ref_latent)


def test_wan22_two_experts_each_count_their_own_segment(comfy, baseline):
    """The Wan 2.2 A14B example's layout on the tiny model: two loaders, each through its own Apply MagCache with
    the '(high noise)' / '(low noise)' part of the official curve, two KSamplerAdvanced splitting the steps. Each
    sampler's run counts its own segment from 0 and retains its own first steps."""
    steps, switch = STEPS, STEPS // 2
    wan = tiny_wan_graph(steps=steps, nonce=fresh_nonce())
    prompt = wan.prompt()
    del prompt["4"], prompt["5"]
    common = dict(cfg=2.0, sampler_name="euler", scheduler="simple", positive=["2", 0], negative=["2", 0],
                  noise_seed=1, steps=steps)
    prompt |= {
        "20": {"class_type": "UNETLoader", "inputs": {"unet_name": TINY_WAN_NAME, "weight_dtype": "default"}},
        "21": {"class_type": "UNETLoader", "inputs": {"unet_name": TINY_WAN_NAME, "weight_dtype": "default"}},
        "22": {"class_type": APPLY, "inputs": {**magcache(0.06, "wan2.2_t2v_14B (high noise)")[1],
                                               "model": ["20", 0]}},
        "23": {"class_type": APPLY, "inputs": {**magcache(0.06, "wan2.2_t2v_14B (low noise)")[1],
                                               "model": ["21", 0]}},
        "24": {"class_type": "KSamplerAdvanced", "inputs": {
            **common, "model": ["22", 0], "add_noise": "enable", "latent_image": ["3", 0], "start_at_step": 0,
            "end_at_step": switch, "return_with_leftover_noise": "enable"}},
        "25": {"class_type": "KSamplerAdvanced", "inputs": {
            **common, "model": ["23", 0], "add_noise": "disable", "latent_image": ["24", 0],
            "start_at_step": switch, "end_at_step": 10000, "return_with_leftover_noise": "disable"}},
        "26": {"class_type": "SaveLatent", "inputs": {"samples": ["25", 0], "filename_prefix": unique_prefix("a14b")}},
    }
    del prompt["1"]
    result = comfy.run(prompt)
    high, low = runs_of(comfy, result)
    assert (high["node_id"], high["sampler_node_id"]) == ("22", "24")
    assert (low["node_id"], low["sampler_node_id"]) == ("23", "25")
    assert "wan2.2_t2v_14B (high noise)" in high["summary"]["model"]
    assert "wan2.2_t2v_14B (low noise)" in low["summary"]["model"]
    for run, n in ((high, switch), (low, steps - switch)):
        assert [e["step"] for e in run["evaluations"]] == list(range(n)), run["evaluations"]
        assert {e["total_steps"] for e in run["evaluations"]} == {n}
        retained = int(0.2 * n + 0.5)
        assert all(e["computed"] for e in run["evaluations"][:retained])
        assert {b["reason"] for e in run["evaluations"][:retained] for b in e["branches"]} == {"retention"}
    assert high["summary"]["reused"] > 0, high["summary"]  # the high-noise part stays close to 1
    latent = result.latent()
    assert latent.shape == baseline.shape and torch.isfinite(latent).all()


BAD_FILES = {
    "mag-bad-json": "{not json",
    "mag-bad-ratios": {"kind": "magcache", "family": "wan", "mag_ratios": ["x"]},
    "mag-bad-empty": {"kind": "magcache", "family": "wan", "mag_ratios": {}},
    "mag-bad-odd": {"kind": "magcache", "family": "wan", "layout": "interleaved", "mag_ratios": [1.0, 1.0, 0.9]},
    "mag-bad-flux": {"kind": "magcache", "family": "flux", "mag_ratios": [1.0, 0.95]},
}

BAD_INPUTS = [
    pytest.param(dict(curve="auto"), ("no published MagCache curve fits", "MagCache Calibrate"), id="auto"),
    pytest.param(dict(curve="flux"), ("'flux' is for flux models", "wan"), id="flux-curve-on-wan"),
    pytest.param(dict(curve="no-such-curve"), ("unknown curve",), id="unknown-curve"),
    pytest.param(dict(start_percent=0.8, end_percent=0.2), ("start_percent", "end_percent"), id="window"),
    pytest.param(dict(cache_device="gpu 7"), ("cache_device", "gpu 7"), id="cache-device"),
    pytest.param(dict(curve="calibration: not-there"), ("not-there", "does not exist"), id="missing-file"),
    pytest.param(dict(curve="calibration: mag-bad-json"), ("mag-bad-json.json", "cannot be read"), id="bad-json"),
    pytest.param(dict(curve="calibration: mag-bad-ratios"), ("'mag-bad-ratios'", "no valid 'mag_ratios'"),
                 id="bad-ratios"),
    pytest.param(dict(curve="calibration: mag-bad-empty"), ("'mag-bad-empty'", "empty 'mag_ratios'"), id="empty"),
    pytest.param(dict(curve="calibration: mag-bad-odd"), ("'mag-bad-odd'", "odd length"), id="odd-interleaved"),
    pytest.param(dict(curve="calibration: mag-bad-flux"), ("'mag-bad-flux'", "flux model"), id="other-family"),
]


@pytest.fixture(scope="module")
def bad_files(comfy_server):
    for name, data in BAD_FILES.items():
        write_calibration(comfy_server, name, data)


@pytest.mark.parametrize("inputs,fragments", BAD_INPUTS)
def test_bad_input_is_a_clear_error_naming_the_node(comfy, flat, bad_files, inputs, fragments):
    """An execution error of Apply MagCache, or (a value not among its options, which newer ComfyUI checks at /prompt)
    a rejection naming the node and the input; a file not offered has the reason in the server log."""
    prompt = tiny_wan_graph([(APPLY, magcache()[1] | inputs)], steps=STEPS, nonce=fresh_nonce()).prompt()
    error = comfy.node_error(prompt)
    file = inputs.get("curve", "").removeprefix("calibration: ")
    why = why_not_offered(comfy.server.log_text(), file) if file in BAD_FILES else None
    assert_clear_node_error(error, "10", APPLY, "Apply MagCache", inputs, fragments, why)
    error.assert_nothing_ran_after("4")


@pytest.mark.parametrize("name,value,error_type", [
    ("threshold", -0.5, "value_smaller_than_min"), ("threshold", 1.5, "value_bigger_than_max"),
    ("max_skip_steps", 21, "value_bigger_than_max"), ("retention_ratio", 2.0, "value_bigger_than_max")])
def test_out_of_range_inputs_are_rejected_by_validation(comfy, flat, name, value, error_type):
    with pytest.raises(PromptRejected) as info:
        comfy.queue(tiny_wan_graph([(APPLY, magcache()[1] | {name: value})], steps=STEPS).prompt())
    errors = info.value.node_errors["10"]
    assert errors["class_type"] == APPLY
    assert [(e["type"], e["extra_info"]["input_name"]) for e in errors["errors"]] == [(error_type, name)]


def test_calibrate_name_and_steps_are_validated(comfy):
    prompt = calibrate_prompt("../escape")
    with pytest.raises(PromptRejected) as info:
        comfy.queue(prompt)
    errors = info.value.node_errors["4"]["errors"]
    assert len(errors) == 1 and "MagCache Calibrate" in errors[0]["details"], errors
    assert errors[0]["extra_info"]["input_name"] == "name"
    prompt["4"]["inputs"] |= {"name": "fine name", "steps": 3}  # below the node's minimum of 4 steps
    with pytest.raises(PromptRejected) as info:
        comfy.queue(prompt)
    assert [e["type"] for e in info.value.node_errors["4"]["errors"]] == ["value_smaller_than_min"]


def test_errors_leave_the_server_clean(comfy, reference, baseline):
    """After all the failed prompts above: plain and MagCache runs are unchanged."""
    ref_latent, _ = reference
    assert torch.equal(comfy.run(tiny_wan_graph(steps=STEPS, nonce=fresh_nonce()).prompt()).latent(), baseline)
    assert torch.equal(comfy.run(tiny_wan_graph([magcache()], steps=STEPS, nonce=fresh_nonce()).prompt()).latent(),
                       ref_latent)


def test_calibrate_through_prompt_then_apply_and_it_survives_a_restart(comfy_server, comfy, baseline):
    # keep this test last: it restarts the shared server
    name = f"server-mag-{uuid.uuid4().hex[:8]}"
    option = "calibration: " + name
    assert option not in comfy.object_info(APPLY)["input"]["required"]["curve"][1]["options"]

    result = comfy.run(calibrate_prompt(name, preview=True))
    path = magcache_dir(comfy_server) / f"{name}.json"
    assert path.is_file(), list(magcache_dir(comfy_server).glob("*"))
    data = json.loads(path.read_text())
    assert data["kind"] == "magcache" and data["family"] == "wan" and data["calibrated_steps"] == STEPS
    assert data["sampler"] == {"steps": STEPS, "cfg": 2.0, "sampler_name": "euler", "scheduler": "simple"}
    assert set(data["mag_ratios"]) == {"cond", "uncond"}
    assert all(len(v) == STEPS and v[0] == 1.0 and all(r > 0 for r in v) for v in data["mag_ratios"].values())
    assert any(f"saved {name}.json" in text for text in result.outputs["4"]["text"]), result.outputs
    (shown,) = result.outputs["9"]["text"]  # the curve output, as PreviewAny shows it
    assert json.loads(shown) == data
    assert torch.equal(result.latent("5"), baseline)  # calibration computes every step: a plain run
    (calibration_run,) = runs_of(comfy, result)
    assert calibration_run["summary"]["reused"] == 0 and calibration_run["node_id"] == "4"

    # offered at once: V3 schemas are rebuilt for every /object_info and every /prompt validation
    assert option in comfy.object_info(APPLY)["input"]["required"]["curve"][1]["options"]
    apply = tiny_wan_graph([magcache(0.06, option)], steps=STEPS, nonce=fresh_nonce())
    before = comfy.run(apply.prompt())
    run_before = only_run(comfy, before)
    assert option in run_before["summary"]["model"]
    assert 0 < run_before["summary"]["reused"] < STEPS, run_before["summary"]
    latent_before = before.latent()

    comfy_server.restart()
    assert path.is_file() and json.loads(path.read_text()) == data
    assert option in comfy.object_info(APPLY)["input"]["required"]["curve"][1]["options"]
    after = comfy.run(apply.set_nonce(fresh_nonce()).set_prefix(unique_prefix("mag_after_restart")).prompt())
    run_after = only_run(comfy, after)
    assert pattern(run_after) == pattern(run_before)
    assert torch.equal(after.latent(), latent_before)
    assert torch.equal(comfy.run(tiny_wan_graph(steps=STEPS, nonce=fresh_nonce()).prompt()).latent(), baseline)
