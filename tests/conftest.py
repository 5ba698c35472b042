"""Suite-wide: report whether host tests run, and skip them (and CUDA tests without CUDA) in one clear line when they
cannot."""
from __future__ import annotations

import pytest

from omnitest.comfy_path import comfyui_path, skip_reason
from omnitest.rank_pool import RankPool

HOST_MARKERS = ("host", "server", "browser")

# the one ComfyUI server process the server and browser tests share
pytest_plugins = ["omnitest.server_fixtures"]


def pytest_report_header(config: pytest.Config) -> str:
    root = comfyui_path()
    if root is None:
        return f"host tests: SKIPPED, {skip_reason()}"
    return f"host tests: using ComfyUI at {root}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if comfyui_path() is None:
        skip = pytest.mark.skip(reason=skip_reason())
        for item in items:
            if any(item.get_closest_marker(m) for m in HOST_MARKERS):
                item.add_marker(skip)
    if any(item.get_closest_marker("cuda") for item in items):
        import torch

        if not torch.cuda.is_available():
            skip_cuda = pytest.mark.skip(reason="no CUDA device (tests marked cuda need one)")
            for item in items:
                if item.get_closest_marker("cuda"):
                    item.add_marker(skip_cuda)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """One line per distinct skip reason (not one per test): a skipped host test is not a passed one."""
    reasons: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    for reason, count in sorted(reasons.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"SKIPPED {count} test(s): {reason}")


@pytest.fixture(scope="session")
def rank_pool():
    """``rank_pool(world_size)`` -> a ``RankPool`` (gloo on loopback), shared per world size by the multi-process
    tests (spawning costs seconds per rank); every pool is closed at the end of the session."""
    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        if world_size not in pools:
            pools[world_size] = RankPool(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()
