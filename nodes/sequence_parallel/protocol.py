"""What rank 0 (the ComfyUI process) and its sequence-parallel workers say to each other, and how a rank joins.

A command (``Command``: op, serial, header, payload) goes to every worker over its control connection (``control``:
one TCP connection per worker, opened with a proof of the group's secret, ``trust``); each checks its header (op,
serial, plan, tensor shapes) and answers "ok" or its error BEFORE any collective of the command, so a mismatch is an
error on rank 0, never a hang. Tensors (weights) then go through torch.distributed collectives, whose process-group
timeout bounds every wait; a model call's small tensors travel in its command, as raw bytes after its JSON
(``encode``); nothing received is unpickled.

How a rank joins: rank 0 publishes the group (``GroupInfo``: world size, backend, timeouts, the port of its control
connections), signed with the group's key, in the rendezvous ``TCPStore`` under ``group`` before any worker starts;
a worker reads it and checks the signature and the world size it was told (what it cannot read or verify it logs and
ignores, and goes on waiting), claims its rank on its control connection (a rank claimed twice is refused there);
rank 0 waits until every rank has connected (failing fast when a local worker exits, and after the join timeout
naming the ranks missing) and only then does everyone call ``init_process_group``, bound to the network interface of
the group's address (``network``). From then on a worker beats on its control connection (``control``: a signed,
rising count) and a worker whose command fails mid-collective sends its traceback there: with those, rank 0 says
which rank broke a call (``diagnose``). The store holds nothing else of this pack: anyone who reaches it can read,
write and delete its keys.

Nothing here imports ComfyUI.
"""
from __future__ import annotations

import datetime
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import network
from .plain import PlainDataError, bounded_json, dtype_name, dtype_named, from_plain, json_depth, to_plain
from .trust import TrustError, group_key, opened, seal, unseal

log = logging.getLogger("OmniHooks")

STORE_PREFIX = "omnihooks_sp/"
#: ``diagnose`` calls a rank not responding when no fresh heartbeat came from it for this long
STALL_S = 1.5
#: rank 0, waiting for a command's answers, gives up on a worker from which no fresh heartbeat came for this long
#: (longer than ``STALL_S``: this verdict ends the run, so a thread scheduled late on a busy machine must not trigger
#: it)
ANSWER_STALL_S = 3.0


@dataclass(frozen=True)
class Timeouts:
    """How long a group waits, in seconds; each can be set by an environment variable of rank 0's process (workers
    take rank 0's values), e.g. for tests that provoke faults.

    ``join_s`` (``OMNIHOOKS_SP_JOIN_TIMEOUT_S``): every rank has joined within this, or the start fails (remote ranks
    are started by hand). ``collective_s`` (``OMNIHOOKS_SP_COLLECTIVE_TIMEOUT_S``): a collective (weights, one
    forward's exchanges) waiting longer than this raises on every rank still alive: it bounds how long a hung rank
    holds a run. ``ack_s`` (``OMNIHOOKS_SP_ACK_TIMEOUT_S``): every worker answers a command within this (a worker
    that does not, stopped or hung, fails the command).
    """

    join_s: float = 120.0
    collective_s: float = 60.0
    ack_s: float = 30.0

    ENV = {"join_s": "OMNIHOOKS_SP_JOIN_TIMEOUT_S", "collective_s": "OMNIHOOKS_SP_COLLECTIVE_TIMEOUT_S",
           "ack_s": "OMNIHOOKS_SP_ACK_TIMEOUT_S"}

    @classmethod
    def from_env(cls, environ: dict | None = None) -> "Timeouts":
        environ = os.environ if environ is None else environ
        values = {}
        for field_name, variable in cls.ENV.items():
            text = environ.get(variable)
            if text is None:
                continue
            try:
                seconds = float(text)
            except ValueError:
                seconds = float("nan")
            if not seconds > 0:
                raise ValueError(f"Sequence Parallel: environment variable {variable}={text!r} must be a positive "
                                 "number of seconds")
            values[field_name] = seconds
        return cls(**values)


@dataclass(frozen=True)
class GroupInfo:
    """What rank 0 publishes for every joining rank."""

    world_size: int
    backend: str
    timeouts: Timeouts
    group_id: str  # a rank that rejoins waits for a group other than the one it served; with the secret, the key
    control_port: int  # where rank 0 accepts the control connections (on the group's address)

#: stands for the call's transformer_options in the arguments sent (the options travel separately, filtered)
OPTIONS_SLOT = "<omnihooks transformer_options>"


class UnjoinableGroup(ValueError):
    """What the store holds under ``group`` is not a group this worker can join (not this pack's record, malformed, or
    signed with another key)."""


class SequenceParallelError(Exception):
    """A sequence-parallel group failed (a rank died, hung, refused a command, raised or never joined).

    Not a RuntimeError: the run lifecycle reads a RuntimeError out of a session's ``install`` as a hook conflict."""


class CommandRefused(SequenceParallelError):
    """A worker refused a command (its header did not match what it holds). ``every_worker``: all of them refused, so
    none went on to the command's collectives and the group is still in step."""

    def __init__(self, message: str, every_worker: bool):
        super().__init__(message)
        self.every_worker = every_worker


@dataclass(frozen=True)
class Command:
    """One message from rank 0. ``op``: "mesh", "load", "call" or "exit"; ``serial``: its number (1, 2, ...);
    ``header``: what every worker checks before any collective; ``payload``: the op's data (plain data, ``plain``;
    its tensors as raw bytes). ``broadcast``: on a worker, the payload's tensors too large for the command, in the
    order rank 0 broadcasts them once every worker accepted it (``encode``)."""

    op: str
    serial: int
    header: dict
    payload: Any = None
    broadcast: tuple[torch.Tensor, ...] = ()


_ALIGN = 16  # each tensor's bytes start at a multiple of this in an encoded command
#: a tensor of more bytes than this does not travel in the command: rank 0 broadcasts it over the process group once
#: every worker accepted the command (NCCL between GPUs: no copy through the CPU; one message per rank in a tree)
BROADCAST_BYTES = 256 * 1024


_LENGTH = 8
#: the largest JSON document of a command (its tensors' bytes come after it) and how deeply it may nest
DOCUMENT_BYTES = 64 << 20
DOCUMENT_DEPTH = 256


def encode(command: Command) -> tuple[bytes, list[torch.Tensor]]:
    """A command as bytes, and the payload's tensors of more than ``BROADCAST_BYTES`` (broadcast after it, in this
    order). The bytes: a JSON document after its 8-byte length (op, serial, header, and the payload as ``plain``
    data, each tensor described by its dtype, shape and place), then the raw bytes of every other tensor of the payload
    (moved to the CPU), each at a multiple of ``_ALIGN``. PlainDataError when the payload holds something that cannot
    travel as plain data (nothing is sent)."""
    inline: list[torch.Tensor] = []
    broadcast: list[torch.Tensor] = []

    def slot(tensor: torch.Tensor) -> dict:
        described = {"shape": list(tensor.shape), "dtype": dtype_name(tensor.dtype)}
        if tensor.numel() * tensor.element_size() > BROADCAST_BYTES:
            broadcast.append(tensor.detach())
            return {**described, "broadcast": len(broadcast) - 1}
        inline.append(tensor.detach().cpu().clone(memory_format=torch.contiguous_format))  # dense, even stride 0
        return {**described, "inline": len(inline) - 1}

    document = {"op": command.op, "serial": command.serial, "header": to_plain(command.header, slot),
                "payload": to_plain(command.payload, slot)}
    body = json.dumps(document, separators=(",", ":")).encode()
    if len(body) > DOCUMENT_BYTES or json_depth(body.decode(), DOCUMENT_DEPTH) > DOCUMENT_DEPTH:
        raise PlainDataError(f"the command's data is larger than {DOCUMENT_BYTES} bytes or nested more than "
                             f"{DOCUMENT_DEPTH} deep")
    parts = [len(body).to_bytes(_LENGTH, "little"), body]
    for tensor in inline:
        parts += [bytes(-sum(map(len, parts)) % _ALIGN), tensor.reshape(-1).view(torch.uint8).numpy().tobytes()]
    return b"".join(parts), broadcast


def decode(data: bytes | bytearray, device: torch.device | str = "cpu") -> Command:
    """``encode``'s command; its tensors share ``data`` when it is a bytearray (else a copy of it). The tensors rank
    0 broadcasts after it are made empty on ``device`` (the command's ``broadcast``), to be received in place.
    PlainDataError when ``data`` is not such a command (a length, a dtype, a shape or a place that does not fit, a
    document over ``DOCUMENT_BYTES`` or nested more than ``DOCUMENT_DEPTH`` deep)."""
    if len(data) < _LENGTH:
        raise PlainDataError("malformed command: shorter than its length field")
    size = int.from_bytes(bytes(data[:_LENGTH]), "little")
    if size > len(data) - _LENGTH:
        raise PlainDataError(f"malformed command: a document of {size} bytes in {len(data)}")
    try:
        document = bounded_json(memoryview(data)[_LENGTH:_LENGTH + size], DOCUMENT_BYTES, DOCUMENT_DEPTH,
                                "its document")
    except PlainDataError as exc:
        raise PlainDataError(f"malformed command: {exc}") from None
    if not isinstance(document, dict) or set(document) != {"op", "serial", "header", "payload"} \
            or not isinstance(document["op"], str) or type(document["serial"]) is not int:
        raise PlainDataError("malformed command: not a command document")
    buffer = data if isinstance(data, bytearray) else bytearray(data)  # writable: the tensors share it
    offset = _LENGTH + size
    inline_count, broadcast = 0, {}

    def tensor(value: dict) -> torch.Tensor:
        nonlocal offset, inline_count
        dtype, shape = dtype_named(value.get("dtype")), value.get("shape")
        if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
            raise PlainDataError(f"malformed command: a tensor shape {shape!r}")
        if "broadcast" in value:
            if value["broadcast"] != len(broadcast):
                raise PlainDataError("malformed command: broadcast tensors out of order")
            broadcast[len(broadcast)] = torch.empty(shape, dtype=dtype, device=device)
            return broadcast[len(broadcast) - 1]
        if value.get("inline") != inline_count:
            raise PlainDataError("malformed command: tensors out of order")
        inline_count += 1
        count = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        offset += -offset % _ALIGN
        if offset + count > len(buffer):
            raise PlainDataError("malformed command: a tensor beyond its end")
        flat = torch.frombuffer(buffer, dtype=torch.uint8, count=count, offset=offset) if count else \
            torch.empty(0, dtype=torch.uint8)
        offset += count
        return flat.view(dtype).reshape(shape)

    header = from_plain(document["header"], tensor)
    payload = from_plain(document["payload"], tensor)
    if not isinstance(header, dict):
        raise PlainDataError("malformed command: its header is not a dict")
    return Command(document["op"], document["serial"], header, payload,
                   broadcast=tuple(broadcast[i] for i in range(len(broadcast))))


def _map(value: Any, kind: type | tuple[type, ...], fn: Callable[[Any], Any]) -> Any:
    """``value`` with every ``kind`` (in lists, tuples, dicts) replaced by ``fn`` of it."""
    if isinstance(value, kind):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, kind, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map(v, kind, fn) for k, v in value.items()}
    return value


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with every tensor (in lists, tuples, dicts) replaced by ``fn`` of it."""
    return _map(value, torch.Tensor, fn)


def to_device(value: Any, device: torch.device) -> Any:
    return map_tensors(value, lambda t: t.to(device))


def tensor_signature(value: Any) -> list:
    """Shapes and dtypes of every tensor in ``value``, in order: part of a call's header."""
    if isinstance(value, torch.Tensor):
        return [(tuple(value.shape), str(value.dtype))]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in tensor_signature(v)]
    if isinstance(value, dict):
        return [s for k in sorted(value, key=str) for s in tensor_signature(value[k])]
    return []


def check_sendable(options: dict, where: str) -> None:
    """ValueError naming each transformer option that cannot be sent to the other ranks as plain data."""
    for key, value in options.items():
        try:
            text = json.dumps(to_plain(value, lambda tensor: {}))
            if json_depth(text, DOCUMENT_DEPTH - 8) > DOCUMENT_DEPTH - 8:
                raise PlainDataError("it is nested too deeply")
        except PlainDataError as exc:
            raise ValueError(
                f"{where}: transformer option {key!r} ({type(value).__name__}) cannot be sent to the other ranks "
                f"({exc}); another node put a Python object there. Remove that node from this model, or run without "
                "Sequence Parallel") from None


_GROUP = "group"


def publish_group(commands: dist.Store, info: GroupInfo, key: bytes) -> None:
    """Rank 0, before any worker starts (and again while it waits for them: anyone may overwrite it): what joining
    ranks read (``commands``: the prefixed store), signed with the group's ``key``."""
    body = {"world_size": info.world_size, "backend": info.backend, "timeouts": asdict(info.timeouts),
            "control_port": info.control_port}
    commands.set(_GROUP, seal(key, _GROUP, body, group_id=info.group_id))


def group_record(commands: dist.Store) -> bytes:
    """What the store holds under ``group`` (waits up to the store's timeout for rank 0 to publish it)."""
    return bytes(commands.get(_GROUP))


def read_group(commands: dist.Store, secret: bytes) -> tuple[GroupInfo, bytes]:
    """A worker: rank 0's ``GroupInfo`` and the group's key (``group_record``, ``open_group``)."""
    return open_group(group_record(commands), secret)


def open_group(data: bytes, secret: bytes) -> tuple[GroupInfo, bytes]:
    """The ``GroupInfo`` in a ``group`` record and the group's key. UnjoinableGroup when ``data`` is not a group
    signed with a key from ``secret`` (not this pack's record, malformed, too large or nested, another secret)."""
    try:
        group_id = opened(data).get("group_id")
        if not isinstance(group_id, str) or len(group_id) != 32 or not all(c in "0123456789abcdef" for c in group_id):
            raise TrustError("no group id")
        key = group_key(secret, group_id)
        body = unseal(key, _GROUP, data)
        timeouts = body["timeouts"]
        if not isinstance(timeouts, dict):
            raise TypeError("timeouts")
        timeouts = Timeouts(**{name: _seconds(timeouts[name]) for name in Timeouts.ENV})
        info = GroupInfo(_count(body["world_size"], 2, 1 << 16), body["backend"], timeouts, group_id,
                         _count(body["control_port"], 1, 65535))
    except (TrustError, KeyError, TypeError, ValueError) as exc:
        raise UnjoinableGroup(f"Sequence Parallel worker: the group in rank 0's store is not one this worker can join "
                              f"({exc}); rank 0 and this worker must hold the same secret (OMNIHOOKS_SP_SECRET or "
                              "OMNIHOOKS_SP_SECRET_FILE on both machines; the pack's own workers get it from their "
                              "parent)") from None
    if info.backend not in ("gloo", "nccl"):
        raise UnjoinableGroup(f"Sequence Parallel worker: rank 0's group has backend {info.backend!r}")
    return info, key


def _seconds(value: Any) -> float:
    if type(value) not in (int, float) or not 0 < value < math.inf:
        raise ValueError(f"a timeout of {value!r}")
    return float(value)


def _count(value: Any, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{value!r} is not a number from {low} to {high}")
    return value


def check_rank(rank: int, world_size: int | None, info: GroupInfo) -> None:
    """ValueError when the world size a worker was told differs from rank 0's, or its rank is outside the group (rank
    0 refuses a rank taken already when the worker connects)."""
    if world_size is not None and world_size != info.world_size:
        raise ValueError(f"Sequence Parallel worker: --world-size {world_size} but rank 0's Sequence Parallel node "
                         f"has world_size {info.world_size}; start the worker with the node's world size")
    if not 0 < rank < info.world_size:
        raise ValueError(f"Sequence Parallel worker: rank {rank} is outside 1..{info.world_size - 1} (rank 0 is the "
                         f"ComfyUI process; world_size {info.world_size})")


def init_group(store: dist.Store, rank: int, info: GroupInfo, address: str) -> network.Interface:
    """Join the default process group through ``store`` (every rank has connected; rank 0 hosts the store), bound to
    the network interface that holds ``address`` (rank 0: the group's address; a worker: its end of its control
    connection): ``network.bind``. Returns that interface."""
    interface = network.bind(address, info.backend)
    dist.init_process_group(info.backend, store=store, rank=rank, world_size=info.world_size,
                            timeout=datetime.timedelta(seconds=info.timeouts.collective_s))
    return interface


def command_store(store: dist.Store) -> dist.PrefixStore:
    """The store of this protocol's keys (the group) inside the rendezvous store."""
    return dist.PrefixStore(STORE_PREFIX, store)


def connect_store(host: str, port: int, timeout_s: float) -> dist.Store:
    """A client of rank 0's rendezvous store (waits up to ``timeout_s`` for it)."""
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def diagnose(control, world_size: int, exit_codes: Callable[[], dict[int, int | None]]) -> dict[int, str]:
    """Why a call failed, per worker rank that is not healthy: exited (``exit_codes()``: the local workers' rank and
    exit code, None while running; read last, as a killed process may take a moment to end), closed its control
    connection, not responding (no fresh heartbeat on ``control``, the ``ControlServer``, for ``STALL_S``: hung,
    stopped or cut off) or raised (the last line of the traceback it sent). Waits ``STALL_S``. Ranks not listed look
    healthy."""
    since = time.monotonic()
    time.sleep(STALL_S)
    found: dict[int, str] = {}
    codes = exit_codes()
    for rank in range(1, world_size):
        code, error = codes.get(rank), control.reported_error(rank)
        if code is not None:
            found[rank] = f"its process exited ({describe_exit(code)})"
        elif control.ended(rank) is not None:
            found[rank] = f"it closed its control connection ({control.ended(rank)})"
        elif control.stalled(rank, since, STALL_S):
            found[rank] = f"it stopped responding (no heartbeat for {STALL_S:.1f} s: hung, stopped or disconnected)"
        if error is not None:
            found[rank] = f"{found[rank]}; it raised: {error}" if rank in found else f"it raised: {error}"
    return found


def describe_exit(code: int) -> str:
    """"exit code 2", "killed by SIGKILL" (a Popen return code)."""
    if code < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` came out of an exchange between the ranks (torch.distributed: a failed or timed-out
    collective, a closed connection)."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(mark in text for mark in ("gloo", "NCCL", "c10d", "ProcessGroup"))


def broadcast_tensors(tensors: list[torch.Tensor], device: torch.device | None = None) -> None:
    """Broadcast each tensor from rank 0 into the same-shaped tensor on every other rank, in order (collective).

    ``device``: where the backend exchanges (None: CPU for gloo, the current CUDA device for NCCL); a tensor held
    elsewhere, or not contiguous (a view into a larger tensor, such as a stream of an audio-video latent), is staged
    through a contiguous copy there."""
    if device is None:
        device = (torch.device("cpu") if dist.get_backend() == "gloo"
                  else torch.device("cuda", torch.cuda.current_device()))
    with torch.no_grad():
        for tensor in tensors:
            data = tensor.data
            if data.device == device and data.is_contiguous():
                dist.broadcast(data, src=0)
            else:
                staged = data.to(device).contiguous()
                dist.broadcast(staged, src=0)
                data.copy_(staged)
