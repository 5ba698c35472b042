"""Sequence Parallel in this process, for tests: a model with the feature attached (rank 0 runs here, its workers in
processes of their own), and a worker's control client joined to rank 0's control server."""
from __future__ import annotations

import threading
import time

from .pack import pack_module

LOOPBACK = "127.0.0.1"


def with_sequence_parallel(case, devices: tuple[str, ...] = ("cpu", "cpu"), port: int = 0, world_size: int = 2):
    """``case``'s model with Sequence Parallel attached over gloo on loopback (``devices``: the local ranks', rank 0
    first; ranks beyond them are remote and join at ``port``), its degrees 'auto'."""
    node = pack_module("nodes.sequence_parallel.node")
    features = pack_module("nodes.features")
    settings = pack_module("nodes.sequence_parallel.group").GroupSettings(world_size, "gloo", devices, LOOPBACK, port)
    config = node.config_for(case.patcher, settings, ulysses_degree=None, ring_degree=None)
    feature = features.AppliedFeature(node.KIND, features.Category.SEQUENCE_PARALLEL, node.NODE_TITLE, "1", config)
    return features.attach_feature(case.patcher, feature)


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
