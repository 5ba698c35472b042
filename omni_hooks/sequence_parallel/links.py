"""Direct connections between the CPU ranks of one machine, for sequence parallelism's per-call exchanges.

A gloo collective hands each message through torch's process-group thread and gloo's own I/O thread on both sides:
between two processes that compute in turn on a small machine that is a few hundred microseconds per collective, and
milliseconds whenever one of those threads wakes late, far more than the exchange of a few kilobytes itself. ``PeerLinks`` moves the same bytes over one TCP connection per pair of ranks, from
the calling thread: an exchange is a few system calls. A ``RankGroup`` with links has its ``Communicator`` exchange
over them (CPU tensors); everything else (a model's weights, NCCL) stays on torch.distributed.

Exchanges are SPMD: every member sends and receives the same sequence of messages on each connection, so a message
needs no tag. Each carries its length; a length other than the one expected is an error (the ranks are out of step),
as is a peer that closes its connection, or one that does not send within ``timeout_s`` (hung or stopped).
"""
from __future__ import annotations

import select
import socket
import struct
import time
from typing import Callable

import torch
import torch.distributed as dist

_LENGTH = struct.Struct("<q")
_STORE_KEY = "omnihooks_links/{rank}"


class PeerLinkError(RuntimeError):
    """An exchange over the links failed; ``rank`` is the peer it failed with."""

    def __init__(self, rank: int, why: str):
        super().__init__(f"sequence-parallel link to rank {rank}: {why}")
        self.rank = rank


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, shared with it (a write to the view writes the tensor)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"PeerLinks: exchanges contiguous CPU tensors, got {tensor.device} "
                         f"(contiguous: {tensor.is_contiguous()})")
    if tensor.numel() == 0:
        return memoryview(b"")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def receive_exact(sock: socket.socket, size: int, keep_waiting: Callable[[], bool] | None = None) -> bytearray:
    """``size`` bytes from a blocking ``sock``. EOFError when the peer closed the connection first. A socket timeout
    is raised, unless ``keep_waiting()`` says to go on waiting (the bytes already read are kept)."""
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        try:
            count = sock.recv_into(view[got:])
        except socket.timeout:
            if keep_waiting is not None and keep_waiting():
                continue
            raise
        if count == 0:
            raise EOFError("the connection was closed")
        got += count
    return buffer


class _Incoming:
    """A message being received from one peer: its 8-byte length, then the bytes, straight into the tensor."""

    def __init__(self, rank: int, target: memoryview):
        self.rank, self.target = rank, target
        self.header = bytearray(_LENGTH.size)
        self.got = 0

    @property
    def done(self) -> bool:
        return self.got == len(self.header) + len(self.target)

    def space(self) -> memoryview:
        if self.got < len(self.header):
            return memoryview(self.header)[self.got:]
        return self.target[self.got - len(self.header):]

    def advance(self, count: int) -> None:
        before, self.got = self.got, self.got + count
        if before < len(self.header) <= self.got:
            (length,) = _LENGTH.unpack(self.header)
            if length != len(self.target):
                raise PeerLinkError(self.rank, f"sent {length} bytes where {len(self.target)} were expected (the "
                                               "ranks are out of step)")


class PeerLinks:
    """This process's connection to every other rank of the default group (``sockets``: rank -> connected socket).
    ``timeout_s`` bounds each exchange."""

    def __init__(self, rank: int, sockets: dict[int, socket.socket], timeout_s: float):
        self.rank = rank
        self.sockets = sockets
        self.timeout_s = timeout_s
        for sock in sockets.values():
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)

    @classmethod
    def connect(cls, store: dist.Store, rank: int, world_size: int, timeout_s: float,
                host: str = "127.0.0.1") -> "PeerLinks":
        """Connect every pair of the ``world_size`` ranks (collective: every rank calls it). Each rank listens on
        ``host`` (any free port) and publishes the port in ``store``; it connects to every lower rank and accepts every
        higher one."""
        listener = socket.create_server((host, 0))
        sockets: dict[int, socket.socket] = {}
        try:
            store.set(_STORE_KEY.format(rank=rank), str(listener.getsockname()[1]))
            for peer in range(rank):
                port = int(store.get(_STORE_KEY.format(rank=peer)))
                sock = socket.create_connection((host, port), timeout=timeout_s)
                sock.sendall(_LENGTH.pack(rank))
                sockets[peer] = sock
            listener.settimeout(timeout_s)
            for _ in range(rank + 1, world_size):
                sock, _ = listener.accept()
                sock.settimeout(timeout_s)
                (peer,) = _LENGTH.unpack(receive_exact(sock, _LENGTH.size))
                if not rank < peer < world_size or peer in sockets:
                    raise PeerLinkError(peer, f"is not a rank this one waits for (rank {rank} of {world_size})")
                sockets[peer] = sock
        except BaseException:
            for sock in sockets.values():
                sock.close()
            raise
        finally:
            listener.close()
        return cls(rank, sockets, timeout_s)

    def exchange(self, sends: dict[int, torch.Tensor], receives: dict[int, torch.Tensor]) -> None:
        """Send each tensor of ``sends`` to its rank and fill each tensor of ``receives`` with its rank's message, all
        at once (no send waits for a receive). Contiguous CPU tensors; every peer makes the matching call."""
        outgoing = {peer: [memoryview(_LENGTH.pack(len(data))), data]
                    for peer, data in ((peer, _byte_view(t)) for peer, t in sends.items())}
        incoming = {peer: _Incoming(peer, _byte_view(t)) for peer, t in receives.items()}
        deadline = time.monotonic() + self.timeout_s
        while True:
            for peer in list(outgoing):
                if self._send_some(peer, outgoing[peer]):
                    del outgoing[peer]
            for peer in list(incoming):
                if self._receive_some(incoming[peer]):
                    del incoming[peer]
            if not outgoing and not incoming:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                peer = next(iter(incoming or outgoing))
                raise PeerLinkError(peer, f"exchanged nothing for {self.timeout_s:.0f} s (hung or stopped?)")
            poller = select.poll()
            for peer in outgoing:
                poller.register(self.sockets[peer], select.POLLOUT)
            for peer in incoming:
                poller.register(self.sockets[peer], select.POLLIN | (select.POLLOUT if peer in outgoing else 0))
            poller.poll(remaining * 1000)

    def _send_some(self, peer: int, views: list[memoryview]) -> bool:
        """Send what the connection takes now; whether the message is sent whole."""
        sock = self.sockets[peer]
        try:
            while views:
                sent = sock.send(views[0])
                views[0] = views[0][sent:]
                if not views[0]:
                    views.pop(0)
        except BlockingIOError:
            return False
        except OSError as exc:
            raise PeerLinkError(peer, f"closed its connection ({exc})") from None
        return True

    def _receive_some(self, message: _Incoming) -> bool:
        """Receive what has arrived; whether the message is complete."""
        sock = self.sockets[message.rank]
        try:
            while not message.done:
                count = sock.recv_into(message.space())
                if count == 0:
                    raise PeerLinkError(message.rank, "closed its connection")
                message.advance(count)
        except BlockingIOError:
            return False
        except ConnectionError as exc:
            raise PeerLinkError(message.rank, f"closed its connection ({exc})") from None
        return True

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close()
        self.sockets = {}
