"""Fixtures of the cache host tests."""
from __future__ import annotations

import pytest


@pytest.fixture
def own_user_directory():
    """The quality benchmark's calibration points ComfyUI's user directory at a folder of its own: put it back after."""
    import folder_paths

    previous = folder_paths.get_user_directory()
    yield
    folder_paths.set_user_directory(previous)
