"""Smoke tests against a real ComfyUI server: the pack imports, the tiny Wan workflow runs through /prompt and is
deterministic, bad graphs are rejected cleanly, interrupts work, and the server survives a restart."""
from __future__ import annotations

import json
import time

import pytest
import torch

from omnitest.graphs import fresh_nonce, tiny_wan_graph, unique_prefix
from omnitest.server import PACK_DIR_NAME, TEST_PACK_DIR_NAME, PromptRejected

pytestmark = pytest.mark.server

LATENT_SHAPE = (1, 16, 1, 8, 8)


def _check_pack_imported(server) -> None:
    log = server.log_text()
    pack_path = str(server.custom_nodes_dir / PACK_DIR_NAME)
    bad = [line for line in log.splitlines()
           if ("IMPORT FAILED" in line or "Cannot import" in line) and PACK_DIR_NAME in line]
    assert not bad, "pack import failed:\n" + "\n".join(bad) + "\n--- log tail ---\n" + server.log_tail()
    times = server.import_times()
    assert pack_path in times, f"{pack_path} not in the custom-node import times {times}\n{server.log_tail()}"
    assert times[pack_path][1] is False
    test_pack = str(server.custom_nodes_dir / TEST_PACK_DIR_NAME)
    assert times.get(test_pack, (0, True))[1] is False, f"test pack not imported: {times}"


PACK_NODES = {"OmniHooks.ApplyTeaCache", "OmniHooks.TeaCacheCalibrate", "OmniHooks.ApplyMagCache",
              "OmniHooks.MagCacheCalibrate", "OmniHooks.CPUOffload",
              "OmniHooks.SequenceParallel"}
# What ComfyUI 0.3.64's loader logs when a pack loads only partly (nodes.py load_custom_node, comfy_config parsing)
LOADER_WARNINGS = ("Error while calling comfy_entrypoint", "did not return a ComfyExtension",
                   "did not return a list of nodes", "Unable to parse pyproject.toml", "Skip ", "is not callable",
                   "already registered")


def test_pack_imports_cleanly(comfy_server, comfy):
    _check_pack_imported(comfy_server)
    log = comfy_server.log_text()
    assert not [line for line in log.splitlines() if any(w in line for w in LOADER_WARNINGS)], log
    assert PACK_NODES <= set(comfy.object_info())
    assert comfy.get("/omni_hooks/runs").status_code == 200 and comfy.get("/api/omni_hooks/runs").status_code == 200
    assert "/extensions/ComfyUI-OmniHooks/omni_hooks_stats.js" in comfy.get_json("/extensions")
    # the test-only nodes are registered (proves the custom_nodes links and V1 loading work)
    info = comfy.object_info("OmniTest.ZeroConditioning")
    assert set(info["input"]["required"]) == {"tokens", "dim", "pooled_dim"}
    assert info["output"] == ["CONDITIONING"]


def test_tiny_wan_runs_and_is_deterministic(comfy):
    wan = tiny_wan_graph(prefix=unique_prefix("smoke"), nonce=fresh_nonce())
    t0 = time.monotonic()
    first = comfy.run(wan.prompt())
    elapsed = time.monotonic() - t0
    assert first.status == "success"
    assert "4" in first.executed_nodes, first.types  # the sampler really ran
    for event in ("execution_start", "executing", "execution_success"):
        assert event in first.types
    a = first.latent()
    assert tuple(a.shape) == LATENT_SHAPE and a.dtype == torch.float32
    assert torch.isfinite(a).all()
    assert a.std() > 0.1, "tiny Wan output is (nearly) constant"
    assert elapsed < 60

    # same graph, other prefix: ComfyUI serves the sampler from its cache, the saved latent is the same
    cached = comfy.run(wan.set_prefix(unique_prefix("smoke_cached")).prompt())
    assert "4" in cached.cached_nodes and "4" not in cached.executed_nodes
    assert torch.equal(cached.latent(), a)

    # a new nonce forces the sampler to run again: bit-identical result
    rerun = comfy.run(wan.set_prefix(unique_prefix("smoke_rerun")).set_nonce(fresh_nonce()).prompt())
    assert "4" in rerun.executed_nodes and "4" not in rerun.cached_nodes
    assert rerun.output_files()[0]["filename"] != first.output_files()[0]["filename"]
    assert torch.equal(rerun.latent(), a)


def test_patch_chain_and_original_sampler_in_one_prompt(comfy):
    plain = comfy.run(tiny_wan_graph(seed=7, nonce=fresh_nonce()).prompt()).latent()
    wan = tiny_wan_graph([("ModelSamplingSD3", {"shift": 3.0})], seed=7, compare_original=True, nonce=fresh_nonce())
    assert wan.prompt()["10"]["inputs"]["model"] == ["1", 0] and wan.prompt()["4"]["inputs"]["model"] == ["10", 0]
    result = comfy.run(wan.prompt())
    patched, original = result.latent("5"), result.latent("7")
    assert torch.isfinite(patched).all() and not torch.equal(patched, original)
    assert torch.equal(original, plain)  # the patch did not touch the model the other sampler uses


def test_bad_graph_is_rejected_and_server_keeps_working(comfy):
    bad = tiny_wan_graph().prompt()
    bad["4"]["inputs"]["cfg"] = "not a number"
    with pytest.raises(PromptRejected) as info:
        comfy.queue(bad)
    err = info.value
    assert err.status == 400
    assert err.error["type"] == "prompt_outputs_failed_validation"
    assert "4" in err.node_errors and err.node_errors["4"]["class_type"] == "KSampler"
    assert err.node_errors["4"]["errors"][0]["extra_info"]["input_name"] == "cfg"

    unknown = tiny_wan_graph().prompt()
    unknown["99"] = {"class_type": "OmniTest.DoesNotExist", "inputs": {}}
    with pytest.raises(PromptRejected) as info:
        comfy.queue(unknown)
    error = info.value.error  # newer ComfyUI: its own type, naming the node and its class
    assert error["type"] in ("invalid_prompt", "missing_node_type"), error
    assert "OmniTest.DoesNotExist" in json.dumps(error), error

    good = comfy.run(tiny_wan_graph(nonce=fresh_nonce()).prompt())
    assert tuple(good.latent().shape) == LATENT_SHAPE


def test_interrupt_stops_a_running_prompt(comfy):
    wan = tiny_wan_graph(wait_seconds=60, nonce=fresh_nonce())
    pid = comfy.queue(wan.prompt())
    comfy.wait_for_message(lambda m: m.get("type") == "executing" and (m.get("data") or {}).get("node") == "8"
                           and m["data"].get("prompt_id") == pid, timeout=60)
    t0 = time.monotonic()
    comfy.interrupt()
    result = comfy.wait(pid, timeout=30)
    assert result.status == "interrupted", result.types
    assert time.monotonic() - t0 < 10
    assert not result.output_files()
    assert comfy.run(tiny_wan_graph(nonce=fresh_nonce()).prompt()).ok


def test_restart_keeps_base_dir_and_port(comfy_server, comfy):
    # keep this test last in the module: it restarts the shared server (~10-15 s)
    before = comfy.run(tiny_wan_graph(seed=3, nonce=fresh_nonce()).prompt())
    path = comfy_server.output_dir / before.output_files()[0]["subfolder"] / before.output_files()[0]["filename"]
    assert path.is_file()
    port, starts = comfy_server.port, comfy_server.starts
    comfy_server.restart()
    assert comfy_server.port == port and comfy_server.starts == starts + 1
    assert path.is_file()
    _check_pack_imported(comfy_server)
    after = comfy.run(tiny_wan_graph(seed=3).prompt())  # the client reconnects its websocket by itself
    assert torch.equal(after.latent(), comfy.read_latent(path))
