"""The control connections of a sequence-parallel group: one TCP connection between rank 0 and each worker rank, which
carries every command and its answer, and nothing else.

A connection starts with a proof (``trust``): rank 0 sends a magic and its nonce; the worker answers with its rank, its
nonce and an HMAC of both under the group's key (fixed sizes: no length to trust); rank 0 checks it, answers with
its own HMAC (the worker checks that too), then with a frame that accepts the rank or says why not (taken, outside
the group). A connection that fails the proof, claims a rank taken or outside the group, or stays silent is closed
and logged; each start-up handshake runs in a thread of its own, so none holds up the others.

Then frames: 16 bytes of header, two little-endian int64 (a serial and a size), then ``size`` bytes; a size below 0
or above the receiver's limit is a malformed frame (nothing is allocated for it). Rank 0 sends a command as (serial,
its length) and the command's bytes (``protocol.encode``); a worker answers (serial, 0) when it accepts the command,
or (serial, length) and the text of its refusal.

Why not a collective: a gloo collective hands each message through the process group's threads on both sides; a
frame on a connection of its own is a loopback round trip. Why not the rendezvous store: a worker would have to poll
it. Here nobody polls: a worker blocks in ``recv`` until rank 0 sends (waking every ``POLL_S`` only to check that its
local parent lives), so it idles between prompts for as long as it likes; a rank that exits closes its connection,
and the other side reads the end at once; TCP keepalive ends a connection whose peer machine is gone. Only portable
socket calls (``recv_into``, ``sendall``, timeouts): no ``sendmsg``, no ``poll``.

Nothing here imports ComfyUI.
"""
from __future__ import annotations

import logging
import secrets
import socket
import struct
import threading
import time
from typing import Callable

from .trust import MAC_BYTES, NONCE_BYTES, mac, proves

log = logging.getLogger("OmniHooks")

#: how often a waiting worker checks that its local parent still lives
POLL_S = 0.5
#: how long a worker that connected gets to say its rank
HELLO_S = 10.0
#: how often rank 0, waiting for an answer, asks whether the worker can still give one
CHECK_S = 0.25

_HEADER = struct.Struct("<qq")
_MAGIC = b"OHSPctl1"
_HELLO = struct.Struct(f"<q{NONCE_BYTES}s{MAC_BYTES}s")  # rank, the worker's nonce, its proof
#: the largest answer rank 0 reads (a refusal's traceback), and the largest command a worker reads
ANSWER_LIMIT = 1 << 20
COMMAND_LIMIT = 1 << 30


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


class FrameError(ValueError):
    """A frame whose size is negative or over the receiver's limit."""


#: a frame this small goes in one ``sendall`` with its header (a single packet)
_JOIN_BYTES = 64 * 1024


def send_frame(sock: socket.socket, serial: int, data: bytes = b"") -> None:
    header = _HEADER.pack(serial, len(data))
    if len(data) <= _JOIN_BYTES:
        sock.sendall(header + bytes(data))
    else:
        sock.sendall(header)
        sock.sendall(data)


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


def receive_frame(sock: socket.socket, keep_waiting: Callable[[], bool] | None = None,
                  limit: int = ANSWER_LIMIT) -> tuple[int, bytearray]:
    """One frame; FrameError when its size is below 0 or above ``limit`` (its bytes are not read)."""
    serial, size = _HEADER.unpack(receive_exact(sock, _HEADER.size, keep_waiting))
    if not 0 <= size <= limit:
        raise FrameError(f"a frame of {size} bytes (at most {limit})")
    return serial, receive_exact(sock, size, keep_waiting) if size else bytearray()


class ControlServer:
    """Rank 0's ends of the control connections, one per worker rank of a group of ``world_size`` ranks whose key is
    ``key``, accepted on ``listener`` (listening on the group's address, any free port) while the group starts."""

    def __init__(self, listener: socket.socket, key: bytes, world_size: int):
        self.listener = listener
        self.key, self.world_size = key, world_size
        self.port: int = listener.getsockname()[1]
        listener.setblocking(False)
        self.links: dict[int, socket.socket] = {}
        self.started = False  # every rank joined: later connections are refused
        self._lock = threading.Lock()
        self._handshakes: list[threading.Thread] = []

    def accept_waiting(self) -> None:
        """Take the connections waiting now; each proves itself in a thread of its own (``_admit``) and, accepted,
        joins ``links``."""
        while True:
            try:
                sock, address = self.listener.accept()
            except (BlockingIOError, socket.timeout, InterruptedError):
                return
            except OSError:  # the listener was closed
                return
            sock.setblocking(True)
            thread = threading.Thread(target=self._admit, args=(sock, address), daemon=True,
                                      name="omnihooks-sp-control-handshake")
            self._handshakes = [t for t in self._handshakes if t.is_alive()] + [thread]
            thread.start()

    def _admit(self, sock: socket.socket, address) -> None:
        """One connection's handshake: closed and logged when it fails the proof, claims a rank taken or outside the
        group, or does not finish within ``HELLO_S``."""
        sock.settimeout(HELLO_S)
        ours = secrets.token_bytes(NONCE_BYTES)
        try:
            sock.sendall(_MAGIC + ours)
            rank, theirs, proof = _HELLO.unpack(receive_exact(sock, _HELLO.size))
            rank_bytes = _HELLO.pack(rank, b"", b"")[:8]
            if not proves(self.key, "worker", proof, ours, theirs, rank_bytes):
                log.warning("OmniHooks Sequence Parallel: refused a control connection from %s: it does not prove "
                            "it holds this group's secret", _where(address))
                sock.close()
                return
            sock.sendall(mac(self.key, "rank 0", theirs, ours, rank_bytes))
            with self._lock:
                if self.started:
                    refusal = "the group has started already; the next group takes new ranks"
                elif not 0 < rank < self.world_size:
                    refusal = (f"rank {rank} is outside 1..{self.world_size - 1} (rank 0 is the ComfyUI process; "
                               f"world_size {self.world_size})")
                elif rank in self.links:
                    refusal = (f"rank {rank} has already joined from another process; give each worker its own rank "
                               "(--rank, or --first-rank under torchrun)")
                else:
                    refusal = None
                    configure(sock)
                    send_frame(sock, 0)
                    self.links[rank] = sock
            if refusal is not None:
                log.warning("OmniHooks Sequence Parallel: refused a control connection from %s: %s",
                            _where(address), refusal)
                send_frame(sock, 0, refusal.encode())
                sock.close()
        except (OSError, EOFError, struct.error) as exc:
            log.warning("OmniHooks Sequence Parallel: refused a control connection from %s: its handshake failed "
                        "(%s)", _where(address), exc or type(exc).__name__)
            sock.close()

    def missing(self, world_size: int) -> list[int]:
        """The worker ranks that have not connected yet."""
        return [rank for rank in range(1, world_size) if rank not in self.links]

    def stop_listening(self) -> None:
        """No more connections; a handshake still running is refused."""
        with self._lock:
            self.started = True
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
            except FrameError as exc:
                raise ControlError(rank, f"sent a malformed answer to command {serial} ({exc})") from None
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
        self.stop_listening()
        for sock in self.links.values():
            sock.close()
        self.links.clear()


class RefusedRank(ValueError):
    """Rank 0 refused this worker's rank (taken, or outside the group)."""


class ControlClient:
    """A worker's end of its control connection to rank 0: proves it holds ``key`` and claims ``rank``. ConnectionError
    when rank 0 does not prove it holds the key; RefusedRank when it refuses the rank."""

    def __init__(self, host: str, port: int, rank: int, timeout_s: float, key: bytes):
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        try:
            self._prove(rank, key)
        except BaseException:
            self.sock.close()
            raise
        self.sock.settimeout(POLL_S)

    def _prove(self, rank: int, key: bytes) -> None:
        challenge = receive_exact(self.sock, len(_MAGIC) + NONCE_BYTES)
        if challenge[:len(_MAGIC)] != _MAGIC:
            raise ConnectionError("rank 0's control port answered with something else than this pack's handshake")
        theirs, ours = bytes(challenge[len(_MAGIC):]), secrets.token_bytes(NONCE_BYTES)
        rank_bytes = _HELLO.pack(rank, b"", b"")[:8]
        self.sock.sendall(_HELLO.pack(rank, ours, mac(key, "worker", theirs, ours, rank_bytes)))
        try:
            proof = receive_exact(self.sock, MAC_BYTES)
        except EOFError:
            raise ConnectionError("rank 0 closed the control connection: it does not hold the same group secret "
                                  "(OMNIHOOKS_SP_SECRET on both machines?)") from None
        if not proves(key, "rank 0", proof, ours, theirs, rank_bytes):
            raise ConnectionError("rank 0 did not prove it holds this group's secret")
        configure(self.sock)
        _, refusal = receive_frame(self.sock)
        if refusal:
            raise RefusedRank(f"Sequence Parallel worker: {refusal.decode(errors='replace')}")

    def receive(self, give_up: Callable[[], bool]) -> tuple[int, bytearray] | None:
        """The next command's serial and bytes; blocks until rank 0 sends one. None when ``give_up()`` (checked every
        ``POLL_S`` while waiting) says to stop waiting. EOFError when rank 0 closed the connection."""
        try:
            return receive_frame(self.sock, keep_waiting=lambda: not give_up(), limit=COMMAND_LIMIT)
        except socket.timeout:
            return None

    def answer(self, serial: int, refusal: str | None) -> None:
        """Accept command ``serial`` (``refusal`` None), or refuse it with a text for rank 0's error."""
        send_frame(self.sock, serial, b"" if refusal is None else refusal.encode() or b"(no reason given)")

    def close(self) -> None:
        self.sock.close()


def _where(address) -> str:
    return f"{address[0]}:{address[1]}" if isinstance(address, tuple) and len(address) >= 2 else str(address)
