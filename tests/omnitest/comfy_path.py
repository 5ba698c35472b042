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
