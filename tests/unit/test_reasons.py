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
    assert not strays, f"reasons written as literals that omni_hooks.caching.stats.REASONS does not list: {strays}"


def test_the_panel_and_the_library_agree_on_what_a_skip_is():
    assert js_set("SKIP_REASONS", PANEL) == stats.SKIP_REASONS


def js_set(name: str, source: Path) -> set[str]:
    """The strings of ``const <name> = new Set([...]);`` in ``source``."""
    found = re.search(rf"const {name} = new Set\(\[(.*?)\]\);", source.read_text(encoding="utf-8"))
    assert found, f"no {name} set in {source}"
    return {json.loads(r) for r in found.group(1).split(", ")}


def test_the_panel_names_every_forecast_candidate_as_the_library_does():
    from omni_hooks.caching.forecast import CANDIDATE_NAMES

    found = re.search(r"export const FORECAST_CANDIDATES = \{(.*?)\};", PANEL.read_text(encoding="utf-8"), re.S)
    assert found, f"no FORECAST_CANDIDATES object in {PANEL}"
    entries = re.findall(r'(\d+): "(.*?)"', found.group(1))
    assert {int(key): name for key, name in entries} == CANDIDATE_NAMES


def test_the_panel_badges_the_apply_node_of_every_cache():
    # each cache's module (nodes/caches/<cache>.py) names its Apply node NODE_ID; the panel badges those nodes
    ids = {found.group(1) for path in sorted((ROOT / "nodes" / "caches").glob("*.py"))
           if (found := re.search(r'^NODE_ID = "(.*?)"$', path.read_text(encoding="utf-8"), re.M))}
    assert len(ids) >= 2 and js_set("APPLY_NODES", ROOT / "web" / "omni_hooks_stats.js") == ids
