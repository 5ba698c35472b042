"""What rank 0 (the ComfyUI process) and its sequence-parallel workers say to each other, and how a rank joins.

A command (``Command``: op, serial, header, payload) goes to every worker over its control connection (``control``:
one TCP connection per worker, nothing polls); each checks its header (op, serial, plan, tensor shapes) and answers
"ok" or its error BEFORE any collective of the command, so a mismatch is an error on rank 0, never a hang. Tensors
(weights) then go through torch.distributed collectives, whose process-group timeout bounds every wait; a model
call's own tensors travel in its command, as raw bytes after its pickle (``encode``).

How a rank joins: rank 0 publishes the group (``GroupInfo``: world size, backend, timeouts, the port of its control
connections) in the rendezvous ``TCPStore`` under ``group`` before any worker starts; a worker reads it, checks the
world size it was told, claims its rank (``join/<rank>``; a rank claimed twice is an error), starts its heartbeat
(``beat/<rank>``, a counter) and opens its control connection; rank 0 waits until every rank has claimed and
connected (failing fast when a local worker exits, and after the join timeout naming the ranks missing) and only then
does everyone call ``init_process_group``. A worker whose command fails mid-collective leaves its traceback under
``error/<rank>``. With the heartbeats and those errors rank 0 says which rank broke a call (``diagnose``).

Nothing here imports ComfyUI.
"""
from __future__ import annotations

import datetime
import io
import math
import os
import pickle
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from ...omni_hooks.sequence_parallel.links import PeerLinkError, PeerLinks

STORE_PREFIX = "omnihooks_sp/"
#: a worker adds 1 to ``beat/<rank>`` this often, from a thread of its own (a stopped or dead process stops beating)
BEAT_S = 0.25
#: ``diagnose`` calls a rank not responding when its heartbeat did not move for this long
STALL_S = 1.5
#: rank 0, waiting for a command's answers, gives up on a worker whose heartbeat did not move for this long (longer
#: than ``STALL_S``: this verdict ends the run, so a thread scheduled late on a busy machine must not trigger it)
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
    group_id: str  # a rank that rejoins waits for a group other than the one it served
    control_port: int  # where rank 0 accepts the control connections (on the group's address)
    direct_links: bool = False  # every rank a CPU process on this machine: per-call exchanges over ``PeerLinks``

#: stands for the call's transformer_options in the arguments sent (the options travel separately, filtered)
OPTIONS_SLOT = "<omnihooks transformer_options>"


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
    ``header``: what every worker checks before any collective; ``payload``: the op's data (pickled, its tensors as
    raw bytes). ``broadcast``: on a worker, the payload's tensors too large for the command, in the order rank 0
    broadcasts them once every worker accepted it (``encode``)."""

    op: str
    serial: int
    header: dict
    payload: Any = None
    broadcast: tuple[torch.Tensor, ...] = ()


# This pack's import name in this process: ComfyUI imports it under its folder's name, a worker under another one.
PACKAGE = __name__.rsplit(".nodes.", 1)[0]


_ALIGN = 16  # each tensor's bytes start at a multiple of this in an encoded command
#: a tensor of more bytes than this does not travel in the command: rank 0 broadcasts it over the process group once
#: every worker accepted the command (NCCL between GPUs: no copy through the CPU; one message per rank in a tree)
BROADCAST_BYTES = 256 * 1024


@dataclass(frozen=True)
class _TensorSlot:
    """Stands for the ``index``-th tensor of an encoded command (its bytes travel after the pickle)."""

    index: int
    shape: tuple[int, ...]
    dtype: str  # "float32", ...


@dataclass(frozen=True)
class _BroadcastSlot:
    """Stands for the ``index``-th tensor rank 0 broadcasts after the command."""

    index: int
    shape: tuple[int, ...]
    dtype: str


def encode(command: Command) -> tuple[bytes, list[torch.Tensor]]:
    """A command as bytes, and the payload's tensors of more than ``BROADCAST_BYTES`` (broadcast after it, in this
    order). The bytes: this pack's import name and a pickle, each after its 8-byte length, then the raw bytes of
    every other tensor of the payload (moved to the CPU). Tensors never go through pickle (its tensor reduction costs about a millisecond a call). Objects of this
    pack (a feature's settings) are pickled under this process's package name, which travels with them so the
    receiver maps it to its own (``decode``)."""
    inline: list[torch.Tensor] = []
    broadcast: list[torch.Tensor] = []

    def slot(tensor: torch.Tensor) -> _TensorSlot | _BroadcastSlot:
        dtype = str(tensor.dtype).removeprefix("torch.")
        if tensor.numel() * tensor.element_size() > BROADCAST_BYTES:
            broadcast.append(tensor.detach())
            return _BroadcastSlot(len(broadcast) - 1, tuple(tensor.shape), dtype)
        inline.append(tensor.detach().cpu().contiguous())
        return _TensorSlot(len(inline) - 1, tuple(tensor.shape), dtype)

    payload = map_tensors(command.payload, slot)
    package = PACKAGE.encode()
    body = dumps({"op": command.op, "serial": command.serial, "header": command.header, "payload": payload})
    parts = [len(package).to_bytes(8, "little"), package, len(body).to_bytes(8, "little"), body]
    for tensor in inline:
        parts += [bytes(-sum(map(len, parts)) % _ALIGN), tensor.reshape(-1).view(torch.uint8).numpy().tobytes()]
    return b"".join(parts), broadcast


def decode(data: bytes | bytearray, device: torch.device | str = "cpu") -> Command:
    """``encode``'s command; its tensors share ``data`` when it is a bytearray (else a copy of it). The tensors rank
    0 broadcasts after it are made empty on ``device`` (the command's ``broadcast``), to be received in place."""
    view = memoryview(data)
    size = int.from_bytes(view[:8], "little")
    sender = bytes(view[8:8 + size]).decode()
    offset = 16 + size + int.from_bytes(view[8 + size:16 + size], "little")
    fields = loads(view[16 + size:offset], rename=(sender, PACKAGE))
    buffer = data if isinstance(data, bytearray) else bytearray(data)  # writable: the tensors share it

    def tensor(value: _TensorSlot) -> torch.Tensor:
        nonlocal offset
        dtype = getattr(torch, value.dtype)
        count = math.prod(value.shape) * torch.empty((), dtype=dtype).element_size()
        offset += -offset % _ALIGN
        flat = torch.frombuffer(buffer, dtype=torch.uint8, count=count, offset=offset) if count else \
            torch.empty(0, dtype=torch.uint8)
        offset += count
        return flat.view(dtype).reshape(value.shape)

    broadcast: dict[int, torch.Tensor] = {}

    def filled(value: _TensorSlot | _BroadcastSlot) -> torch.Tensor:
        if isinstance(value, _TensorSlot):
            return tensor(value)
        broadcast[value.index] = torch.empty(value.shape, dtype=getattr(torch, value.dtype), device=device)
        return broadcast[value.index]

    fields["payload"] = _map(fields["payload"], (_TensorSlot, _BroadcastSlot), filled)
    return Command(**fields, broadcast=tuple(broadcast[i] for i in range(len(broadcast))))


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


def publish_group(commands: dist.Store, info: GroupInfo) -> None:
    """Rank 0, before any worker starts: what joining ranks read (``commands``: the prefixed store)."""
    commands.set("group", dumps({"world_size": info.world_size, "backend": info.backend,
                                 "timeouts": asdict(info.timeouts), "group_id": info.group_id,
                                 "control_port": info.control_port, "direct_links": info.direct_links}))


def read_group(commands: dist.Store) -> GroupInfo:
    """A worker: rank 0's ``GroupInfo`` (waits up to the store's timeout for rank 0 to publish it)."""
    data = loads(commands.get("group"))
    return GroupInfo(data["world_size"], data["backend"], Timeouts(**data["timeouts"]), data["group_id"],
                     data["control_port"], data["direct_links"])


def claim_rank(commands: dist.Store, rank: int, world_size: int | None, info: GroupInfo) -> None:
    """A worker takes ``rank`` in the group ``info`` describes; ValueError when the world size it was told differs
    from rank 0's, the rank is outside the group, or another process already took it."""
    if world_size is not None and world_size != info.world_size:
        raise ValueError(f"Sequence Parallel worker: --world-size {world_size} but rank 0's Sequence Parallel node "
                         f"has world_size {info.world_size}; start the worker with the node's world size")
    if not 0 < rank < info.world_size:
        raise ValueError(f"Sequence Parallel worker: rank {rank} is outside 1..{info.world_size - 1} (rank 0 is the "
                         f"ComfyUI process; world_size {info.world_size})")
    if commands.add(f"join/{rank}", 1) != 1:
        raise ValueError(f"Sequence Parallel worker: rank {rank} has already joined from another process; give each "
                         "worker its own rank (--rank, or --first-rank under torchrun)")


def missing_ranks(commands: dist.Store, world_size: int) -> list[int]:
    """The worker ranks that have not claimed their rank yet."""
    return [rank for rank in range(1, world_size) if not commands.check([f"join/{rank}"])]


def init_group(store: dist.Store, rank: int, info: GroupInfo) -> PeerLinks | None:
    """Join the default process group through ``store`` (every rank has claimed its rank; rank 0 hosts the store),
    then connect the direct links when the group has them."""
    dist.init_process_group(info.backend, store=store, rank=rank, world_size=info.world_size,
                            timeout=datetime.timedelta(seconds=info.timeouts.collective_s))
    if not info.direct_links:
        return None
    return PeerLinks.connect(command_store(store), rank, info.world_size, info.timeouts.collective_s)


def command_store(store: dist.Store) -> dist.PrefixStore:
    """The store of this protocol's keys (the group, joins, heartbeats, errors) inside the rendezvous store."""
    return dist.PrefixStore(STORE_PREFIX, store)


def connect_store(host: str, port: int, timeout_s: float) -> dist.Store:
    """A client of rank 0's rendezvous store (waits up to ``timeout_s`` for it)."""
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


class Heartbeat:
    """A worker's heartbeat: a daemon thread adds 1 to ``beat/<rank>`` every ``BEAT_S`` over its own store
    connection, until ``stop``. A process that is killed, stopped (SIGSTOP) or cut off stops beating: rank 0 reads
    a stalled counter as "not responding"."""

    def __init__(self, host: str, port: int, rank: int, timeout_s: float):
        self._store = command_store(connect_store(host, port, timeout_s))
        self._key = f"beat/{rank}"
        self._stopped = threading.Event()
        self._store.add(self._key, 1)
        self._thread = threading.Thread(target=self._beat, name=f"omnihooks-sp-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stopped.wait(BEAT_S):
            try:
                self._store.add(self._key, 1)
            except Exception:  # rank 0's store is gone: the group is over, the main thread notices on its own
                return

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)


class HeartbeatWatch:
    """Which workers stopped beating: a rank whose ``beat/<rank>`` counter did not move for ``stall_s`` since this
    watch first read it, or since it last moved (a rank whose counter cannot be read counts as stalled)."""

    def __init__(self, commands: dist.Store, stall_s: float = STALL_S):
        self.commands = commands
        self.stall_s = stall_s
        self._seen: dict[int, tuple[int, float]] = {}  # rank: (count, when it was first read at that count)

    def stalled(self, rank: int) -> bool:
        try:
            count = self.commands.add(f"beat/{rank}", 0)
        except Exception:
            return True
        now = time.monotonic()
        seen = self._seen.get(rank)
        if seen is None or seen[0] != count:
            self._seen[rank] = (count, now)
            return False
        return now - seen[1] >= self.stall_s


def diagnose(commands: dist.Store, world_size: int,
             exit_codes: Callable[[], dict[int, int | None]]) -> dict[int, str]:
    """Why a call failed, per worker rank that is not healthy: exited (``exit_codes()``: the local workers' rank and
    exit code, None while running; read last, as a killed process may take a moment to end), not responding (heartbeat
    stalled for ``STALL_S``: hung, stopped or gone) or raised (its ``error/<rank>``, last line). Waits ``STALL_S``.
    Ranks not listed look healthy."""
    ranks = range(1, world_size)
    watch = HeartbeatWatch(commands)
    for rank in ranks:
        watch.stalled(rank)  # the counts to compare with
    time.sleep(STALL_S)
    found: dict[int, str] = {}
    codes = exit_codes()
    for rank in ranks:
        code = codes.get(rank)
        error = _reported_error(commands, rank)
        if code is not None:
            found[rank] = f"its process exited ({describe_exit(code)})"
        elif watch.stalled(rank):
            found[rank] = f"it stopped responding (no heartbeat for {STALL_S:.1f} s: hung, stopped or disconnected)"
        if error is not None:
            found[rank] = f"{found[rank]}; it raised: {error}" if rank in found else f"it raised: {error}"
    return found


def _reported_error(commands: dist.Store, rank: int) -> str | None:
    key = f"error/{rank}"
    if not commands.check([key]):
        return None
    lines = [line for line in loads(commands.get(key)).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no message)"


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
    """Whether ``error`` came out of an exchange between the ranks (torch.distributed or the direct links: a failed or
    timed-out collective, a closed connection)."""
    if isinstance(error, (dist.DistError, PeerLinkError)):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(mark in text for mark in ("gloo", "NCCL", "c10d", "ProcessGroup"))


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
