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


def encode(command: Command) -> bytes:
    """A command as bytes of builtins and tensors only (rank 0 and a worker import this pack under other names)."""
    return dumps({"op": command.op, "serial": command.serial, "header": command.header, "payload": command.payload})


def decode(data: bytes) -> Command:
    return Command(**loads(data))


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
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


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


def broadcast_state(module: torch.nn.Module) -> None:
    """Every parameter and buffer of ``module`` broadcast from rank 0 in state-dict order (collective)."""
    with torch.no_grad():
        for tensor in module.state_dict(keep_vars=True).values():
            data = tensor.data
            if dist.get_backend() == "gloo" and data.device.type != "cpu":
                staged = data.cpu()
                dist.broadcast(staged, src=0)
                data.copy_(staged)
            else:
                dist.broadcast(data, src=0)
