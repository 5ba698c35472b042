"""What multi-process tests check and how they stay bounded: this process's child processes and listening TCP ports,
a free loopback port, and a deadline that fails a test (killing the children, which unblocks any collective) instead
of letting it hang the suite."""
from __future__ import annotations

import gc
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import psutil
import pytest

LOOPBACK = "127.0.0.1"


def child_processes() -> list[psutil.Process]:
    """This process's living descendants (zombies already reaped are gone; a zombie still counts)."""
    return [p for p in psutil.Process().children(recursive=True) if p.is_running()]


def kill_children() -> None:
    """SIGKILL every descendant of this process (a stopped one too) and reap them."""
    children = child_processes()
    for p in children:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(children, timeout=10)


def listening_ports() -> set[int]:
    """The TCP ports this process listens on."""
    return {c.laddr.port for c in psutil.Process().net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


@contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    """Fail the test when the block takes longer than ``seconds``: at expiry every child process is killed (so a
    collective or a wait on them returns), and the block's end raises ``pytest.fail``."""
    fired = threading.Event()
    timer = threading.Timer(seconds, lambda: (fired.set(), kill_children()))
    timer.daemon = True
    start = time.monotonic()
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if fired.is_set():
            pytest.fail(f"{what} did not finish within {seconds:.0f} s (children killed after "
                        f"{time.monotonic() - start:.0f} s)")


@dataclass(frozen=True)
class Snapshot:
    """The child processes and listening ports this process had at one moment (e.g. a session-wide rank pool's)."""

    children: frozenset[int]
    ports: frozenset[int]

    @classmethod
    def now(cls) -> "Snapshot":
        return cls(frozenset(p.pid for p in child_processes()), frozenset(listening_ports()))


def assert_nothing_left(before: Snapshot, wait_s: float = 10.0) -> None:
    """No child process and no listening port beyond those of ``before`` (waits up to ``wait_s`` for exits; kills
    the new children it finds). Collects garbage first: a torch.distributed store or process group closes its sockets
    when its last reference goes."""
    gc.collect()

    def new_children() -> list[psutil.Process]:
        return [p for p in child_processes() if p.pid not in before.children]

    end = time.monotonic() + wait_s
    while (new_children() or listening_ports() - before.ports) and time.monotonic() < end:
        time.sleep(0.1)
    stray = new_children()
    left = [f"{p.pid} {' '.join(p.cmdline()[:6])}" for p in stray]
    ports = listening_ports() - before.ports
    for p in stray:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    assert not left, f"processes left: {left}"
    assert not ports, f"ports still listened on: {sorted(ports)}"
