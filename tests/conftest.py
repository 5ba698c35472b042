"""Suite-wide: report whether host tests run, and skip them in one clear line when they cannot."""
from __future__ import annotations

import pytest

from omnitest.comfy_path import comfyui_path, skip_reason

HOST_MARKERS = ("host", "server", "browser")


def pytest_report_header(config: pytest.Config) -> str:
    root = comfyui_path()
    if root is None:
        return f"host tests: SKIPPED, {skip_reason()}"
    return f"host tests: using ComfyUI at {root}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if comfyui_path() is not None:
        return
    skip = pytest.mark.skip(reason=skip_reason())
    for item in items:
        if any(item.get_closest_marker(m) for m in HOST_MARKERS):
            item.add_marker(skip)
