"""Where the tests find a ComfyUI checkout, its version, and the one line they print when there is none or when it
lacks a model class a test needs."""
from __future__ import annotations

import importlib
import os
import sys
from functools import lru_cache
from pathlib import Path

import pytest

PACK_ROOT = Path(__file__).resolve().parents[2]
if str(PACK_ROOT) not in sys.path:
    sys.path.insert(0, str(PACK_ROOT))

from tools.comfy_host import find_host, host_version  # noqa: E402


def comfyui_path() -> Path | None:
    """The ComfyUI the tests run on, searched as ``tools.comfy_host.find_host`` does (COMFYUI_PATH alone when set;
    else the ComfyUI holding this pack, ~/ComfyUI, a host fetched into .hosts/); None when there is none. Tests
    never fetch one: ``./run tests`` does, before pytest starts."""
    return find_host()


def comfyui_version() -> str | None:
    """The version of the ComfyUI at ``comfyui_path()`` (``?`` when it does not say), None without one."""
    root = comfyui_path()
    return None if root is None else host_version(root)


def host_label() -> str:
    """``ComfyUI <version> at <root>``, for headers and skip lines."""
    return f"ComfyUI {comfyui_version()} at {comfyui_path()}"


def skip_reason() -> str:
    if os.environ.get("COMFYUI_PATH"):
        where = f"at COMFYUI_PATH={os.environ['COMFYUI_PATH']}"
    else:
        where = "(COMFYUI_PATH unset; none holds this pack, none at ~/ComfyUI or in .hosts/)"
    return (f"no ComfyUI checkout {where}; `./run tests` fetches one, or set COMFYUI_PATH to a ComfyUI 0.3.64 or "
            "newer checkout to run host, server and browser tests")


@lru_cache(maxsize=None)
def _missing_class(module: str, name: str) -> bool:
    use_comfyui_in_process()
    try:
        return not hasattr(importlib.import_module(module), name)
    except ImportError:
        return True


def requires_comfy_class(module: str, name: str) -> pytest.MarkDecorator:
    """A mark that skips the test, in one line naming the ComfyUI version, when that ComfyUI's ``module`` has no
    ``name`` (a model class newer than the oldest supported host, or one a newer host removed). Without a ComfyUI
    the mark does nothing (the host marker already skips the test)."""
    if comfyui_path() is None:
        return pytest.mark.skipif(False, reason="")
    missing = _missing_class(module, name)
    return pytest.mark.skipif(missing, reason=f"ComfyUI {comfyui_version()} has no {module}.{name}")


def skip_without_comfy_class(module: str, name: str) -> None:
    """Skip the calling test now, with ``requires_comfy_class``'s line, when ComfyUI's ``module`` has no ``name``
    (for tests that learn which class they need only while running, e.g. from a parametrized tiny-model name)."""
    if _missing_class(module, name):
        pytest.skip(f"ComfyUI {comfyui_version()} has no {module}.{name}")


def use_comfyui_in_process(cpu: bool = True, before_device=None) -> Path | None:
    """Make ComfyUI importable in this process, on CPU unless ``cpu`` is False (then ComfyUI picks its device as it
    does when started); returns its root, or None when there is no checkout.

    Its root goes first on ``sys.path`` (ComfyUI's ``nodes``/``utils`` must win over same-named folders) and
    ``args.cpu`` is set before ``comfy.model_management`` is first imported, since it picks the device at import.
    ``before_device`` (optional) is called with ComfyUI's ``args`` just before that import, as ComfyUI's ``main.py``
    sets up what must precede it (e.g. comfy-aimdo's allocator).
    """
    import sys

    root = comfyui_path()
    if root is None:
        return None
    if str(root) in sys.path:
        sys.path.remove(str(root))
    sys.path.insert(0, str(root))
    from comfy.cli_args import args

    args.cpu = cpu
    if before_device is not None:
        before_device(args)
    import comfy.model_management  # noqa: F401  (device chosen now, with args.cpu set)

    return root
