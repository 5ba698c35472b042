"""Suite-wide: report which host the host tests run on, and skip them (and CUDA tests without CUDA) in one clear line
when they cannot.

``OMNIHOOKS_REQUIRE_HOST=1`` (CI) turns a skipped host, server or browser test into a failure, unless it was skipped
for lacking CUDA or because its host lacks a model class it needs (``requires_comfy_class``): a missing host, browser
or template must not pass unseen.
"""
from __future__ import annotations

import os

import pytest

from omnitest.comfy_path import comfyui_path, comfyui_version, host_label, skip_reason
from omnitest.rank_pool import RankPool

HOST_MARKERS = ("host", "server", "browser")

# the one ComfyUI server process the server and browser tests share
pytest_plugins = ["omnitest.server_fixtures", "omnitest.browser"]


def pytest_report_header(config: pytest.Config) -> str:
    root = comfyui_path()
    if root is None:
        return f"host tests: SKIPPED, {skip_reason()}"
    return f"host tests: using {host_label()}"


CUDA_SKIP = "no CUDA device (tests marked cuda need one)"


def host_required() -> bool:
    return os.environ.get("OMNIHOOKS_REQUIRE_HOST", "") not in ("", "0")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and host_required() and any(item.get_closest_marker(m) for m in HOST_MARKERS)):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    if reason == CUDA_SKIP or reason.startswith(f"ComfyUI {comfyui_version()} has no "):
        return
    report.outcome = "failed"
    report.longrepr = f"host test skipped under OMNIHOOKS_REQUIRE_HOST=1: {reason}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if comfyui_path() is None:
        skip = pytest.mark.skip(reason=skip_reason())
        for item in items:
            if any(item.get_closest_marker(m) for m in HOST_MARKERS):
                item.add_marker(skip)
    if any(item.get_closest_marker("cuda") for item in items):
        import torch

        if not torch.cuda.is_available():
            skip_cuda = pytest.mark.skip(reason=CUDA_SKIP)
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
