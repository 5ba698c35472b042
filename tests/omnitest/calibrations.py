"""Calibration files for tests that run a real server (written straight into its user directory, no comfy import)."""
from __future__ import annotations

import json
from pathlib import Path

# TeaCache on the tiny Wan with the rescale polynomial f(x) = x: the accumulated change is the raw relative L1 change
IDENTITY_TEACACHE = {"kind": "teacache", "family": "wan", "signal": "default", "coefficients": [0, 0, 0, 1, 0]}
# finite coefficients whose polynomial overflows to inf for any real change: Horner's (big * x + big) is above the
# largest float for x > 0.004, and inf * x stays inf, so every measured step reports the metric Infinity
_BIG = 1.79e308
OVERFLOWING_TEACACHE = {"kind": "teacache", "family": "wan", "signal": "default", "coefficients": [_BIG, _BIG, 0, 0, 0]}


def write_calibration(base_dir: str | Path, kind: str, name: str, data: dict) -> Path:
    """Write ``data`` as the calibration ``name`` of ``kind`` in the user directory of a server's base directory."""
    folder = Path(base_dir) / "user" / "omni_hooks" / kind
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(data))
    return path


def why_not_offered(server_log: str, name: str) -> str | None:
    """The pack's log line saying why it does not offer the calibration file ``name`` (None if it says nothing)."""
    lines = [line for line in server_log.splitlines()
             if "not offering calibration file" in line and f"/{name}.json:" in line]
    return lines[-1] if lines else None
