"""The shipped GPU path end to end on 2 GPUs: the node's group (rank 0 in a ComfyUI process on cuda:0, a worker on
cuda:1 over NCCL), the control connection with its proof of the group's secret, a latent larger than a command carries
(broadcast over NCCL), and Ulysses and ring each equal to one process.

ComfyUI picks its device when first imported, and the host tests import it on the CPU: so the run happens in a child
process (this file run as a script), with a timeout that fails the test and leaves nothing behind.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.host, pytest.mark.cuda]

MIN_PSNR_DB = 60.0
TIMEOUT_S = 600
LATENT_SHAPE = (1, 16, 5, 32, 32)  # float32: 320 KiB per latent, over the 256 KiB a command carries


def test_two_gpus_over_nccl_equal_one_gpu_through_the_group_the_control_connection_and_the_broadcast(tmp_path):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, this machine has {torch.cuda.device_count()}")
    from omnitest.comfy_path import comfyui_path
    from omnitest.processes import Snapshot, assert_nothing_left

    before = Snapshot.now()
    report = tmp_path / "report.json"
    env = {**os.environ, "COMFYUI_PATH": str(comfyui_path()), "OMNIHOOKS_SP_COLLECTIVE_TIMEOUT_S": "120"}
    done = subprocess.run([sys.executable, __file__, str(report)], env=env, timeout=TIMEOUT_S,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    got = json.loads(report.read_text())
    assert got["latent_bytes"] > got["broadcast_bytes"]
    for mode in ("ulysses", "ring"):
        run = got[mode]
        assert run["degrees"] == ([2, 1, 1] if mode == "ulysses" else [1, 2, 1]), run
        assert run["psnr_db"] >= MIN_PSNR_DB, run
        assert run["backend"] == "nccl" and run["control_ranks"] == [1], run
        assert run["broadcast_calls"] > 0, run  # the call's latent went by NCCL broadcast, not in the command
    assert_nothing_left(before)


def _run(report: Path) -> None:
    """Rank 0 on cuda:0 in this process: one GPU, then 2 GPUs with Ulysses and with ring; the numbers to ``report``."""
    root = Path(__file__).resolve().parents[3]
    sys.path[:0] = [str(root / "tests")]
    from omnitest.comfy_path import use_comfyui_in_process

    use_comfyui_in_process(cpu=False)
    import comfy.model_management
    from omnitest.pack import pack_module, run_node
    from omnitest.quality import psnr_db
    from omnitest.tiny_models import build_case, sample

    node = pack_module("nodes.sequence_parallel.node")
    group = pack_module("nodes.sequence_parallel.group")
    protocol = pack_module("nodes.sequence_parallel.protocol")
    case = build_case("wan21_t2v", unet_overrides={"num_heads": 2}, latent_shape=LATENT_SHAPE)
    case.patcher.load_device = comfy.model_management.get_torch_device()
    broadcasts = [0]
    encode = group.encode

    def counting_encode(command):
        data, broadcast = encode(command)
        if command.op == "call" and broadcast:
            broadcasts[0] += 1
        return data, broadcast

    group.encode = counting_encode
    result = {"latent_bytes": case.latent.numel() * case.latent.element_size(),
              "broadcast_bytes": protocol.BROADCAST_BYTES}
    try:
        reference = sample(case)
        for mode, (ulysses, ring) in (("ulysses", ("2", "1")), ("ring", ("1", "2"))):
            broadcasts[0] = 0
            model = run_node(node.SequenceParallel, node_id="1", model=case.patcher, world_size=2,
                             ulysses_degree=ulysses, ring_degree=ring, devices="cuda:0,cuda:1", backend="nccl",
                             master_address="127.0.0.1", master_port=0, cfg_parallel=False)[0]
            got = sample(case, model=model)
            active = group.active_group()
            result[mode] = {"psnr_db": psnr_db(got, reference), "degrees": list(active._meshes)[-1],
                            "backend": active.settings.backend, "control_ranks": sorted(active.control.links),
                            "broadcast_calls": broadcasts[0]}
    finally:
        group.close_group()
    report.write_text(json.dumps(result))


if __name__ == "__main__":
    _run(Path(sys.argv[1]))
