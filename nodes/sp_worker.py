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


class Worker:
    """One worker rank's state: the model, its sequence-parallel runtime and the meshes."""

    def __init__(self, args: argparse.Namespace):
        import torch

        self.args = args
        self.device = torch.device(args.device)
        self.base_model = None
        self.family = None
        self.plan = None
        self.runtime = None
        self.applied_for = None
        self.meshes = {}
        self.weights_serial = None

    # each op: prepare (before the ack: may refuse) then run (collectives)

    def prepare(self, command) -> None:
        if command.op == "load":
            self._build(command)
        elif command.op == "call":
            args, kwargs, options = command.payload
            from .sp_protocol import tensor_signature

            if tensor_signature((args, kwargs)) != command.header["signature"]:
                raise ValueError("Sequence Parallel worker: the call's tensors do not match its header")
            if self.base_model is None or command.header["weights"] != self.weights_serial:
                raise ValueError("Sequence Parallel worker: no model loaded for this call")

    def run(self, command) -> None:
        import torch

        from .sp_protocol import OPTIONS_SLOT
        from ..omni_hooks.sequence_parallel import (SequenceParallelConfig, SequenceParallelMesh,
                                                    apply_sequence_parallel, remove_sequence_parallel)
        from .sp_protocol import broadcast_state, to_device

        if command.op == "mesh":
            config = SequenceParallelConfig(command.header["ulysses"], command.header["ring"], command.header["cfg"])
            key = (config.ulysses_degree, config.ring_degree, config.cfg_degree)
            self.meshes[key] = SequenceParallelMesh.from_config(config)
        elif command.op == "load":
            broadcast_state(self.base_model.diffusion_model)
            self.weights_serial = command.serial
        elif command.op == "call":
            degrees = command.header["degrees"]
            dm = self.base_model.diffusion_model
            if self.applied_for != degrees:
                if self.plan is not None:
                    remove_sequence_parallel(dm, self.plan)
                    self.plan = None
                plan = self.family.sequence_plan(dm)
                config = SequenceParallelConfig(*degrees)
                self.runtime = apply_sequence_parallel(dm, config, plan, mesh=self.meshes[tuple(degrees)])
                self.plan, self.applied_for = plan, degrees
            args, kwargs, options = to_device(command.payload, self.device)
            options = dict(options, optimized_attention_override=self.runtime.attention)
            args = tuple(options if a == OPTIONS_SLOT else a for a in args)
            kwargs = {k: options if v == OPTIONS_SLOT else v for k, v in kwargs.items()}
            self.runtime.reset()
            with torch.inference_mode():
                dm.forward(*args, **kwargs)

    def _build(self, command) -> None:
        import comfy.model_management  # noqa: F401

        from .families import family_named

        payload = command.payload
        if self.plan is not None and self.base_model is not None:
            from ..omni_hooks.sequence_parallel import remove_sequence_parallel

            remove_sequence_parallel(self.base_model.diffusion_model, self.plan)
        self.plan, self.applied_for, self.base_model = None, None, None
        module, qualname = payload["config_class"]
        config = getattr(importlib.import_module(module), qualname)(payload["unet_config"])
        config.set_inference_dtype(payload["unet_dtype"], payload["manual_cast_dtype"])
        base_model = config.get_model({}, "", device=self.device)
        base_model.diffusion_model.to(self.device)
        names = [(name, tuple(t.shape), str(t.dtype)) for name, t in base_model.diffusion_model.state_dict().items()]
        if names != command.header["names"]:
            raise ValueError("Sequence Parallel worker: the model built from the config has other weights than rank "
                             "0's (the two ComfyUI versions differ?)")
        self.family = family_named(payload["family"])
        self.base_model = base_model.eval()


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
    worker = Worker(args)
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
                worker.run(command)
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
