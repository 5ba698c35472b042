"""Named calibration files in ComfyUI's user directory: <user>/omni_hooks/<kind>/<name>.json.

Every error raised here is a ``CalibrationFileError`` (a ``ValueError``) whose message names the file or folder and
says what to do. The format of a kind's contents (coefficients, curves) belongs to its node; this module checks what
every kind shares: a JSON object of at most ``MAX_FILE_BYTES``, nesting at most ``MAX_DEPTH`` deep, only finite
numbers, and text where text is expected (``TEXT_FIELDS``).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable

import folder_paths

PREFIX = "calibration: "
# a calibration file is a few KB, about 1 MB with its step profile's sketches; anything far larger is not one
MAX_FILE_BYTES = 4 * 1024 * 1024
MAX_DEPTH = 32                    # the deepest real file nests 3 levels (mag_ratios -> branch -> list)
TEXT_FIELDS = ("kind", "family", "variant", "signal", "layout")  # compared, used as keys or shown: must be text
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._-]{0,99}$")
log = logging.getLogger("OmniHooks")
_reported_unloadable: set[tuple[str, int]] = set()  # (path, mtime_ns) already logged by list_names


class CalibrationFileError(ValueError):
    """A calibration file or folder that cannot be used; the message names it and the fix."""


def directory(kind: str) -> Path:
    return Path(folder_paths.get_user_directory()) / "omni_hooks" / kind


def option(name: str) -> str:
    """The combo-box value that selects a calibration file."""
    return PREFIX + name


def parse_option(value: str) -> str | None:
    return value[len(PREFIX):] if isinstance(value, str) and value.startswith(PREFIX) else None


def check_name(name: object) -> str:
    """The stripped file name; ``CalibrationFileError`` for anything that is not a safe name (None included)."""
    if not isinstance(name, str):
        raise CalibrationFileError(
            f"calibration name must be text, got {'nothing' if name is None else type(name).__name__} "
            f"({str(name)[:40]!r}); type a name, or connect a node that outputs a STRING")
    stripped = name.strip()
    if not _SAFE_NAME.match(stripped) or stripped.endswith("."):
        raise CalibrationFileError(
            f"calibration name {stripped[:120]!r} may use letters, digits, space, '.', '_' and '-' only "
            "(1-100 characters, starting with a letter or digit)")
    return stripped


def path_of(kind: str, name: str) -> Path:
    """Where the calibration ``name`` of ``kind`` lives (the name is checked first)."""
    return directory(kind) / f"{check_name(name)}.json"


def _problem(value: Any, where: str, depth: int = 0) -> str | None:
    """The first thing in a JSON value no calibration may hold (non-finite number, nesting too deep), or None."""
    if depth > MAX_DEPTH:
        return f"{where or 'the data'} nests more than {MAX_DEPTH} levels deep"
    if isinstance(value, float) and not math.isfinite(value):
        return f"{where or 'the value'} is {value!r} (not a finite number)"
    if isinstance(value, dict):
        for key, item in value.items():
            found = _problem(item, f"{where}.{key}" if where else str(key), depth + 1)
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = _problem(item, f"{where}[{i}]", depth + 1)
            if found:
                return found
    return None


def _check_contents(kind: str, data: Any, what: str) -> None:
    """Raise ``CalibrationFileError`` (prefixed with ``what``) unless ``data`` is a usable calibration object."""
    if not isinstance(data, dict):
        raise CalibrationFileError(f"{what} does not hold a JSON object (found {type(data).__name__})")
    problem = _problem(data, "")
    if problem:
        raise CalibrationFileError(f"{what}: {problem}")
    for field in TEXT_FIELDS:
        if field in data and not isinstance(data[field], str):
            raise CalibrationFileError(f"{what}: '{field}' must be text, found {type(data[field]).__name__} "
                                       f"{json.dumps(data[field])[:60]}")
    if data.get("kind", kind) != kind:
        raise CalibrationFileError(f"{what} holds a {data['kind']!r} calibration, not {kind!r}")


def list_names(kind: str, validate: Callable[[str, dict[str, Any]], object] | None = None) -> list[str]:
    """The names of the calibration files of ``kind`` that load, sorted; what the variant list may offer.

    A file whose name is not a valid calibration name, that ``load`` refuses, or that ``validate(name, data)``
    rejects with a ``ValueError`` (a kind's own format check) is left out and logged once (per file version).
    """
    try:
        paths = sorted(directory(kind).glob("*.json"))
    except OSError:
        return []
    names = []
    for path in paths:
        try:
            data = load(kind, path.stem)
            if validate is not None:
                validate(path.stem, data)
        except ValueError as e:
            try:
                key = (str(path), path.stat().st_mtime_ns)
            except OSError:
                continue
            if key not in _reported_unloadable:
                _reported_unloadable.add(key)
                log.warning("OmniHooks: not offering calibration file %s: %s", path, e)
            continue
        names.append(path.stem)
    return names


def check_writable(kind: str) -> Path:
    """The folder ``save(kind, ...)`` writes to, created if needed and proven writable by writing a scratch file.

    Call it before a calibration run, so an unwritable folder fails before sampling rather than after it.
    Raises ``CalibrationFileError`` naming the folder.
    """
    folder = directory(kind)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-", suffix=".tmp"):
            pass
    except OSError as e:
        raise CalibrationFileError(
            f"cannot write calibration files to {folder} ({e.strerror or e}); make that folder writable for the "
            f"user running ComfyUI, or start ComfyUI with another --user-directory") from None
    return folder


def save(kind: str, name: str, data: dict[str, Any]) -> Path:
    """Write ``data`` as the calibration ``name`` of ``kind``, atomically (the old file stays until the new one is
    complete). Data that could not be loaded back (non-finite numbers, nesting too deep, a non-object) raises
    ``CalibrationFileError`` and leaves any existing file of that name untouched."""
    path = path_of(kind, name)
    _check_contents(kind, data, f"not saving calibration {path.stem!r} ({path})")
    text = json.dumps(data, indent=1, allow_nan=False)
    folder = check_writable(kind)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.stem}-", suffix=".json.tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        raise CalibrationFileError(f"cannot write calibration file {path} ({e.strerror or e})") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def load(kind: str, name: str) -> dict[str, Any]:
    """The contents of the calibration ``name`` of ``kind``; ``CalibrationFileError`` naming the file otherwise."""
    path = path_of(kind, name)
    fix = "run the calibrate node again or choose another variant"
    if not path.is_file():
        raise CalibrationFileError(f"calibration file {path} does not exist (was it deleted or made on another "
                                   f"machine?); {fix}")
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise CalibrationFileError(f"calibration file {path} is {size} bytes, more than a calibration file can "
                                       f"be ({MAX_FILE_BYTES}); {fix}")
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, RecursionError, ValueError) as e:
        if isinstance(e, CalibrationFileError):
            raise
        reason = "it nests too deeply" if isinstance(e, RecursionError) else str(e)
        raise CalibrationFileError(f"calibration file {path} cannot be read ({reason}); {fix}") from None
    try:
        _check_contents(kind, data, f"calibration file {path}")
    except CalibrationFileError as e:
        raise CalibrationFileError(f"{e}; {fix}") from None
    return data


def fingerprint(kind: str, name: str) -> str:
    """Changes whenever the calibration file's contents may have changed: modification time, size and a hash.

    Never raises: a missing, unreadable or misnamed file gets a fingerprint saying so (the node's execute then
    raises the clear error). For ComfyUI's ``fingerprint_inputs``.
    """
    try:
        path = path_of(kind, name)
        stat = path.stat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16] if stat.st_size <= MAX_FILE_BYTES else "large"
    except (ValueError, OSError) as e:
        return f"unavailable: {type(e).__name__}: {e}"
    return f"{stat.st_mtime_ns}:{stat.st_size}:{digest}"


def fingerprint_option(kind: str, value: object) -> str:
    """``fingerprint`` of the file a combo value selects ("calibration: <name>"); "" for any other value."""
    name = parse_option(value) if isinstance(value, str) else None
    return "" if name is None else fingerprint(kind, name)
