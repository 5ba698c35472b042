"""Direct links between CPU ranks (``PeerLinks``): the exchanges a ``Communicator`` makes over them give what the
torch.distributed collectives give, a peer that hangs, leaves or is out of step fails the exchange in bounded time
naming it, and a held check runs before a rank's first exchange.

Ranks are threads of this process here (each with its own ``PeerLinks``, connected through an in-process store); the
host tests run the same links between real processes.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Iterator

import pytest
import torch
import torch.distributed as dist

from omni_hooks.sequence_parallel.comm import CommStats, Communicator
from omni_hooks.sequence_parallel.links import PeerLinkError, PeerLinks
from omni_hooks.sequence_parallel.mesh import RankGroup

DEADLINE_S = 30.0


def connected(world: int, timeout_s: float = 10.0) -> list[PeerLinks]:
    store = dist.HashStore()
    with ThreadPoolExecutor(world) as pool:
        futures = [pool.submit(PeerLinks.connect, store, rank, world, timeout_s) for rank in range(world)]
        return [f.result(timeout=DEADLINE_S) for f in futures]


@contextmanager
def linked(world: int, timeout_s: float = 10.0) -> Iterator[list[PeerLinks]]:
    """``world`` connected ranks' links, closed afterwards."""
    made = connected(world, timeout_s)
    try:
        yield made
    finally:
        for link in made:
            link.close()


def on_every_rank(links: list[PeerLinks], task: Callable[[Communicator], object]) -> list:
    """``task(communicator)`` on every rank at once (one thread each); the results in rank order."""
    world = len(links)
    comms = [Communicator(RankGroup(tuple(range(world)), rank, links=links[rank]), CommStats())
             for rank in range(world)]
    with ThreadPoolExecutor(world) as pool:
        futures = [pool.submit(task, comm) for comm in comms]
        return [f.result(timeout=DEADLINE_S) for f in futures]


@pytest.fixture(params=[2, 3], ids=["2 ranks", "3 ranks"])
def links(request):
    with linked(request.param) as made:
        yield made


def data(rank: int, shape=(4, 5), dtype=torch.float32) -> torch.Tensor:
    return (torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape) * 0.25 + 100 * rank).to(dtype)


def test_all_to_all_gives_each_rank_the_chunk_every_rank_addressed_to_it(links):
    world = len(links)
    got = on_every_rank(links, lambda c: c.all_to_all(torch.stack([data(c.group.rank) + i for i in range(world)]),
                                                      "test"))
    for rank, out in enumerate(got):
        assert torch.equal(out, torch.stack([data(source) + rank for source in range(world)]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool])
def test_all_gather_concatenates_every_ranks_tensor_in_rank_order(links, dtype):
    world = len(links)
    got = on_every_rank(links, lambda c: c.all_gather(data(c.group.rank, dtype=dtype), 1, "test"))
    want = torch.cat([data(rank, dtype=dtype) for rank in range(world)], 1)
    assert all(out.dtype == dtype and torch.equal(out, want) for out in got)


def test_a_shift_receives_the_previous_ranks_tensor(links):
    world = len(links)
    got = on_every_rank(links, lambda c: c.start_shift(data(c.group.rank), "test").wait())
    assert all(torch.equal(out, data((rank - 1) % world)) for rank, out in enumerate(got))


def test_all_reduce_gives_every_rank_the_same_bits(links):
    world = len(links)
    values = [torch.randn(64, dtype=torch.float32, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    sums = on_every_rank(links, lambda c: c.all_reduce(values[c.group.rank], "sum", "test"))
    maxima = on_every_rank(links, lambda c: c.all_reduce(values[c.group.rank], "max", "test"))
    assert all(torch.equal(s, sums[0]) for s in sums) and torch.allclose(sums[0], sum(values))
    assert all(torch.equal(m, torch.stack(values).amax(0)) for m in maxima)


def test_large_messages_both_ways_at_once_do_not_wait_on_each_other():
    with linked(2) as two:  # 32 MiB each way: more than the kernel buffers, so each rank receives while it sends
        got = on_every_rank(two, lambda c: c.all_gather(torch.full((8, 1024, 1024), float(c.group.rank)), 0, "x"))
        assert all(out.shape == (16, 1024, 1024) and out[:8].eq(0).all() and out[8:].eq(1).all() for out in got)


def test_a_peer_that_sends_nothing_fails_the_exchange_within_the_timeout_naming_it():
    with linked(2, timeout_s=0.5) as two:
        started = time.monotonic()
        with pytest.raises(PeerLinkError, match="rank 1: exchanged nothing for") as failure:
            two[0].exchange({1: data(0)}, {1: torch.empty(4, 5)})
        assert failure.value.rank == 1 and time.monotonic() - started < 5


def test_a_peer_that_closes_its_connection_fails_the_exchange_at_once():
    two = connected(2, timeout_s=20)
    two[1].close()
    started = time.monotonic()
    with pytest.raises(PeerLinkError, match="rank 1: closed its connection"):
        two[0].exchange({1: data(0)}, {1: torch.empty(4, 5)})
    assert time.monotonic() - started < 5  # not the 20 s timeout
    two[0].close()


def test_a_message_of_another_length_is_an_error_not_a_misread():
    with linked(2, timeout_s=5) as two:
        sender = threading.Thread(target=lambda: two[1].exchange({0: data(1, shape=(3,))}, {}))
        sender.start()
        with pytest.raises(PeerLinkError, match="sent 12 bytes where 80 were expected"):
            two[0].exchange({}, {1: torch.empty(4, 5)})
        sender.join(timeout=DEADLINE_S)


def test_a_held_check_runs_once_before_the_first_exchange_and_a_failing_one_sends_nothing():
    with linked(2, timeout_s=1.0) as two:
        ran = []

        def task(comm: Communicator):
            comm.gate.hold(lambda: ran.append(comm.group.rank))
            first = comm.all_gather(data(comm.group.rank), 0, "test")
            second = comm.all_gather(data(comm.group.rank), 0, "test")
            return torch.equal(first, second)

        assert on_every_rank(two, task) == [True, True]
        assert sorted(ran) == [0, 1]

        comm = Communicator(RankGroup((0, 1), 0, links=two[0]), CommStats())
        comm.gate.hold(lambda: (_ for _ in ()).throw(ValueError("refused")))
        with pytest.raises(ValueError, match="refused"):
            comm.all_gather(data(0), 0, "test")
        with pytest.raises(PeerLinkError, match="exchanged nothing"):  # rank 1 got nothing from rank 0
            two[1].exchange({}, {0: torch.empty(4, 5)})
