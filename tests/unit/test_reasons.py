"""Every reason the library can record for a branch has a legend entry and a tooltip in the statistics panel."""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from omni_hooks.caching import stats

ROOT = Path(__file__).resolve().parents[2]
PANEL = ROOT / "web" / "stats_model.js"
PRODUCT = [*sorted((ROOT / "omni_hooks").rglob("*.py")), *sorted((ROOT / "nodes").rglob("*.py"))]


def js_object(name: str) -> str:
    """The text of ``export const <name> = {...};`` in the panel's logic."""
    text = PANEL.read_text(encoding="utf-8")
    found = re.search(rf"export const {name} = (\{{.*?\n\}});", text, re.S)
    assert found, f"no {name} object in {PANEL}"
    return found.group(1)


def legend() -> dict[str, dict[str, str]]:
    """``REASONS`` of web/stats_model.js: reason -> {label, help}."""
    entries = {}
    for line in js_object("REASONS").splitlines()[1:-1]:
        found = re.match(r'\s*("?)([\w-]+)\1: \{ label: (".*?"), help: (".*") \},$', line)
        assert found, f"unexpected REASONS line: {line!r}"
        entries[found.group(2)] = {"label": json.loads(found.group(3)), "help": json.loads(found.group(4))}
    return entries


def literal_reasons() -> set[tuple[str, str]]:
    """Every string literal the product passes as a reason: ``Decision("x")``, ``BranchDecision(..., reason="x")``,
    and, in the library, what a ``reason`` / ``reasons`` name is assigned or appended; (file, reason)."""
    found = set()
    for path in PRODUCT:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            values = []
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", getattr(node.func, "attr", None))
                if name == "Decision" and node.args:
                    values.append(node.args[0])
                if name == "BranchDecision" and len(node.args) > 2:
                    values.append(node.args[2])
                if name in ("Decision", "BranchDecision"):
                    values += [k.value for k in node.keywords if k.arg == "reason"]
                if name == "append" and getattr(node.func, "value", None) is not None \
                        and getattr(node.func.value, "id", None) == "reasons":
                    values += node.args
            elif isinstance(node, ast.Assign) and path.is_relative_to(ROOT / "omni_hooks") \
                    and any(getattr(t, "id", None) == "reason" for t in node.targets):
                values.append(node.value)
            for value in values:
                for part in ast.walk(value):
                    if isinstance(part, ast.Constant) and isinstance(part.value, str):
                        found.add((path.relative_to(ROOT).as_posix(), part.value))
    return found


def test_every_reason_the_library_records_has_a_legend_entry_and_a_tooltip():
    entries = legend()
    missing = [r for r in stats.REASONS if r not in entries]
    assert not missing, f"web/stats_model.js REASONS has no entry for {missing}"
    for reason in stats.REASONS:
        assert entries[reason]["label"].strip() and len(entries[reason]["help"]) > 20, (reason, entries[reason])
    assert len(set(stats.REASONS)) == len(stats.REASONS)


def test_the_product_records_no_reason_outside_the_list():
    strays = sorted((where, r) for where, r in literal_reasons() if r not in stats.REASONS)
    assert not strays, f"reasons written as literals that omni_hooks.stats.REASONS does not list: {strays}"


def test_the_panel_and_the_library_agree_on_what_a_skip_is():
    text = PANEL.read_text(encoding="utf-8")
    found = re.search(r"export const SKIP_REASONS = new Set\(\[(.*?)\]\);", text)
    assert found
    assert {json.loads(r) for r in found.group(1).split(", ")} == stats.SKIP_REASONS
