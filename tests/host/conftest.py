"""Host tests run in-process against a real ComfyUI checkout.

When one is found (``omnitest.comfy_path.comfyui_path()``), its root goes first on ``sys.path`` and ComfyUI is
told to run on CPU before ``comfy.model_management`` is first imported (it picks the device at import time).
When none is found nothing happens here: the suite-wide conftest skips every ``host``-marked test, and host
test modules import ``comfy`` only inside fixtures and tests, so they still collect.
"""
from __future__ import annotations

import sys

from omnitest.comfy_path import comfyui_path

_root = comfyui_path()
if _root is not None:
    _root_str = str(_root)
    if _root_str in sys.path:
        sys.path.remove(_root_str)
    sys.path.insert(0, _root_str)

    from comfy.cli_args import args as _comfy_args

    _comfy_args.cpu = True
    import comfy.model_management  # noqa: E402,F401  (device chosen now, with args.cpu set)


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    """ComfyUI's user directory pointed at a fresh folder for one test module (calibration files land there)."""
    import folder_paths

    previous = folder_paths.get_user_directory()
    path = tmp_path_factory.mktemp("user")
    folder_paths.set_user_directory(str(path))
    yield path
    folder_paths.set_user_directory(previous)
