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
hand reads it from ``OMNIHOOKS_SP_SECRET`` or the file ``OMNIHOOKS_SP_SECRET_FILE`` names (readable by its owner only),
set to the same value as for ComfyUI, with at least 128 bits of entropy; ``python <pack>/nodes/sequence_parallel/
worker.py --new-secret`` prints a new one. The pack's own workers get a fresh one per group from their parent, through
their stdin.

The backend and the timeouts come from rank 0. A worker waiting for a group logs and ignores a record at ``--join``
it cannot read or verify, and waits on. When rank 0 closes its group (a failure, another setting of the node) the
worker joins the next group at the same address by itself, and exits when none starts within the join timeout
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
#: the option that prints a new secret for groups with remote ranks, and nothing else
NEW_SECRET = "--new-secret"


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
    from .trust import SECRET_ENV, SECRET_FILE_ENV, TrustError, user_secret

    try:
        secret = user_secret()
    except TrustError as exc:
        raise SystemExit(str(exc)) from None
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
    command (2); 1 when no group this worker can join is published at ``--join`` within the join timeout."""
    from .protocol import Timeouts

    joined = _await_group(args, None, Timeouts.from_env().join_s)
    return 1 if joined is None else _serve_group(args, *joined)[0]


def serve_groups(args: argparse.Namespace) -> int:
    """A rank started by hand: serve rank 0's groups one after another (rank 0 closes a group on a failure, another
    setting or its exit) until no new group starts at ``--join`` within the join timeout (this process's
    ``OMNIHOOKS_SP_JOIN_TIMEOUT_S``); then 0."""
    from .protocol import Timeouts

    served: str | None = None
    join_s = Timeouts.from_env().join_s
    while True:
        joined = _await_group(args, served, join_s)
        if joined is None:
            return 0
        code, served = _serve_group(args, *joined)
        print(f"Sequence Parallel worker rank {args.rank}: group {served} ended ({code}); waiting up to {join_s:.0f} s "
              "for rank 0's next group", file=sys.stderr)


#: how often a worker waiting for a group looks at ``--join`` again
RETRY_S = 0.5


def _await_group(args: argparse.Namespace, served: str | None, join_s: float):
    """The store, group and key of the first group other than ``served`` that rank 0 publishes at ``--join`` and this
    worker can join, waiting up to ``join_s``; None when none came. A record it cannot read or verify (a stranger's,
    another secret's) is logged once and ignored: the worker goes on waiting."""
    import time

    import torch.distributed as dist

    from .protocol import UnjoinableGroup, command_store, connect_store, group_record, open_group

    deadline = time.monotonic() + join_s
    secret, seen, ignored = _secret(args), None, None
    while time.monotonic() < deadline and not _parent_gone(args):
        try:
            store = connect_store(*_address(args), max(1.0, deadline - time.monotonic()))
            data = group_record(command_store(store))
        except dist.DistError:  # no rank 0 there (yet, or any more)
            time.sleep(RETRY_S)
            continue
        if data != seen:  # else: the record of the group served (until rank 0 lets its store go), or one ignored
            seen = data
            try:
                info, key = open_group(data, secret)
            except UnjoinableGroup as exc:
                ignored = str(exc)
                print(f"Sequence Parallel worker rank {args.rank}: ignored the group record at {args.join}: {exc}; "
                      "waiting for one it can join", file=sys.stderr)
            else:
                if info.group_id != served:
                    return store, info, key
        del store
        time.sleep(RETRY_S)
    print(f"Sequence Parallel worker rank {args.rank}: no group to join at {args.join} within {join_s:.0f} s"
          + (f" (the last record there: {ignored})" if ignored else ""), file=sys.stderr)
    return None


def _address(args: argparse.Namespace) -> tuple[str, int]:
    host, port = args.join.rsplit(":", 1)
    return host.strip("[]"), int(port)  # [::1]:port


def _connect(args: argparse.Namespace, info, key):
    """This rank's control connection to rank 0, tried again while rank 0 closes it before its challenge (too many
    handshakes at once) until the join timeout. RefusedRank when rank 0 refuses the rank."""
    import time

    from .control import ControlClient, RefusedRank

    deadline = time.monotonic() + info.timeouts.join_s
    while True:
        try:
            return ControlClient(_address(args)[0], info.control_port, args.rank, info.timeouts.join_s, key)
        except RefusedRank:
            raise
        except (ConnectionError, OSError):
            if time.monotonic() + RETRY_S >= deadline:
                raise
            time.sleep(RETRY_S)


def _serve_group(args: argparse.Namespace, store, info, key) -> tuple[int, str]:
    """Serve ``info``'s group (``key`` its key), whose rendezvous ``store`` is: its exit code (as ``serve``) and its
    id."""
    import torch
    import torch.distributed as dist

    from .protocol import check_rank, init_group, is_collective_failure

    torch.set_num_threads(max(1, torch.get_num_threads()))
    args.backend = info.backend
    if info.backend == "nccl" and not args.device.startswith("cuda"):
        raise SystemExit(f"Sequence Parallel worker rank {args.rank}: rank 0 uses NCCL, which needs a CUDA device; "
                         f"this rank has {args.device}")
    from .rank import WorkerRank  # before the claim: once every rank claimed, rank 0 gives init the collective timeout

    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device))
    worker = WorkerRank(args.device)
    check_rank(args.rank, args.world_size, info)
    control = _connect(args, info, key)
    control.start_heartbeat()
    try:
        init_group(store, args.rank, info, control.local_address)
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
                try:
                    control.report(traceback.format_exc())
                except OSError:  # rank 0 closed the connection already
                    pass
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
    if (sys.argv[1:] if argv is None else argv) == [NEW_SECRET]:
        import secrets

        print(secrets.token_hex(32))  # 256 bits (trust.check_secret asks for 128), without importing ComfyUI
        return 0
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
