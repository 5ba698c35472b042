"""A sequence-parallel worker rank: joins rank 0's group, builds the diffusion model from its config, receives its
weights and runs every model call on its shard.

Started by the pack for local devices, or by hand on another machine (README, "Sequence Parallel on several
machines")::

    python <pack>/nodes/sp_worker.py --comfyui <ComfyUI folder> --master <rank-0 address>:<port> \\
        --rank 1 --world-size 2 --backend nccl --device cuda:0

``--master``, ``--rank`` and ``--world-size`` default to torchrun's environment variables (MASTER_ADDR, MASTER_PORT,
RANK, WORLD_SIZE). The worker needs ComfyUI's code, never the checkpoint file.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import os
import sys
import traceback
from pathlib import Path

PACKAGE = "omnihooks_sp_worker_pack"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    master = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}" if "MASTER_ADDR" in env and "MASTER_PORT" in env else None
    parser.add_argument("--master", default=master, required=master is None, help="rank 0's address:port")
    parser.add_argument("--rank", type=int, default=int(env["RANK"]) if "RANK" in env else None,
                        required="RANK" not in env)
    parser.add_argument("--world-size", type=int, default=int(env["WORLD_SIZE"]) if "WORLD_SIZE" in env else None,
                        required="WORLD_SIZE" not in env)
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--device", default="cpu", help="this rank's device: cpu, cuda:0, ...")
    parser.add_argument("--comfyui", default=env.get("COMFYUI_PATH", "."), help="the ComfyUI folder (its code)")
    parser.add_argument("--parent-pid", type=int, default=None, help="(local workers) exit when this process is gone")
    return parser.parse_args(argv)


def _load_pack():
    """Import this pack as a package from its folder (as ComfyUI does), after ComfyUI is importable."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location(PACKAGE, root / "__init__.py", submodule_search_locations=[str(root)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = module
    spec.loader.exec_module(module)
    return module


def _parent_gone(parent_pid: int | None) -> bool:
    if parent_pid is None:
        return False
    try:
        os.kill(parent_pid, 0)
        return False
    except OSError:
        return True


def serve(args: argparse.Namespace) -> int:
    """Join the group and run commands until "exit", rank 0's death, or a failed collective."""
    import torch
    import torch.distributed as dist

    from .sp_protocol import POLL_S, connect_store, decode, dumps, join_group, wait_for

    torch.set_num_threads(max(1, torch.get_num_threads()))
    host, port = args.master.rsplit(":", 1)
    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device))
    commands = join_group(connect_store(host, int(port)), args.rank, args.world_size, args.backend)
    from .sp_rank import Worker

    worker = Worker(args.device)
    serial = 0
    try:
        while True:
            serial += 1
            key = f"cmd/{serial}"
            while not wait_for(commands, key, POLL_S):
                if _parent_gone(args.parent_pid):
                    return 1
            command = decode(commands.get(key))
            try:
                if command.serial != serial or command.header.get("serial") != serial:
                    raise ValueError(f"expected command {serial}, got {command.serial}")
                worker.prepare(command)
            except Exception:
                commands.set(f"ack/{serial}/{args.rank}", traceback.format_exc())
                continue
            commands.set(f"ack/{serial}/{args.rank}", "ok")
            if command.op == "exit":
                return 0
            try:
                worker.execute(command)
            except Exception:
                commands.set(f"error/{args.rank}", dumps(traceback.format_exc()))
                traceback.print_exc()
                return 2  # a collective failed: the group is broken, rank 0 restarts it
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = str(Path(args.comfyui).resolve())
    if root in sys.path:
        sys.path.remove(root)
    sys.path.insert(0, root)
    from comfy.cli_args import args as comfy_args

    comfy_args.cpu = not args.device.startswith("cuda")
    import comfy.model_management  # noqa: F401  (picks its device at import)

    pack = _load_pack()
    return importlib.import_module(f"{pack.__name__}.nodes.sp_worker").serve(args)


if __name__ == "__main__":
    sys.exit(main())
