"""Where the tests find a ComfyUI checkout, and the one line they print when there is none."""
from __future__ import annotations

import os
from pathlib import Path

PACK_ROOT = Path(__file__).resolve().parents[2]


def comfyui_path() -> Path | None:
    """COMFYUI_PATH if set, else ~/ComfyUI; None unless it holds ComfyUI's main.py."""
    root = Path(os.environ.get("COMFYUI_PATH") or Path.home() / "ComfyUI").expanduser()
    return root if (root / "main.py").is_file() else None


def skip_reason() -> str:
    where = os.environ.get("COMFYUI_PATH") or "~/ComfyUI"
    return (f"no ComfyUI checkout at {where} (set COMFYUI_PATH to a ComfyUI 0.3.64 checkout "
            "to run host, server and browser tests)")


def use_comfyui_in_process(cpu: bool = True) -> Path | None:
    """Make ComfyUI importable in this process, on CPU unless ``cpu`` is False (then ComfyUI picks its device as it
    does when started); returns its root, or None when there is no checkout.

    Its root goes first on ``sys.path`` (ComfyUI's ``nodes``/``utils`` must win over same-named folders) and
    ``args.cpu`` is set before ``comfy.model_management`` is first imported, since it picks the device at import.
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
    import comfy.model_management  # noqa: F401  (device chosen now, with args.cpu set)

    return root


def requires_comfy_class(module: str, name: str) -> None:
    """Skip the calling test, in one line naming the ComfyUI version, when ComfyUI's ``module`` has no ``name``
    (a model class newer than the checkout under test, e.g. ``comfy.model_base.Flux2`` on 0.3.64)."""
    import importlib

    import pytest

    if not hasattr(importlib.import_module(module), name):
        pytest.skip(f"ComfyUI {comfyui_version()} has no {module}.{name}")


def comfyui_version() -> str:
    """The version of the ComfyUI checkout under test (its ``comfyui_version.py``), or "(unknown version)"."""
    import re

    root = comfyui_path()
    text = (root / "comfyui_version.py").read_text(encoding="utf-8") if root and (
        root / "comfyui_version.py").is_file() else ""
    match = re.search(r"__version__\s*=\s*[\"']([^\"']+)", text)
    return match.group(1) if match else "(unknown version)"
