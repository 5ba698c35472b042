"""Where rank 0 of a sequence-parallel group listens, and what the platform must offer for a group at all.

``check_platform`` refuses, naming the platform and the fix, where torch.distributed, the backend or a store that
takes a listening socket is missing; ``listening_socket`` listens on one address only (TCPStore alone would listen on
every interface). Both raise ``SequenceParallelError``.
"""
from __future__ import annotations

import errno
import gc
import socket
import sys

import torch
import torch.distributed as dist

from .protocol import SequenceParallelError


def check_platform(backend: str) -> None:
    """SequenceParallelError naming this platform when it lacks what a group needs: torch.distributed with
    ``backend``, and its ``TCPStore`` taking a socket that listens on one address only."""
    where = f"Sequence Parallel cannot run on this platform ({sys.platform}, torch {torch.__version__}):"
    if not dist.is_available():
        raise SequenceParallelError(f"{where} this torch has no torch.distributed. Run without the Sequence Parallel "
                                    "node, or on Linux")
    available = {"gloo": getattr(dist, "is_gloo_available", None), "nccl": getattr(dist, "is_nccl_available", None)}
    if available.get(backend) is None or not available[backend]():
        other = [name for name, check in available.items() if check is not None and check()]
        raise SequenceParallelError(f"{where} its torch.distributed has no {backend} backend. "
                                    + (f"Set backend to {other[0]}, or run on Linux" if other else
                                       "Run without the Sequence Parallel node, or on Linux"))
    if not hasattr(socket.socket, "detach") or not hasattr(dist, "TCPStore"):
        raise SequenceParallelError(f"{where} it cannot hand a listening socket to torch.distributed's store. Run "
                                    "without the Sequence Parallel node, or on Linux")


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket listening on ``host``:``port`` only (TCPStore alone would listen on every interface).

    A closed group's store keeps its port until its last reference goes (a failed call's traceback holds the process
    groups, which hold the store): when the port is taken, garbage is collected and the bind tried once more."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    try:
        try:
            return _listen(family, kind, proto, address)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or not port:
                raise
            gc.collect()
            return _listen(family, kind, proto, address)
    except OSError as exc:
        raise SequenceParallelError(f"Sequence Parallel: cannot listen on {host}:{port} ({exc}); choose another "
                                    "master_port, or 0 when every rank is local") from exc


def _listen(family: int, kind: int, proto: int, address: tuple) -> socket.socket:
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock
