"""Host tests run in-process against a real ComfyUI checkout.

When one is found (``omnitest.comfy_path.comfyui_path()``), its root goes first on ``sys.path`` and ComfyUI is
told to run on CPU before ``comfy.model_management`` is first imported (it picks the device at import time).
When none is found nothing happens here: the suite-wide conftest skips every ``host``-marked test, and host
test modules import ``comfy`` only inside fixtures and tests, so they still collect.
"""
from __future__ import annotations

import pytest

from omnitest.comfy_path import use_comfyui_in_process

use_comfyui_in_process()


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    """ComfyUI's user directory pointed at a fresh folder for one test module (calibration files land there)."""
    import folder_paths

    previous = folder_paths.get_user_directory()
    path = tmp_path_factory.mktemp("user")
    folder_paths.set_user_directory(str(path))
    yield path
    folder_paths.set_user_directory(previous)
