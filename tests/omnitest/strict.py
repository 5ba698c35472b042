"""Strict JSON: what a browser's JSON.parse accepts (Python's json also reads NaN and Infinity, which are not JSON)."""
from __future__ import annotations

import json
from typing import Any


def strict_json(text: str) -> Any:
    """``text`` parsed as JSON; AssertionError on NaN, Infinity or -Infinity."""
    def refuse(constant: str):
        raise AssertionError(f"non-JSON constant {constant} in {text[:200]!r}...")
    return json.loads(text, parse_constant=refuse)
