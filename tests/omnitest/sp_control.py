"""Sequence Parallel's control connections in one process, for tests: a worker's client joined to rank 0's server."""
from __future__ import annotations

import threading
import time

LOOPBACK = "127.0.0.1"


def join_client(control, server, rank: int, key: bytes, timeout_s: float = 10):
    """A ``control.ControlClient`` of ``server`` claiming ``rank`` with ``key``, its handshake served by the server's
    ``accept_waiting`` while it connects (from this thread). Raises what the client raised."""
    made, failed = [], []

    def connect():
        try:
            made.append(control.ControlClient(LOOPBACK, server.port, rank, timeout_s=5, key=key))
        except BaseException as exc:  # raised below, in the test's thread
            failed.append(exc)

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    end = time.monotonic() + timeout_s
    while thread.is_alive() and time.monotonic() < end:
        server.accept_waiting()
        thread.join(0.01)
    thread.join(5)
    if failed:
        raise failed[0]
    assert made, f"rank {rank} did not join within {timeout_s:.0f} s"
    return made[0]
