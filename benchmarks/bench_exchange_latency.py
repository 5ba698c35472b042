"""What one sequence-parallel exchange costs between CPU ranks: a gloo collective vs the direct links, side by side.

Each of 2 processes (one thread each) computes for ``--work-ms`` (a busy loop: the model's own work between two
exchanges), then exchanges a tensor of ``--kib`` KiB with the other through the same ``Communicator`` call a model
call makes (``all_gather``, ``all_to_all``), once over the gloo process group and once over ``PeerLinks``, rounds
interleaved. The table gives the time per round minus the work, in microseconds: the median and the 90th percentile
(a helper thread that wakes late shows in the tail).

Run: .venv/bin/python benchmarks/bench_exchange_latency.py [--rounds 300] [--work-ms 1] [--kib 16]
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from omni_hooks.sequence_parallel.comm import CommStats, Communicator  # noqa: E402
from omni_hooks.sequence_parallel.links import PeerLinks  # noqa: E402
from omni_hooks.sequence_parallel.mesh import RankGroup  # noqa: E402

WORLD = 2


def work(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def rank_main(rank: int, port: int, args: argparse.Namespace, results) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    links = PeerLinks.connect(dist.PrefixStore("links", store), rank, WORLD, timeout_s=60)
    ranks = tuple(range(WORLD))
    ways = {"gloo": Communicator(RankGroup(ranks, rank, dist.group.WORLD), CommStats()),
            "direct links": Communicator(RankGroup(ranks, rank, dist.group.WORLD, links), CommStats())}
    x = torch.randn(args.kib * 256)
    exchanges = {"all_gather": lambda c: c.all_gather(x, 0, "bench"),
                 "all_to_all": lambda c: c.all_to_all(x.view(WORLD, -1), "bench")}
    times = {(op, way): [] for op in exchanges for way in ways}
    for round_ in range(args.rounds + 20):
        for op, exchange in exchanges.items():
            for way, comm in ways.items():
                start = time.perf_counter()  # no barrier: the exchange itself keeps the two ranks in step
                work(args.work_ms / 1e3)
                exchange(comm)
                if round_ >= 20:
                    times[op, way].append(time.perf_counter() - start - args.work_ms / 1e3)
    if rank == 0:
        results.update({key: (statistics.median(t), statistics.quantiles(t, n=10)[-1]) for key, t in times.items()})
    links.close()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--work-ms", type=float, default=1.0)
    parser.add_argument("--kib", type=int, default=16)
    args = parser.parse_args()
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    load_before = os.getloadavg()[0]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(rank_main, args=(port, args, results), nprocs=WORLD, join=True)
        results = dict(results)
    print(f"2 CPU processes, 1 thread each; {args.work_ms:g} ms of work, then one exchange of {args.kib} KiB per "
          f"rank; {args.rounds} interleaved rounds; 1-minute load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after\n")
    print("| exchange | gloo, median (90th percentile) µs | direct links, median (90th percentile) µs |")
    print("|---|---|---|")
    for op in ("all_gather", "all_to_all"):
        cells = [f"{results[op, way][0] * 1e6:.0f} ({results[op, way][1] * 1e6:.0f})" for way in ("gloo", "direct links")]
        print(f"| {op} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
