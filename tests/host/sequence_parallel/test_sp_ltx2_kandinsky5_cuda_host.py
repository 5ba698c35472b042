"""LTX-2 (video split, audio whole) and Kandinsky 5 on 2 GPUs through the node's group (rank 0 in a ComfyUI process
on cuda:0, a worker on cuda:1 over NCCL), Ulysses and ring each against one GPU, at cfg 1 and the case's cfg > 1.
Needs ComfyUI 0.33 and 2 CUDA devices; skipped otherwise.

ComfyUI picks its device when first imported, and the host tests import it on the CPU: so the run happens in a child
process (this file run as a script), with a timeout that fails the test and leaves nothing behind. The GPUs' kernels
choose by shape, so a rank's shard need not round as the whole sequence does: held to 1e-3 relative, as ring is on
the CPU.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.host, pytest.mark.cuda]

RELATIVE = 1e-3
TIMEOUT_S = 600


@pytest.mark.parametrize("case_name", ["ltxav", "kandinsky5"])
def test_two_gpus_over_nccl_equal_one_gpu(tmp_path, case_name):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, this machine has {torch.cuda.device_count()}")
    from omnitest.comfy_path import comfyui_path, skip_without_comfy_class
    from omnitest.processes import Snapshot, assert_nothing_left

    skip_without_comfy_class("comfy.model_base", "LTXAV" if case_name == "ltxav" else "Kandinsky5")
    before = Snapshot.now()
    report = tmp_path / "report.json"
    env = {**os.environ, "COMFYUI_PATH": str(comfyui_path()), "OMNIHOOKS_SP_COLLECTIVE_TIMEOUT_S": "120"}
    done = subprocess.run([sys.executable, __file__, str(report), case_name], env=env, timeout=TIMEOUT_S,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    for run in json.loads(report.read_text()):
        assert run["backend"] == "nccl" and run["relative"] < RELATIVE, run
    assert_nothing_left(before)


def _run(report: Path, case_name: str) -> None:
    """Rank 0 on cuda:0 in this process: one GPU, then 2 GPUs with Ulysses and with ring, at cfg 1 and cfg > 1."""
    root = Path(__file__).resolve().parents[3]
    sys.path[:0] = [str(root / "tests")]
    from omnitest.comfy_path import use_comfyui_in_process

    use_comfyui_in_process(cpu=False)
    import comfy.model_management
    from omnitest.pack import pack_module, run_node
    from omnitest.sp_families import relative_error
    from omnitest.tiny_models import build_case, sample

    node = pack_module("nodes.sequence_parallel.node")
    group = pack_module("nodes.sequence_parallel.group")
    case = build_case(case_name)
    case.patcher.load_device = comfy.model_management.get_torch_device()
    runs = []
    try:
        for cfg in (1.0, None):
            reference = sample(case, cfg=cfg)
            for ulysses, ring in (("2", "1"), ("1", "2")):
                model = run_node(node.SequenceParallel, node_id="1", model=case.patcher, world_size=2,
                                 ulysses_degree=ulysses, ring_degree=ring, devices="cuda:0,cuda:1", backend="nccl",
                                 master_address="127.0.0.1", master_port=0, cfg_parallel=False)[0]
                got = sample(case, model=model, cfg=cfg)
                runs.append({"cfg": cfg, "degrees": [ulysses, ring], "relative": relative_error(got, reference),
                             "backend": group.active_group().settings.backend})
    finally:
        group.close_group()
    report.write_text(json.dumps(runs))


if __name__ == "__main__":
    _run(Path(sys.argv[1]), sys.argv[2])
