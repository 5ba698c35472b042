"""Named calibration files in ComfyUI's user directory: <user>/omni_hooks/<kind>/<name>.json."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import folder_paths

PREFIX = "calibration: "
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._-]{0,99}$")


def directory(kind: str) -> Path:
    return Path(folder_paths.get_user_directory()) / "omni_hooks" / kind


def option(name: str) -> str:
    """The combo-box value that selects a calibration file."""
    return PREFIX + name


def parse_option(value: str) -> str | None:
    return value[len(PREFIX):] if value.startswith(PREFIX) else None


def check_name(name: str) -> str:
    name = name.strip()
    if not _SAFE_NAME.match(name) or name.endswith("."):
        raise ValueError(f"calibration name {name!r} may use letters, digits, space, '.', '_' and '-' only "
                         "(1-100 characters, starting with a letter or digit)")
    return name


def list_names(kind: str) -> list[str]:
    try:
        return sorted(p.stem for p in directory(kind).glob("*.json"))
    except OSError:
        return []


def save(kind: str, name: str, data: dict[str, Any]) -> Path:
    path = directory(kind) / f"{check_name(name)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
    return path


def load(kind: str, name: str) -> dict[str, Any]:
    path = directory(kind) / f"{check_name(name)}.json"
    if not path.is_file():
        raise ValueError(f"calibration file {path} does not exist (was it deleted or made on another machine?); "
                         f"run the calibrate node again or choose another variant")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"calibration file {path} cannot be read ({e}); run the calibrate node again "
                         f"or choose another variant") from None
    if not isinstance(data, dict):
        raise ValueError(f"calibration file {path} does not hold a JSON object; run the calibrate node again "
                         f"or choose another variant")
    return data
