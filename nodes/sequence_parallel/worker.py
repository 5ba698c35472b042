"""A sequence-parallel worker rank: joins rank 0's group, builds the diffusion model from its config, receives its
weights and runs every model call on its shard.

The pack starts the workers of the local devices itself. Ranks on other machines (the Sequence Parallel node's ranks
beyond its ``devices``) are started there, K at a time with torchrun
(README, 'Sequence Parallel on several machines')::

    torchrun --nproc-per-node K <pack>/nodes/sequence_parallel/worker.py --join <ComfyUI host>:<port> --first-rank R \
        --world-size N --comfyui <ComfyUI folder>

starts ranks R..R+K-1 (rank R + torchrun's RANK, so ``--nnodes`` works too) on cuda:LOCAL_RANK (cpu without CUDA).
torchrun's own rendezvous (its MASTER_ADDR, RANK, WORLD_SIZE) only places these processes; ComfyUI's group is the one
at ``--join``. One rank without torchrun::

    python <pack>/nodes/sequence_parallel/worker.py --join <ComfyUI host>:<port> --rank R --world-size N --comfyui
    <ComfyUI folder>

Every rank proves it holds the group's secret (README, 'Sequence Parallel on several machines'): a rank started by
hand reads it from ``OMNIHOOKS_SP_SECRET`` or the file ``OMNIHOOKS_SP_SECRET_FILE`` names, set to the same value as
for ComfyUI; the pack's own workers get a fresh one per group from their parent, through their stdin.

The backend and the timeouts come from rank 0. When rank 0 closes its group (a failure, another setting of the node)
the worker joins the next group at the same address by itself, and exits when none starts within the join timeout
(``OMNIHOOKS_SP_JOIN_TIMEOUT_S`` of the worker's environment, default 120 s) or with ``--once``. The worker needs
ComfyUI's code, never the checkpoint file.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from pathlib import Path

PACKAGE = "omnihooks_sp_worker_pack"
AUTO = "auto"


def parse_args(argv: list[str] | None = None, environ: dict | None = None) -> argparse.Namespace:
    """The worker's options; ``rank`` and ``device`` resolved (torchrun's RANK and LOCAL_RANK read from ``environ``)."""
    env = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # not "--master": torchrun's parser reads it, even after the script, as an ambiguous --master-addr/--master-port
    parser.add_argument("--join", required=True, metavar="HOST:PORT", help="rank 0's address and port (the Sequence "
                        "Parallel node's master_address and master_port)")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--rank", type=int, help="this process's rank (plain python, one rank)")
    which.add_argument("--first-rank", type=int, help="under torchrun: the rank of torchrun's rank 0; each process "
                       "is rank FIRST_RANK + RANK")
    parser.add_argument("--world-size", type=int, required=True, help="the Sequence Parallel node's world_size "
                        "(checked against rank 0's)")
    parser.add_argument("--device", default=AUTO, help="this rank's device: cpu, cuda:0, ...; auto: cuda:LOCAL_RANK, "
                        "or cpu without CUDA")
    parser.add_argument("--comfyui", default=env.get("COMFYUI_PATH", "."), help="the ComfyUI folder (its code)")
    parser.add_argument("--once", action="store_true", help="serve one group and exit (default: after rank 0 closes "
                        "a group, wait for its next one at --join, up to the join timeout)")
    parser.add_argument("--secret-from-parent", action="store_true", help="(the pack's own local workers) read the "
                        "group's secret from the first line of stdin, and exit when stdin closes (the parent is gone); "
                        "implies --once")
    args = parser.parse_args(argv)
    if args.rank is None:
        args.rank = args.first_rank + int(env.get("RANK", "0"))
    elif int(env.get("WORLD_SIZE", "1")) > 1:
        parser.error("torchrun starts several processes here: give --first-rank, not --rank")
    if args.device == AUTO:
        import torch

        args.device = f"cuda:{int(env.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu"
    return args


def _load_pack():
    """Import this pack as a package from its folder (as ComfyUI does), after ComfyUI is importable."""
    import importlib.util

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location(PACKAGE, root / "__init__.py", submodule_search_locations=[str(root)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = module
    spec.loader.exec_module(module)
    return module


class _Parent:
    """The local parent's pipe (this process's stdin): the group's secret on its first line, then nothing until the
    parent closes it or exits, which a thread notices (portable: no signal to a process id). Read with ``os.read`` on
    the descriptor: a thread blocked in Python's buffered stdin would hold its lock when the interpreter exits."""

    def __init__(self) -> None:
        import threading

        self._fd = sys.stdin.fileno()
        line = b""
        while not line.endswith(b"\n") and len(line) < 1024:
            chunk = os.read(self._fd, 1)
            if not chunk:
                break
            line += chunk
        try:
            self.secret = bytes.fromhex(line.strip().decode("ascii"))
        except ValueError:
            self.secret = b""
        if len(self.secret) < 16:
            raise SystemExit("Sequence Parallel worker: --secret-from-parent, but stdin did not hold the group's "
                             "secret")
        self.gone = threading.Event()
        threading.Thread(target=self._watch, name="omnihooks-sp-parent", daemon=True).start()

    def _watch(self) -> None:
        try:
            while os.read(self._fd, 4096):
                pass
        except OSError:
            pass
        self.gone.set()


def _secret(args: argparse.Namespace) -> bytes:
    """The group's secret: from the parent's pipe, or the one the user set."""
    parent = getattr(args, "parent", None)
    if parent is not None:
        return parent.secret
    from .trust import SECRET_ENV, SECRET_FILE_ENV, user_secret

    secret = user_secret()
    if secret is None:
        raise SystemExit(f"Sequence Parallel worker: set the group's secret in {SECRET_ENV} (or a file named by "
                         f"{SECRET_FILE_ENV}), the same as for ComfyUI on rank 0's machine "
                         "(README, 'Sequence Parallel on several machines')")
    return secret


def _parent_gone(args: argparse.Namespace) -> bool:
    parent = getattr(args, "parent", None)
    return parent is not None and parent.gone.is_set()


def serve(args: argparse.Namespace) -> int:
    """Serve one group: join it and run commands until "exit" (0), rank 0's or its store's end (1), or a failed
    command (2)."""
    from .protocol import Timeouts, connect_store

    store = connect_store(*_address(args), Timeouts.from_env().join_s)
    return _serve_group(args, store)[0]


def serve_groups(args: argparse.Namespace) -> int:
    """A rank started by hand: serve rank 0's groups one after another (rank 0 closes a group on a failure, another
    setting or its exit) until no new group starts at ``--join`` within the join timeout (this process's
    ``OMNIHOOKS_SP_JOIN_TIMEOUT_S``); then 0."""
    import time

    import torch.distributed as dist

    from .protocol import Timeouts, command_store, connect_store, read_group

    served: str | None = None
    join_s = Timeouts.from_env().join_s
    deadline = time.monotonic() + join_s
    while time.monotonic() < deadline:
        try:
            store = connect_store(*_address(args), max(1.0, deadline - time.monotonic()))
            info, _ = read_group(command_store(store), _secret(args))
        except dist.DistError:  # no rank 0 there (yet, or any more)
            time.sleep(0.5)
            continue
        if info.group_id == served:  # the closed group's store, until rank 0 lets it go
            del store
            time.sleep(0.5)
            continue
        code, served = _serve_group(args, store)
        print(f"Sequence Parallel worker rank {args.rank}: group {served} ended ({code}); waiting up to {join_s:.0f} s "
              "for rank 0's next group", file=sys.stderr)
        deadline = time.monotonic() + join_s
    return 0


def _address(args: argparse.Namespace) -> tuple[str, int]:
    host, port = args.join.rsplit(":", 1)
    return host.strip("[]"), int(port)  # [::1]:port


def _serve_group(args: argparse.Namespace, store) -> tuple[int, str]:
    """Serve the group whose rendezvous ``store`` is: its exit code (as ``serve``) and its id."""
    import torch
    import torch.distributed as dist

    from .control import ControlClient
    from .protocol import Heartbeat, check_rank, command_store, init_group, is_collective_failure, read_group, \
        report_error

    torch.set_num_threads(max(1, torch.get_num_threads()))
    commands = command_store(store)
    info, key = read_group(commands, _secret(args))
    args.backend = info.backend
    if info.backend == "nccl" and not args.device.startswith("cuda"):
        raise SystemExit(f"Sequence Parallel worker rank {args.rank}: rank 0 uses NCCL, which needs a CUDA device; "
                         f"this rank has {args.device}")
    from .rank import WorkerRank  # before the claim: once every rank claimed, rank 0 gives init the collective timeout

    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device))
    worker = WorkerRank(args.device)
    check_rank(args.rank, args.world_size, info)
    control = ControlClient(_address(args)[0], info.control_port, args.rank, info.timeouts.join_s, key)
    heartbeat = Heartbeat(*_address(args), args.rank, info.timeouts.join_s, key)
    try:
        init_group(store, args.rank, info)
        inbox = _Inbox(args, control)
        while True:
            command = inbox.next()
            if command is None:
                return 1, info.group_id
            if command.op == "exit":
                return 0, info.group_id
            if not inbox.answer(command, worker):
                continue
            try:
                worker.execute(command)
            except Exception:
                report_error(commands, args.rank, key, traceback.format_exc())
                traceback.print_exc()
                return 2, info.group_id  # a collective failed: the group is broken, rank 0 closes it
    except (ConnectionError, EOFError) as exc:
        # rank 0 closed the control connection (ComfyUI exited or closed the group)
        print(f"Sequence Parallel worker rank {args.rank}: rank 0 is gone ({exc})", file=sys.stderr)
        return 1, info.group_id
    except Exception as exc:
        if not is_collective_failure(exc):
            raise
        print(f"Sequence Parallel worker rank {args.rank}: rank 0 is gone ({exc})", file=sys.stderr)
        return 1, info.group_id
    finally:
        control.close()
        heartbeat.stop()
        if dist.is_initialized():
            dist.destroy_process_group()


class _Inbox:
    """Where this worker takes rank 0's commands (its control connection) and answers them."""

    def __init__(self, args: argparse.Namespace, control):
        self.args, self.control = args, control
        self.serial = 0  # of the last command taken

    def next(self):
        """The next command (None: the local parent is gone)."""
        from .protocol import decode

        self.serial += 1
        received = self.control.receive(give_up=lambda: _parent_gone(self.args))
        return None if received is None else decode(received[1], self.args.device)

    def answer(self, command, worker) -> bool:
        """Check ``command`` (``worker.prepare``) and answer rank 0; whether it was accepted."""
        error = None
        try:
            if command.serial != self.serial or command.header.get("serial") != self.serial:
                raise ValueError(f"expected command {self.serial}, got {command.serial}")
            worker.prepare(command)
        except Exception:
            error = traceback.format_exc()
        self.control.answer(self.serial, error)
        return error is None


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
    worker_module = importlib.import_module(f"{pack.__name__}.nodes.sequence_parallel.worker")
    args.parent = worker_module._Parent() if args.secret_from_parent else None
    if args.secret_from_parent or args.once:  # the pack's own workers: one group, started again by rank 0
        return worker_module.serve(args)
    return worker_module.serve_groups(args)


if __name__ == "__main__":
    sys.exit(main())
