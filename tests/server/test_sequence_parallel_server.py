"""Sequence Parallel end to end through a real CPU ComfyUI server: 2 gloo ranks, the ComfyUI process being rank 0
and the pack starting rank 1.

* the tiny Wan with 2 heads (Ulysses) and with 1 head (ring) gives the one-process latent within float32 tolerance,
  while the original MODEL sampled in the same prompt is untouched;
* with Apply TeaCache the skip count equals the one-process run's, and the run's entry says 2 devices;
* a worker killed mid-run is a clear execution error, and the next prompt passes;
* no worker outlives the server.

A rank started by hand with torchrun joins through the group, with the secret, in
tests/host/sequence_parallel/test_sp_faults_host.py: on loopback, where these tests stay (the node itself accepts
remote ranks only at a master_address other than loopback, checked in test_sp_node_inputs_host.py).
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from omnitest.graphs import fresh_nonce, tiny_wan_graph
from omnitest.quality import psnr_db

pytestmark = pytest.mark.server

SEQUENCE_PARALLEL = "OmniHooks.SequenceParallel"
TEACACHE = "OmniHooks.ApplyTeaCache"
MIN_PSNR_DB = 60.0
STEPS = 6
IDENTITY = "sp-server-identity"
TWO_HEADS = "tiny_wan_2_heads.safetensors"  # ComfyUI reads Wan's head count as dim // 128


def sequence_parallel(world_size: int = 2, **inputs):
    return (SEQUENCE_PARALLEL, dict(dict(world_size=world_size, ulysses_degree="auto", ring_degree="auto",
                                         devices="auto", backend="auto", master_address="127.0.0.1",
                                         master_port=0, cfg_parallel=False), **inputs))


def teacache():
    return (TEACACHE, dict(rel_l1_thresh=1.0, start_percent=0.0, end_percent=1.0, cache_device="compute device",
                           model_variant="calibration: " + IDENTITY))


@pytest.fixture(scope="module")
def models(comfy_server) -> None:
    from omnitest.tiny_wan import write_tiny_wan

    path = comfy_server.models_dir / "diffusion_models" / TWO_HEADS
    if not path.is_file():
        write_tiny_wan(path, num_blocks=2, dim=256, ffn_dim=256)
    calibration = comfy_server.base_dir / "user" / "omni_hooks" / "teacache" / f"{IDENTITY}.json"
    calibration.parent.mkdir(parents=True, exist_ok=True)
    calibration.write_text(json.dumps({"kind": "teacache", "family": "wan", "signal": "default",
                                       "coefficients": [0, 0, 0, 1, 0]}))


def worker_pids(server) -> list[int]:
    """The pack's worker processes under the server (their command line names nodes/sequence_parallel/worker.py)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == server.proc.pid and "sequence_parallel/worker.py" in cmdline:
            pids.append(int(entry.name))
    return pids


@pytest.mark.parametrize("unet_name", [TWO_HEADS, "tiny_wan.safetensors"], ids=["ulysses", "ring"])
def test_two_ranks_give_the_one_process_latent_and_leave_the_original_model_alone(comfy, comfy_server, models,
                                                                                   unet_name):
    baseline = comfy.run(tiny_wan_graph(steps=STEPS, unet_name=unet_name, nonce=fresh_nonce()).prompt()).latent()
    graph = tiny_wan_graph([sequence_parallel()], steps=STEPS, unet_name=unet_name, compare_original=True,
                           nonce=fresh_nonce())
    result = comfy.run(graph.prompt(), timeout=240)
    assert psnr_db(result.latent("5"), baseline) >= MIN_PSNR_DB
    assert torch.equal(result.latent("7"), baseline)  # the loader's MODEL, sampled in the same prompt
    assert len(worker_pids(comfy_server)) == 1  # rank 1, kept for the next prompt
    # the run without a cache has its own entry: the Sequence Parallel node's, with its card (the original has none)
    (entry,) = comfy.get_json("/omni_hooks/runs", {"prompt_id": result.prompt_id})["runs"]
    assert (entry["kind"], entry["node_id"], entry["sampler_node_id"], entry["status"], entry["summary"],
            entry["world_size"]) == ("sequence_parallel", "10", "4", "success", None, 2)
    (card,) = entry["features"]
    assert card["node_id"] == "10" and card["summary"]["world_size"] == 2 and card["summary"]["calls"] > 0
    assert card["headline"].startswith("2 devices (ulysses "), card["headline"]


def test_with_apply_teacache_the_skips_equal_one_process_and_the_run_says_two_devices(comfy, comfy_server, models):
    alone = comfy.run(tiny_wan_graph([teacache()], steps=STEPS, unet_name=TWO_HEADS, nonce=fresh_nonce()).prompt())
    (alone_run,) = comfy.get_json("/omni_hooks/runs", {"prompt_id": alone.prompt_id})["runs"]
    assert alone_run["summary"]["reused"] > 0  # TeaCache really skips here
    both = comfy.run(tiny_wan_graph([sequence_parallel(), teacache()], steps=STEPS, unet_name=TWO_HEADS,
                                    nonce=fresh_nonce()).prompt(), timeout=240)
    (run,) = comfy.get_json("/omni_hooks/runs", {"prompt_id": both.prompt_id})["runs"]
    assert run["summary"]["reused"] == alone_run["summary"]["reused"]
    assert run["summary"]["computed"] == alone_run["summary"]["computed"]
    assert psnr_db(both.latent(), alone.latent()) >= MIN_PSNR_DB
    assert run["world_size"] == 2
    (parallel,) = run["features"]
    assert parallel["kind"] == "sequence_parallel" and parallel["node_id"] == "10"
    assert parallel["summary"]["ulysses_degree"] == 2 and parallel["summary"]["ring_degree"] == 1


def test_a_worker_killed_mid_run_is_a_clear_error_and_the_next_prompt_passes(comfy, comfy_server, models):
    baseline = comfy.run(tiny_wan_graph(steps=STEPS, nonce=fresh_nonce()).prompt()).latent()
    comfy.run(tiny_wan_graph([sequence_parallel()], steps=2, nonce=fresh_nonce()).prompt(), timeout=240)
    (worker,) = worker_pids(comfy_server)
    long_run = tiny_wan_graph([sequence_parallel()], steps=400, nonce=fresh_nonce())
    prompt_id = comfy.queue(long_run.prompt())

    def kill_after_two_steps():
        comfy.wait_for_message(lambda m: m.get("type") == "progress" and m["data"].get("prompt_id") == prompt_id
                               and m["data"].get("value", 0) >= 2, timeout=120)
        os.kill(worker, signal.SIGKILL)

    killer = threading.Thread(target=kill_after_two_steps, daemon=True)
    killer.start()
    started = time.monotonic()
    result = comfy.wait(prompt_id, timeout=240)
    killer.join(timeout=5)
    assert result.status == "error", result.types
    message = result.error["exception_message"]
    assert "Sequence Parallel" in message and "rank 1" in message, message
    assert time.monotonic() - started < 200
    again = comfy.run(tiny_wan_graph([sequence_parallel()], steps=STEPS, nonce=fresh_nonce()).prompt(), timeout=240)
    assert psnr_db(again.latent(), baseline) >= MIN_PSNR_DB
    (respawned,) = worker_pids(comfy_server)
    assert respawned != worker


def test_no_worker_outlives_the_server(comfy, comfy_server, models):
    comfy.run(tiny_wan_graph([sequence_parallel()], steps=2, nonce=fresh_nonce()).prompt(), timeout=240)
    workers = worker_pids(comfy_server)
    assert len(workers) == 1
    comfy.close()
    comfy_server.stop()
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers)
    comfy_server.ensure_running()  # for the tests after this module
