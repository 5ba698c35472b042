"""The control connections of a sequence-parallel group: one TCP connection between rank 0 and each worker rank, which
carries every command and its answer, the worker's heartbeat and, when a command fails on the worker, its traceback.

A connection starts with a proof (``trust``): rank 0 sends a magic and its nonce; the worker answers with its rank, its
nonce and an HMAC of both under the group's key (fixed sizes: no length to trust); rank 0 checks it, answers with
its own HMAC (the worker checks that too), then with a frame that accepts the rank or says why not (taken, outside
the group). Rank 0 moves every handshake on from the thread that waits for the ranks (no thread per connection), at
most ``HANDSHAKES`` at once (a connection beyond them is closed at once and logged), each within one deadline for the
whole exchange (``HELLO_S``); a connection that fails the proof, claims a rank taken or outside the group, or does not
finish in time is closed and logged.

Then frames: 16 bytes of header, two little-endian int64 (a serial and a size), then ``size`` bytes; a size below 0
or above the receiver's limit is a malformed frame (nothing is allocated for it). Rank 0 sends a command as (serial,
its length) and the command's bytes (``protocol.encode``). A worker answers (serial, 0) when it accepts the command,
or (serial, length) and the text of its refusal; every ``BEAT_S`` it beats, (``BEAT``, 40): a rising count and its
HMAC under the group's key for its rank; a worker whose command failed sends (``REPORT``, length) and its traceback.
On rank 0 a thread per connection reads everything a worker sends as it comes: the heartbeats stay fresh while rank
0 computes, and a stall is time without a fresh beat (``stalled``). Nobody but the two ranks writes on a connection,
so nothing in the rendezvous store (which anyone who reaches it can write) bears on whether a rank lives.

Why not a collective: a gloo collective hands each message through the process group's threads on both sides; a
frame on a connection of its own is a loopback round trip. Why not the rendezvous store: a worker would have to poll
it, and anyone can overwrite or replay what is there. A worker blocks in ``recv`` until rank 0 sends (waking every
``POLL_S`` only to check that its local parent lives), so it idles between prompts for as long as it likes; a rank
that exits closes its connection, and the other side reads the end at once; TCP keepalive ends a connection whose
peer machine is gone. Only portable socket calls (``recv_into``, ``sendall``, timeouts, non-blocking sockets): no
``sendmsg``, no ``poll``.

Nothing here imports ComfyUI.
"""
from __future__ import annotations

import collections
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
#: the whole handshake of a connection (challenge, proof, rank) finishes within this, on either side
HELLO_S = 10.0
#: the most handshakes rank 0 runs at once; a connection beyond them is closed at once
HANDSHAKES = 64
#: how often rank 0, waiting for an answer, asks whether the worker can still give one
CHECK_S = 0.25
#: a worker beats this often, from a thread of its own (a stopped or dead process stops beating)
BEAT_S = 0.25
#: the serials of what a worker sends besides its answers (a command's serial is 1 or more)
BEAT, REPORT = -1, -2

_HEADER = struct.Struct("<qq")
_MAGIC = b"OHSPctl2"
_HELLO = struct.Struct(f"<q{NONCE_BYTES}s{MAC_BYTES}s")  # rank, the worker's nonce, its proof
_COUNT = struct.Struct("<Q")
#: the largest answer or traceback rank 0 reads, and the largest command a worker reads
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


def receive_exact(sock: socket.socket, size: int, keep_waiting: Callable[[], bool] | None = None,
                  deadline: float | None = None) -> bytearray:
    """``size`` bytes from a blocking ``sock``. EOFError when the peer closed the connection first. A socket timeout
    is raised, unless ``keep_waiting()`` says to go on waiting (the bytes already read are kept); with ``deadline``
    (``time.monotonic()``), at that time whatever the socket's timeout."""
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("the exchange took too long")
            sock.settimeout(left)
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
                  limit: int = ANSWER_LIMIT, deadline: float | None = None) -> tuple[int, bytearray]:
    """One frame; FrameError when its size is below 0 or above ``limit`` (its bytes are not read)."""
    serial, size = _HEADER.unpack(receive_exact(sock, _HEADER.size, keep_waiting, deadline))
    if not 0 <= size <= limit:
        raise FrameError(f"a frame of {size} bytes (at most {limit})")
    return serial, receive_exact(sock, size, keep_waiting, deadline) if size else bytearray()


def beat_frame(key: bytes, rank: int, count: int) -> bytes:
    """A heartbeat's bytes: ``count`` and its HMAC under the group's ``key`` for ``rank``."""
    counted = _COUNT.pack(count)
    return counted + mac(key, f"beat/{rank}", counted)


class _Link:
    """Rank 0's end of one worker's connection, and what its reader took from it so far."""

    def __init__(self, rank: int, sock: socket.socket):
        self.rank, self.sock = rank, sock
        self.answers: collections.deque[tuple[int, bytearray]] = collections.deque()
        self.count = 0  # of the last fresh heartbeat
        self.last_beat = time.monotonic()  # when it came (or when the rank joined)
        self.report: str | None = None  # the traceback the worker sent
        self.ended: str | None = None  # why the connection ended, once it did
        self.complained = False  # an unusable heartbeat was logged already
        self.reader: threading.Thread | None = None


class _Handshake:
    """A connection proving itself to rank 0, moved on without blocking (``ControlServer.accept_waiting``)."""

    def __init__(self, sock: socket.socket, address, deadline: float):
        self.sock, self.address, self.deadline = sock, address, deadline
        self.ours = secrets.token_bytes(NONCE_BYTES)
        self.hello = bytearray()


class ControlServer:
    """Rank 0's ends of the control connections, one per worker rank of a group of ``world_size`` ranks whose key is
    ``key``, accepted on ``listener`` (listening on the group's address, any free port) while the group starts."""

    def __init__(self, listener: socket.socket, key: bytes, world_size: int):
        self.listener = listener
        self.key, self.world_size = key, world_size
        self.port: int = listener.getsockname()[1]
        listener.setblocking(False)
        self.links: dict[int, _Link] = {}
        self.started = False  # every rank joined: later connections are refused
        self._handshakes: list[_Handshake] = []
        self._changed = threading.Condition()  # a reader took something from a connection
        self._closing = False
        self._turned_away = 0  # connections closed at once (too many handshakes) and not logged yet
        self._turned_away_from = ""  # the last one's address
        self._turned_away_logged = -1.0

    # -- start-up -----------------------------------------------------------------------------------------------

    def accept_waiting(self) -> None:
        """Take the connections waiting now and move every handshake on as far as it goes without waiting; a
        connection beyond ``HANDSHAKES`` running handshakes is closed at once (logged, at most once a second). An
        accepted one joins ``links``."""
        while not self.started:
            try:
                sock, address = self.listener.accept()
            except (BlockingIOError, socket.timeout, InterruptedError):
                break
            except OSError:  # the listener was closed
                break
            if len(self._handshakes) >= HANDSHAKES:
                sock.close()
                self._turned_away += 1
                self._turned_away_from = _where(address)
                continue
            handshake = _Handshake(sock, address, time.monotonic() + HELLO_S)
            sock.setblocking(False)
            try:
                if sock.send(_MAGIC + handshake.ours) != len(_MAGIC) + NONCE_BYTES:
                    raise OSError("its challenge did not fit in one send")
            except OSError as exc:
                self._drop(handshake, f"its handshake failed ({exc})")
                continue
            self._handshakes.append(handshake)
        self._handshakes = [h for h in self._handshakes if not self._advance(h)]
        self._log_turned_away()

    def _log_turned_away(self, now: bool = False) -> None:
        """Log the connections closed at once since the last such line: at most one line a second (``now``: at
        once)."""
        if self._turned_away and (now or time.monotonic() - self._turned_away_logged >= 1.0):
            log.warning("OmniHooks Sequence Parallel: closed %d control connection(s) at once (the last from %s): %d "
                        "handshakes were running already, the most at once", self._turned_away,
                        self._turned_away_from, HANDSHAKES)
            self._turned_away, self._turned_away_logged = 0, time.monotonic()

    def _drop(self, handshake: _Handshake, why: str) -> None:
        log.warning("OmniHooks Sequence Parallel: refused a control connection from %s: %s",
                    _where(handshake.address), why)
        handshake.sock.close()

    def _advance(self, handshake: _Handshake) -> bool:
        """Move ``handshake`` on; whether it is over (accepted, refused or failed)."""
        sock = handshake.sock
        try:
            while len(handshake.hello) < _HELLO.size:
                if time.monotonic() > handshake.deadline:
                    self._drop(handshake, f"it did not finish its handshake within {HELLO_S:g} s")
                    return True
                try:
                    chunk = sock.recv(_HELLO.size - len(handshake.hello))
                except (BlockingIOError, InterruptedError):
                    return False
                if not chunk:
                    raise EOFError("the connection was closed")
                handshake.hello += chunk
            rank, theirs, proof = _HELLO.unpack(handshake.hello)
            rank_bytes = _HELLO.pack(rank, b"", b"")[:8]
            if not proves(self.key, "worker", proof, handshake.ours, theirs, rank_bytes):
                self._drop(handshake, "it does not prove it holds this group's secret")
                return True
            sock.settimeout(max(0.001, handshake.deadline - time.monotonic()))
            sock.sendall(mac(self.key, "rank 0", theirs, handshake.ours, rank_bytes))
            refusal = self._refusal(rank)
            if refusal is not None:
                send_frame(sock, 0, refusal.encode())
                self._drop(handshake, refusal)
                return True
            configure(sock)
            send_frame(sock, 0)
            sock.settimeout(None)
            self._join(rank, sock)
        except (OSError, EOFError, struct.error) as exc:
            self._drop(handshake, f"its handshake failed ({exc or type(exc).__name__})")
        return True

    def _refusal(self, rank: int) -> str | None:
        if not 0 < rank < self.world_size:
            return (f"rank {rank} is outside 1..{self.world_size - 1} (rank 0 is the ComfyUI process; world_size "
                    f"{self.world_size})")
        if rank in self.links:
            return (f"rank {rank} has already joined from another process; give each worker its own rank (--rank, "
                    "or --first-rank under torchrun)")
        return None

    def _join(self, rank: int, sock: socket.socket) -> None:
        link = _Link(rank, sock)
        link.reader = threading.Thread(target=self._read, args=(link,), daemon=True,
                                       name=f"omnihooks-sp-control-reader-{rank}")
        with self._changed:
            self.links[rank] = link
        link.reader.start()

    def missing(self, world_size: int) -> list[int]:
        """The worker ranks that have not connected yet."""
        return [rank for rank in range(1, world_size) if rank not in self.links]

    def stop_listening(self) -> None:
        """No more connections; a handshake still running is closed."""
        self.started = True
        self.listener.close()
        for handshake in self._handshakes:
            handshake.sock.close()
        self._handshakes = []
        self._log_turned_away(now=True)

    # -- what the workers send ----------------------------------------------------------------------------------

    def _read(self, link: _Link) -> None:
        """A worker's connection, read as it comes until it ends: answers queued, heartbeats and traceback kept."""
        try:
            while True:
                serial, data = receive_frame(link.sock, keep_waiting=lambda: not self._closing)
                with self._changed:
                    if serial == BEAT:
                        self._beat(link, data)
                    elif serial == REPORT:
                        link.report = data.decode(errors="replace")
                    else:
                        link.answers.append((serial, data))
                    self._changed.notify_all()
        except (OSError, EOFError, FrameError, struct.error) as exc:
            with self._changed:
                link.ended = str(exc) or type(exc).__name__
                self._changed.notify_all()

    def _beat(self, link: _Link, data: bytearray) -> None:
        """A heartbeat: fresh when its HMAC holds for this rank and its count rose; anything else is no information."""
        counted, proof = bytes(data[:_COUNT.size]), bytes(data[_COUNT.size:])
        if len(data) == _COUNT.size + MAC_BYTES and proves(self.key, f"beat/{link.rank}", proof, counted):
            count = _COUNT.unpack(counted)[0]
            if count > link.count:
                link.count, link.last_beat = count, time.monotonic()
                return
        if not link.complained:
            link.complained = True
            log.warning("OmniHooks Sequence Parallel: ignored a heartbeat of rank %d that is not signed for it or "
                        "does not count up", link.rank)

    def stalled(self, rank: int, since: float, stall_s: float) -> bool:
        """Whether no fresh heartbeat came from ``rank`` for ``stall_s`` since ``since`` (``time.monotonic()``; the
        grace of a wait that begins)."""
        with self._changed:
            link = self.links.get(rank)
            return link is not None and time.monotonic() - max(link.last_beat, since) >= stall_s

    def ended(self, rank: int) -> str | None:
        """Why ``rank``'s connection ended, None while it is open."""
        with self._changed:
            link = self.links.get(rank)
            return None if link is None else link.ended

    def reported_error(self, rank: int) -> str | None:
        """The last line of the traceback ``rank`` sent, None when it sent none."""
        with self._changed:
            link = self.links.get(rank)
            text = None if link is None else link.report
        if text is None:
            return None
        lines = [line for line in text.strip().splitlines() if line.strip()]
        return lines[-1].strip() if lines else "(no message)"

    # -- commands -----------------------------------------------------------------------------------------------

    def send(self, serial: int, data: bytes, timeout_s: float) -> None:
        """Command ``serial`` to every worker; ControlError naming the first rank it could not be sent to."""
        for rank, link in self.links.items():
            link.sock.settimeout(timeout_s)
            try:
                send_frame(link.sock, serial, data)
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
        start = time.monotonic()
        deadline, check = start + timeout_s, start + CHECK_S
        got: dict[int, bytearray] = {}
        with self._changed:
            while True:
                for rank, link in sorted(self.links.items()):
                    if rank not in got and link.answers:
                        answered, text = link.answers.popleft()
                        if answered != serial:
                            raise ControlError(rank, f"answered command {answered} to command {serial} (out of step)")
                        got[rank] = text
                waiting = [rank for rank in sorted(self.links) if rank not in got]
                if not waiting:
                    break
                for rank in waiting:
                    if self.links[rank].ended is not None:
                        raise ControlError(rank, f"closed its control connection ({self.links[rank].ended})")
                now = time.monotonic()
                if now >= check and unresponsive is not None:
                    check = now + CHECK_S
                    for rank in waiting:
                        why = unresponsive(rank)
                        if why is not None:
                            raise ControlError(rank, why)
                if now >= deadline:
                    raise ControlError(waiting[0], f"did not answer command {serial} within {timeout_s:.0f} s")
                self._changed.wait(max(0.0, min(check, deadline) - now))
        return {rank: bytes(text).decode(errors="replace") for rank, text in got.items() if text}

    def broadcast_quietly(self, serial: int, data: bytes, timeout_s: float) -> None:
        """Command ``serial`` to every worker that takes it within ``timeout_s``, unanswered (the "exit")."""
        for link in self.links.values():
            link.sock.settimeout(timeout_s)
            try:
                send_frame(link.sock, serial, data)
            except OSError:
                pass

    def close(self) -> None:
        self.stop_listening()
        self._closing = True
        for link in self.links.values():
            try:
                link.sock.shutdown(socket.SHUT_RDWR)  # wakes its reader
            except OSError:
                pass
            link.sock.close()
        for link in self.links.values():
            if link.reader is not None and link.reader is not threading.current_thread():
                link.reader.join(timeout=5)
        self.links.clear()


class RefusedRank(ValueError):
    """Rank 0 refused this worker's rank (taken, or outside the group)."""


class ControlClient:
    """A worker's end of its control connection to rank 0: proves it holds ``key`` and claims ``rank``, within
    ``HELLO_S`` (or ``timeout_s`` when shorter) for the whole exchange. ConnectionError when rank 0 closes the
    connection or does not prove it holds the key; RefusedRank when it refuses the rank."""

    def __init__(self, host: str, port: int, rank: int, timeout_s: float, key: bytes):
        self.rank, self._key = rank, key
        deadline = time.monotonic() + min(timeout_s, HELLO_S)
        self.sock = socket.create_connection((host, port), timeout=min(timeout_s, HELLO_S))
        try:
            self._prove(deadline)
        except BaseException:
            self.sock.close()
            raise
        self.sock.settimeout(POLL_S)
        self._out = self.sock.dup()  # sends block on their own (no timeout), shared by the main and heartbeat threads
        self._out.settimeout(None)
        self._sending = threading.Lock()
        self._stopped = threading.Event()
        self._heart: threading.Thread | None = None

    def _prove(self, deadline: float) -> None:
        try:
            challenge = receive_exact(self.sock, len(_MAGIC) + NONCE_BYTES, deadline=deadline)
        except EOFError:
            raise ConnectionError("rank 0 closed the control connection before its challenge (it had too many "
                                  "connections to check at once, or the group started already)") from None
        except socket.timeout:
            raise ConnectionError(f"rank 0 sent no challenge within {HELLO_S:.0f} s") from None
        if challenge[:len(_MAGIC)] != _MAGIC:
            raise ConnectionError("rank 0's control port answered with something else than this pack's handshake "
                                  "(another version of the pack on rank 0?)")
        theirs, ours = bytes(challenge[len(_MAGIC):]), secrets.token_bytes(NONCE_BYTES)
        rank_bytes = _HELLO.pack(self.rank, b"", b"")[:8]
        self.sock.sendall(_HELLO.pack(self.rank, ours, mac(self._key, "worker", theirs, ours, rank_bytes)))
        try:
            proof = receive_exact(self.sock, MAC_BYTES, deadline=deadline)
        except EOFError:
            raise ConnectionError("rank 0 closed the control connection: it does not hold the same group secret "
                                  "(OMNIHOOKS_SP_SECRET on both machines?)") from None
        except socket.timeout:
            raise ConnectionError(f"rank 0 did not finish the handshake within {HELLO_S:.0f} s") from None
        if not proves(self._key, "rank 0", proof, ours, theirs, rank_bytes):
            raise ConnectionError("rank 0 did not prove it holds this group's secret")
        configure(self.sock)
        try:
            _, refusal = receive_frame(self.sock, deadline=deadline)
        except (EOFError, socket.timeout) as exc:
            raise ConnectionError(f"rank 0 did not accept the rank ({exc or type(exc).__name__})") from None
        if refusal:
            raise RefusedRank(f"Sequence Parallel worker: {refusal.decode(errors='replace')}")

    @property
    def local_address(self) -> str:
        """This end's address: on the interface this machine reaches rank 0 through."""
        return self.sock.getsockname()[0]

    def receive(self, give_up: Callable[[], bool]) -> tuple[int, bytearray] | None:
        """The next command's serial and bytes; blocks until rank 0 sends one. None when ``give_up()`` (checked every
        ``POLL_S`` while waiting) says to stop waiting. EOFError when rank 0 closed the connection."""
        try:
            return receive_frame(self.sock, keep_waiting=lambda: not give_up(), limit=COMMAND_LIMIT)
        except socket.timeout:
            return None

    def _send(self, serial: int, data: bytes) -> None:
        with self._sending:
            send_frame(self._out, serial, data)

    def answer(self, serial: int, refusal: str | None) -> None:
        """Accept command ``serial`` (``refusal`` None), or refuse it with a text for rank 0's error."""
        self._send(serial, b"" if refusal is None else refusal.encode() or b"(no reason given)")

    def report(self, text: str) -> None:
        """Send rank 0 the traceback of a command that failed here (its end, when it is longer than rank 0 reads)."""
        self._send(REPORT, text.encode()[-ANSWER_LIMIT:])

    def start_heartbeat(self) -> None:
        """Beat every ``BEAT_S`` from a daemon thread until ``close`` (or the connection's end)."""
        def beat() -> None:
            count = 0
            while not self._stopped.wait(0 if count == 0 else BEAT_S):
                count += 1
                try:
                    self._send(BEAT, beat_frame(self._key, self.rank, count))
                except OSError:  # rank 0 is gone: the main thread notices on its own
                    return

        self._heart = threading.Thread(target=beat, name=f"omnihooks-sp-heartbeat-{self.rank}", daemon=True)
        self._heart.start()

    def close(self) -> None:
        self._stopped.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self._heart is not None:
            self._heart.join(timeout=5)
        self._out.close()
        self.sock.close()


def _where(address) -> str:
    return f"{address[0]}:{address[1]}" if isinstance(address, tuple) and len(address) >= 2 else str(address)
