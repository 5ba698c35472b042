"""What rank 0 (the ComfyUI process) and its sequence-parallel workers say to each other, and how a rank joins.

Control goes through the rendezvous ``TCPStore`` (never times out while a worker idles between prompts): rank 0 puts
command ``n`` under ``cmd/<n>``; every worker checks its header (op, call counter, plan id, tensor shapes) and answers
``ack/<n>/<rank>`` ("ok" or its error) BEFORE any collective, so a mismatch is an error on rank 0, never a hang.
Tensors (weights, forwards) then go through torch.distributed collectives, whose process-group timeout bounds every
wait. Nothing here imports ComfyUI.
"""
from __future__ import annotations

import datetime
import io
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

STORE_PREFIX = "omnihooks_sp/"
#: a rank that has not joined within this long fails the start (remote ranks are started by hand)
JOIN_TIMEOUT_S = 120.0
#: a collective (weights, one forward's exchanges) waiting longer than this raises on every rank still alive
COLLECTIVE_TIMEOUT_S = 60.0
#: how long rank 0 waits for every worker to accept a command
ACK_TIMEOUT_S = 30.0
POLL_S = 0.5
#: stands for the call's transformer_options in the arguments sent (the options travel separately, filtered)
OPTIONS_SLOT = "<omnihooks transformer_options>"


class SequenceParallelError(RuntimeError):
    """A sequence-parallel group failed (a rank died, hung, refused a command or raised)."""


@dataclass(frozen=True)
class Command:
    """One message from rank 0. ``op``: "mesh", "load", "call" or "exit"; ``serial``: its number (1, 2, ...);
    ``header``: what every worker checks before any collective; ``payload``: the op's data (pickled with tensors on
    CPU)."""

    op: str
    serial: int
    header: dict
    payload: Any = None


# This pack's import name in this process: ComfyUI imports it under its folder's name, a worker under another one.
PACKAGE = __name__.rsplit(".nodes.", 1)[0]


def encode(command: Command) -> bytes:
    """A command as bytes. Objects of this pack (a feature's settings) are pickled under this process's package name,
    which travels with them so the receiver maps it to its own (``decode``)."""
    body = dumps({"op": command.op, "serial": command.serial, "header": command.header, "payload": command.payload})
    return dumps({"package": PACKAGE, "body": body})


def decode(data: bytes) -> Command:
    outer = loads(data)
    return Command(**loads(outer["body"], rename=(outer["package"], PACKAGE)))


def wait_for(store: dist.Store, key: str, poll_s: float) -> bool:
    """True once ``key`` is in ``store``; False after ``poll_s`` without it (quietly, unlike ``store.wait``)."""
    import time

    deadline = time.monotonic() + poll_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def dumps(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


class _RenamingUnpickler(pickle.Unpickler):
    def __init__(self, file, rename: tuple[str, str]):
        super().__init__(file)
        self.sender, self.receiver = rename

    def find_class(self, module: str, name: str):
        if module == self.sender or module.startswith(self.sender + "."):
            module = self.receiver + module[len(self.sender):]
        return super().find_class(module, name)


def loads(data: bytes, rename: tuple[str, str] | None = None) -> Any:
    """``pickle.loads``; ``rename=(sender's package, ours)`` maps the sender's import name of this pack to ours."""
    if rename is None or rename[0] == rename[1]:
        return pickle.loads(data)
    return _RenamingUnpickler(io.BytesIO(data), rename).load()


def to_cpu(value: Any) -> Any:
    """``value`` with every tensor (in lists, tuples, dicts) moved to the CPU, for sending."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    return value


def to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def tensor_signature(value: Any) -> list:
    """Shapes and dtypes of every tensor in ``value``, in order: part of a call's header."""
    if isinstance(value, torch.Tensor):
        return [(tuple(value.shape), str(value.dtype))]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in tensor_signature(v)]
    if isinstance(value, dict):
        return [s for k in sorted(value, key=str) for s in tensor_signature(value[k])]
    return []


def check_picklable(options: dict, where: str) -> None:
    """ValueError naming each transformer option that cannot be sent to the other ranks."""
    for key, value in options.items():
        try:
            pickle.dumps(value)
        except Exception as exc:
            raise ValueError(
                f"{where}: transformer option {key!r} ({type(value).__name__}) cannot be sent to the other ranks "
                f"({exc}); another node put a Python object there. Remove that node from this model, or run without "
                "Sequence Parallel") from None


def join_group(store: dist.Store, rank: int, world_size: int, backend: str) -> dist.PrefixStore:
    """Join the default process group through ``store`` (rank 0 hosts it); returns the command store."""
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return dist.PrefixStore(STORE_PREFIX, store)


def connect_store(host: str, port: int) -> dist.Store:
    """A client of rank 0's rendezvous store (waits up to ``JOIN_TIMEOUT_S`` for it)."""
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))


def broadcast_tensors(tensors: list[torch.Tensor], device: torch.device | None = None) -> None:
    """Broadcast each tensor from rank 0 into the same-shaped tensor on every other rank, in order (collective).

    ``device``: where the backend exchanges (None: CPU for gloo, the current CUDA device for NCCL); a tensor held
    elsewhere is staged through it."""
    if device is None:
        device = torch.device("cpu") if dist.get_backend() == "gloo" else torch.device("cuda", torch.cuda.current_device())
    with torch.no_grad():
        for tensor in tensors:
            data = tensor.data
            if data.device == device:
                dist.broadcast(data, src=0)
            else:
                staged = data.to(device)
                dist.broadcast(staged, src=0)
                data.copy_(staged)
