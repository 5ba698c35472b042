"""A stranger to a Sequence Parallel group, in a process of its own: what anyone who reaches rank 0's address can do.
It runs until its stdin closes (``Stranger.stop``), then prints what it did as one JSON line.

    python sp_stranger.py flood STORE_PORT
        writes garbage under, and deletes, every key of the pack in the store (heartbeats, errors, the group), as fast
        as it can with a pause of a millisecond
    python sp_stranger.py replay STORE_PORT CONTROL_PORT FILE
        replays what it "captured" (FILE: JSON {"store": {key: hex}, "frames": [hex]}): each value under its key, over
        and over, and each frame on a fresh connection to the control port
    python sp_stranger.py slow CONTROL_PORT COUNT
        opens COUNT connections, reads each one's challenge (40 bytes) if it comes, then sends one byte a second on
        each; reports how many were challenged and how many rank 0 closed (and when)
"""
from __future__ import annotations

import datetime
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

HOST = "127.0.0.1"
PACK_KEYS = ("beat/1", "beat/2", "error/1", "error/2", "group")
PREFIXES = ("omnihooks_sp/", "omnihooks_sp//")  # as written, and as torch's PrefixStore spells the pack's keys


def _until_stdin_closes() -> threading.Event:
    closed = threading.Event()

    def watch() -> None:
        sys.stdin.buffer.read()
        closed.set()

    threading.Thread(target=watch, daemon=True).start()
    return closed


def _store(port: int):
    import torch.distributed as dist

    return dist.TCPStore(HOST, port, is_master=False, timeout=datetime.timedelta(seconds=10))


def flood(port: int, stop: threading.Event) -> dict:
    store, writes, deletes = _store(port), 0, 0
    keys = [prefix + key for prefix in PREFIXES for key in PACK_KEYS]
    while not stop.is_set():
        for key in keys:
            store.set(key, b"\xffgarbage:" + str(writes).encode())
            writes += 1
        if writes % 4 == 0:
            for key in keys:
                deletes += int(store.delete_key(key))
        time.sleep(0.001)
    return {"writes": writes, "deletes": deletes}


def replay(store_port: int, control_port: int, captured: Path, stop: threading.Event) -> dict:
    data = json.loads(captured.read_text())
    store, writes, tried, refused = _store(store_port), 0, 0, 0
    while not stop.is_set():
        for key, value in data["store"].items():
            store.set(key, bytes.fromhex(value))
            writes += 1
        for frame in data["frames"]:
            tried += 1
            try:
                with socket.create_connection((HOST, control_port), timeout=1) as sock:
                    sock.sendall(bytes.fromhex(frame))
                    sock.recv(64)
            except OSError:
                refused += 1
        time.sleep(0.05)
    return {"writes": writes, "connections_tried": tried, "connections_refused": refused}


def slow(port: int, count: int, stop: threading.Event) -> dict:
    start = time.monotonic()
    socks, challenged, closed_at = [], 0, {}
    for _ in range(count):
        sock = socket.create_connection((HOST, port), timeout=10)
        socks.append(sock)
    for i, sock in enumerate(socks):
        sock.settimeout(5)
        got = b""
        try:
            while len(got) < 40:
                chunk = sock.recv(40 - len(got))
                if not chunk:
                    break
                got += chunk
        except OSError:
            pass
        if len(got) == 40:
            challenged += 1
        else:
            closed_at[i] = time.monotonic() - start
    print(json.dumps({"challenged": challenged}), flush=True)

    def look(send: bool, wait_s: float) -> None:
        """Note the connections rank 0 closed (each still open gets a byte first, with ``send``)."""
        for i, sock in enumerate(socks):
            if i in closed_at:
                continue
            try:
                if send:
                    sock.sendall(b"x")
                sock.settimeout(wait_s)
                if sock.recv(1) == b"":
                    closed_at[i] = time.monotonic() - start
            except socket.timeout:
                pass
            except OSError:
                closed_at[i] = time.monotonic() - start

    while not stop.wait(1.0):
        look(send=True, wait_s=0.01)
    look(send=False, wait_s=0.5)  # once more when told to stop: a close since the last look counts too
    for sock in socks:
        sock.close()
    return {"challenged": challenged, "closed": len(closed_at)}


def main(argv: list[str]) -> int:
    stop = _until_stdin_closes()
    mode, args = argv[0], argv[1:]
    if mode == "flood":
        result = flood(int(args[0]), stop)
    elif mode == "replay":
        result = replay(int(args[0]), int(args[1]), Path(args[2]), stop)
    elif mode == "slow":
        result = slow(int(args[0]), int(args[1]), stop)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print(json.dumps(result), flush=True)
    return 0


class Stranger:
    """``sp_stranger.py`` running in a process of its own (``start``), until ``stop`` (which returns its report)."""

    def __init__(self, *argv):
        self.process = subprocess.Popen([sys.executable, __file__, *map(str, argv)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)

    def first_line(self, timeout_s: float = 60) -> dict:
        """The first line the stranger printed (``slow``: how many connections were challenged)."""
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(self.process.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        assert lines and lines[0].strip(), f"the stranger printed nothing within {timeout_s} s"
        return json.loads(lines[0])

    def stop(self, timeout_s: float = 30) -> dict:
        try:
            out, _ = self.process.communicate(input="", timeout=timeout_s)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait(timeout=10)
        assert self.process.returncode == 0, f"the stranger failed ({self.process.returncode})"
        return json.loads(out.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
