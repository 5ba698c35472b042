"""Collectives over one ``RankGroup`` that count what they send.

Every exchange sequence parallelism makes goes through a ``Communicator``, which adds the bytes this rank sends (the
payload that leaves the process; the chunk an all-to-all keeps for itself is not counted) to a ``CommStats`` under an
exchange kind. On a simulated mesh the same calls count the same bytes but move nothing and return uninitialised
tensors, so the accounting of a real model size (docs/benchmarks.md) comes from the code that runs, not a formula.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from .mesh import RankGroup


@dataclass
class CommRecord:
    calls: int = 0
    bytes_sent: int = 0


class CommStats:
    """Bytes sent by this rank, per exchange kind (e.g. "ulysses_all_to_all", "ring_hop", "output_all_gather")."""

    def __init__(self) -> None:
        self.by_kind: dict[str, CommRecord] = {}

    def add(self, kind: str, nbytes: int) -> None:
        record = self.by_kind.setdefault(kind, CommRecord())
        record.calls += 1
        record.bytes_sent += int(nbytes)

    @property
    def bytes_sent(self) -> int:
        return sum(r.bytes_sent for r in self.by_kind.values())

    def reset(self) -> None:
        self.by_kind.clear()

    def snapshot(self) -> dict[str, CommRecord]:
        return {kind: CommRecord(r.calls, r.bytes_sent) for kind, r in self.by_kind.items()}


class ExchangeGate:
    """What must happen on this rank before its next exchange, once: e.g. a host that sent a call to the other ranks
    checks that each accepted it, while this rank already computes up to its first collective. Every communicator of
    a run shares one gate; its first real collective after ``hold`` runs the check (which may raise: then no
    collective of the call has started on this rank)."""

    def __init__(self) -> None:
        self._pending: Callable[[], None] | None = None

    def hold(self, check: Callable[[], None]) -> None:
        """Run ``check`` before the next exchange (replacing a check not run yet)."""
        self._pending = check

    def release(self) -> None:
        """Run the pending check, if any, now."""
        check, self._pending = self._pending, None
        if check is not None:
            check()


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


class PendingShift:
    """A ring shift in flight; ``wait()`` returns the tensor received from the previous member."""

    def __init__(self, received: torch.Tensor, requests: list):
        self._received = received
        self._requests = requests

    def wait(self) -> torch.Tensor:
        for request in self._requests:
            request.wait()
        self._requests = []
        return self._received


class Communicator:
    """The collectives of one group, through torch.distributed (gloo between CPU ranks, NCCL between GPUs). A group
    of one sends nothing and returns its input. Before any real collective the ``gate``'s pending check runs."""

    def __init__(self, group: RankGroup, stats: CommStats, simulated: bool = False,
                 gate: ExchangeGate | None = None):
        self.group = group
        self.stats = stats
        self.simulated = simulated
        self.gate = gate if gate is not None else ExchangeGate()

    @property
    def size(self) -> int:
        return self.group.size

    def all_to_all(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        """``x`` is ``[size, ...]``: chunk ``i`` goes to member ``i``. Returns ``[size, ...]`` whose chunk ``j`` came
        from member ``j``."""
        size = self.size
        if size == 1:
            return x
        if x.shape[0] != size:
            raise ValueError(f"all_to_all: leading dim {x.shape[0]} != group size {size}")
        x = x.contiguous()
        self.stats.add(kind, _nbytes(x) * (size - 1) // size)
        out = torch.empty_like(x)
        if self.simulated:
            return out
        self.gate.release()
        dist.all_to_all_single(out, x, group=self.group.process_group)
        return out

    def all_gather(self, x: torch.Tensor, dim: int, kind: str) -> torch.Tensor:
        """Every member's ``x`` (same shape everywhere) concatenated along ``dim`` in member order."""
        size = self.size
        if size == 1:
            return x
        self.stats.add(kind, _nbytes(x) * (size - 1))
        if self.simulated:
            shape = list(x.shape)
            shape[dim] *= size
            return x.new_empty(shape)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(size)]
        self.gate.release()
        dist.all_gather(parts, x, group=self.group.process_group)
        return torch.cat(parts, dim)

    def start_shift(self, x: torch.Tensor, kind: str) -> PendingShift:
        """Start sending ``x`` to the next member (ring order) and receiving a same-shaped tensor from the previous."""
        x = x.contiguous()
        received = torch.empty_like(x)
        self.stats.add(kind, _nbytes(x))
        if self.simulated:
            return PendingShift(received, [])
        group = self.group
        self.gate.release()
        ops = [dist.P2POp(dist.isend, x, peer=group.global_rank(group.rank + 1), group=group.process_group),
               dist.P2POp(dist.irecv, received, peer=group.global_rank(group.rank - 1), group=group.process_group)]
        return PendingShift(received, dist.batch_isend_irecv(ops))

    def all_reduce(self, x: torch.Tensor, op: str, kind: str) -> torch.Tensor:
        """Element-wise "sum" or "max" over the members (a new tensor; ``x`` is not modified)."""
        out = x.clone()
        if self.size == 1:
            return out
        # a reduction's payload per rank, as for a ring all-reduce: 2·(n-1)/n of the tensor
        self.stats.add(kind, 2 * _nbytes(x) * (self.size - 1) // self.size)
        if self.simulated:
            return out
        self.gate.release()
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        dist.all_reduce(out, op=reduce_op, group=self.group.process_group)
        return out
