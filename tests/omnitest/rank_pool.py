"""Multi-process tests in one place: a pool of spawned ranks in one torch.distributed group on loopback.

``RankPool(world_size)`` spawns ``world_size`` processes (torch.multiprocessing, "spawn") that join one gloo group
through a TCPStore this process hosts on 127.0.0.1 with an OS-chosen free port, then wait for tasks.
``pool.run(fn, *args, timeout=...)`` runs module-level function ``fn(*args)`` on every rank (the rank reads
``torch.distributed.get_rank()``) and returns the per-rank results in rank order. A rank that raises fails the call
with every rank's traceback; a call that does not finish within ``timeout`` seconds fails too, and in both cases the
pool is torn down (children terminated, then killed) so that nothing hangs and no process or port is left; the next
``run`` starts a fresh pool. Spawning costs seconds per rank on a small machine, so tests share a pool per world
size (see the ``rank_pool`` fixture in tests/unit/sequence_parallel/conftest.py).
"""
from __future__ import annotations

import datetime
import importlib.util
import os
import queue
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HOST = "127.0.0.1"
START_TIMEOUT_S = 240.0
# a collective that waits longer than this raises inside the rank (the pool's own timeout normally fires first)
COLLECTIVE_TIMEOUT_S = 120.0
GRACE_AFTER_ERROR_S = 5.0

_loaded: dict[str, Any] = {}


def _load(path: str, qualname: str) -> Callable:
    module = _loaded.get(path)
    if module is None:
        name = f"_rank_task_{len(_loaded)}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        _loaded[path] = module
    target = module
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _exit_with_parent(parent_pid: int) -> None:
    """End this rank when the pool's process is gone (killed, so its fixtures never closed the pool): an orphaned
    rank would otherwise wait on its task queue forever."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _worker(rank: int, world_size: int, port: int, backend: str, tasks, results, parent_pid: int) -> None:
    _exit_with_parent(parent_pid)
    os.environ["MASTER_ADDR"] = HOST
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore(HOST, port, is_master=False,
                              timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        results.put((None, rank, "ready", None))
    except BaseException:
        results.put((None, rank, "error", traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, path, qualname, args = task
        try:
            value = _load(path, qualname)(*args)
            results.put((task_id, rank, "ok", value))
        except BaseException:
            results.put((task_id, rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


class RankPoolError(AssertionError):
    """A task failed or timed out on the pool's ranks."""


class RankPool:
    def __init__(self, world_size: int, backend: str = "gloo"):
        self.world_size = world_size
        self.backend = backend
        self._processes: list = []
        self._task_id = 0

    @property
    def alive(self) -> bool:
        return bool(self._processes) and all(p.is_alive() for p in self._processes)

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._processes = [ctx.Process(target=_worker, daemon=True,
                                       args=(r, self.world_size, self._store.port, self.backend, self._tasks[r],
                                             self._results, os.getpid()))
                           for r in range(self.world_size)]
        for p in self._processes:
            p.start()
        self._collect(None, START_TIMEOUT_S, "start")

    def run(self, fn: Callable, *args: Any, timeout: float = 60.0) -> list:
        """``fn(*args)`` on every rank; the results in rank order. ``fn`` must be a module-level function."""
        if not self.alive:
            self.close()
            self._start()
        self._task_id += 1
        path = sys.modules[fn.__module__].__file__
        for q in self._tasks:
            q.put((self._task_id, path, fn.__qualname__, args))
        return self._collect(self._task_id, timeout, fn.__name__)

    def _collect(self, task_id: int | None, timeout: float, what: str) -> list:
        values: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(values) + len(errors) < self.world_size:
            now = time.monotonic()
            if errors:
                deadline = min(deadline, now + GRACE_AFTER_ERROR_S)
            try:
                got_id, rank, status, value = self._results.get(timeout=max(0.05, min(0.5, deadline - now)))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._processes) if not p.is_alive() and r not in values]
                if time.monotonic() >= deadline or dead:
                    self.close()
                    missing = sorted(set(range(self.world_size)) - set(values) - set(errors))
                    raise RankPoolError(
                        f"{what}: ranks {missing} did not finish within {timeout:.0f} s"
                        + (f" (dead: {dead})" if dead else "")
                        + "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
                continue
            if got_id != task_id:
                continue
            (errors if status == "error" else values)[rank] = value
        if errors:
            self.close()
            raise RankPoolError(f"{what} failed:" + "".join(f"\n--- rank {r} ---\n{tb}"
                                                            for r, tb in sorted(errors.items())))
        return [values[r] for r in range(self.world_size)]

    def close(self) -> None:
        """Stop every child (politely, then terminate, then kill) and release the store's port."""
        for p, q in zip(self._processes, getattr(self, "_tasks", [])):
            if p.is_alive():
                try:
                    q.put(None)
                except Exception:
                    pass
        deadline = time.monotonic() + 5
        for p in self._processes:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._processes:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._processes = []
        self._store = None
