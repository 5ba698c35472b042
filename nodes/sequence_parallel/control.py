"""The control connections of a sequence-parallel group: one TCP connection between rank 0 and each worker rank, which
carries every command and its answer, and nothing else.

A frame is 16 bytes of header, two little-endian int64 (a serial and a size), then ``size`` bytes. Rank 0 sends a
command as (serial, its length) and the command's bytes (``protocol.encode``); a worker answers (serial, 0) when it
accepts the command, or (serial, length) and the text of its refusal. A worker's first frame is its hello, (rank, 0).

Why not a collective: a gloo collective hands each message through the process group's worker thread and gloo's own
I/O thread on both sides, several hundred microseconds between two processes on one machine; a frame on a connection
of its own is a loopback round trip (tens of microseconds). Why not the rendezvous store: a worker would have to poll
it. Here nobody polls: a worker blocks in ``recv`` until rank 0 sends (waking every ``POLL_S`` only to check that its
local parent lives), so it idles between prompts for as long as it likes; a rank that exits closes its connection,
and the other side reads the end at once; TCP keepalive ends a connection whose peer machine is gone.

Nothing here imports ComfyUI.
"""
from __future__ import annotations

import socket
import struct
import time
from typing import Callable

from ...omni_hooks.sequence_parallel.links import receive_exact

#: how often a waiting worker checks that its local parent still lives
POLL_S = 0.5
#: how long a worker that connected gets to say its rank
HELLO_S = 10.0
#: how often rank 0, waiting for an answer, asks whether the worker can still give one
CHECK_S = 0.25

_HEADER = struct.Struct("<qq")


class ControlError(ConnectionError):
    """A control connection failed: its rank closed it (exited), did not answer in time (hung, stopped), or answered
    another command (out of step)."""

    def __init__(self, rank: int, why: str):
        super().__init__(f"rank {rank} {why}")
        self.rank = rank


def configure(sock: socket.socket) -> None:
    """No delay for small frames; keepalive so that a connection to a machine that vanished ends (about 90 s)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 6)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def send_frame(sock: socket.socket, serial: int, data: bytes = b"") -> None:
    """One frame, in one system call when the kernel takes it whole (a small frame is then a single packet)."""
    header = _HEADER.pack(serial, len(data))
    sent = sock.sendmsg([header, data]) if data else 0
    if sent < len(header):
        sock.sendall(header[sent:])
        sent = len(header)
    if sent - len(header) < len(data):
        sock.sendall(memoryview(data)[sent - len(header):])


def receive_frame(sock: socket.socket, keep_waiting: Callable[[], bool] | None = None) -> tuple[int, bytearray]:
    serial, size = _HEADER.unpack(receive_exact(sock, _HEADER.size, keep_waiting))
    return serial, receive_exact(sock, size, keep_waiting) if size else bytearray()


class ControlServer:
    """Rank 0's ends of the control connections, one per worker rank, accepted on ``listener`` (listening on the
    group's address, any free port) while the group starts."""

    def __init__(self, listener: socket.socket):
        self.listener = listener
        self.port: int = listener.getsockname()[1]
        listener.setblocking(False)
        self.links: dict[int, socket.socket] = {}

    def accept_waiting(self, world_size: int) -> None:
        """Take the connections waiting now, each with its hello; a second connection for a rank, or a rank outside
        the group, is closed (its worker fails its own rank claim or join)."""
        while True:
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            sock.settimeout(HELLO_S)
            try:
                rank, _ = receive_frame(sock)
            except (OSError, EOFError):
                sock.close()
                continue
            if not 0 < rank < world_size or rank in self.links:
                sock.close()
                continue
            configure(sock)
            self.links[rank] = sock

    def missing(self, world_size: int) -> list[int]:
        """The worker ranks that have not connected yet."""
        return [rank for rank in range(1, world_size) if rank not in self.links]

    def stop_listening(self) -> None:
        self.listener.close()

    def send(self, serial: int, data: bytes, timeout_s: float) -> None:
        """Command ``serial`` to every worker; ControlError naming the first rank it could not be sent to."""
        for rank, sock in self.links.items():
            sock.settimeout(timeout_s)
            try:
                send_frame(sock, serial, data)
            except socket.timeout:
                raise ControlError(rank, f"did not take command {serial} within {timeout_s:.0f} s") from None
            except OSError as exc:
                raise ControlError(rank, f"closed its control connection ({exc})") from None

    def answers(self, serial: int, timeout_s: float,
                unresponsive: Callable[[int], str | None] | None = None) -> dict[int, str]:
        """Every worker's answer to command ``serial``: the refusals (rank: text), empty when all accepted.
        ControlError when a rank does not answer within ``timeout_s``, closed its connection, answered another command,
        or, asked every ``CHECK_S`` while its answer is missing, ``unresponsive(rank)`` says why it will not answer
        (exited, stopped: then in seconds, whatever ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        refusals = {}
        for rank, sock in self.links.items():
            def keep_waiting(rank: int = rank) -> bool:
                why = unresponsive(rank) if unresponsive is not None else None
                if why is not None:
                    raise ControlError(rank, why)
                return time.monotonic() < deadline

            sock.settimeout(CHECK_S)
            try:
                answered, text = receive_frame(sock, keep_waiting)
            except ControlError:
                raise
            except socket.timeout:
                raise ControlError(rank, f"did not answer command {serial} within {timeout_s:.0f} s") from None
            except (OSError, EOFError) as exc:
                raise ControlError(rank, f"closed its control connection ({exc})") from None
            if answered != serial:
                raise ControlError(rank, f"answered command {answered} to command {serial} (out of step)")
            if text:
                refusals[rank] = text.decode(errors="replace")
        return refusals

    def broadcast_quietly(self, serial: int, data: bytes, timeout_s: float) -> None:
        """Command ``serial`` to every worker that takes it within ``timeout_s``, unanswered (the "exit")."""
        for sock in self.links.values():
            sock.settimeout(timeout_s)
            try:
                send_frame(sock, serial, data)
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()
        for sock in self.links.values():
            sock.close()
        self.links.clear()


class ControlClient:
    """A worker's end of its control connection to rank 0."""

    def __init__(self, host: str, port: int, rank: int, timeout_s: float):
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        configure(self.sock)
        send_frame(self.sock, rank)
        self.sock.settimeout(POLL_S)

    def receive(self, give_up: Callable[[], bool]) -> tuple[int, bytearray] | None:
        """The next command's serial and bytes; blocks until rank 0 sends one. None when ``give_up()`` (checked every
        ``POLL_S`` while waiting) says to stop waiting. EOFError when rank 0 closed the connection."""
        try:
            return receive_frame(self.sock, keep_waiting=lambda: not give_up())
        except socket.timeout:
            return None

    def answer(self, serial: int, refusal: str | None) -> None:
        """Accept command ``serial`` (``refusal`` None), or refuse it with a text for rank 0's error."""
        send_frame(self.sock, serial, b"" if refusal is None else refusal.encode() or b"(no reason given)")

    def close(self) -> None:
        self.sock.close()
