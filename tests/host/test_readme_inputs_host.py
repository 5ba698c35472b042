"""The README's input tables say what the nodes really take: under each node's heading, one table listing exactly that
node's inputs, in order, with their type, default and range as the node defines them (``define_schema``).

A host test: the nodes are ComfyUI V3 nodes, whose schemas need ComfyUI's ``comfy_api`` to build."""
from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.host

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
HEADER = ["input", "type", "default", "range", "what it does"]
SHORT_OPTION_LIST = 8  # combos with at most this many options list them all; longer ones (samplers) are described


def node_schemas() -> list:
    from omnitest.pack import pack_module

    nodes = asyncio.run(pack_module("nodes.extension").OmniHooksExtension().get_node_list())
    return [node.define_schema() for node in nodes]


def title(schema) -> str:
    return schema.display_name.removesuffix(" (OmniHooks)")


def input_tables(text: str) -> dict[str, list[dict[str, str]]]:
    """Heading -> the rows of the first input table under it (before the next heading)."""
    tables: dict[str, list[dict[str, str]]] = {}
    for section in re.split(r"^(?=#{1,6} )", text, flags=re.M):
        heading, _, body = section.partition("\n")
        lines = [line for line in body.splitlines() if line.startswith("|")]
        if not lines or [c.strip() for c in lines[0].strip("|").split("|")] != HEADER:
            continue
        rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines[2:]]
        tables[heading.lstrip("#").strip()] = [dict(zip(HEADER, row)) for row in rows]
    return tables


def numbers(cell: str) -> list[float]:
    return [float(n) for n in re.findall(r"-?\d+(?:\.\d+)?", cell)]


def expected_default(schema_input) -> str | float | None:
    default = getattr(schema_input, "default", None)  # sockets (MODEL, LATENT, ...) have none
    options = getattr(schema_input, "options", None)
    if default is None and options:
        return options[0]  # what ComfyUI shows for a combo without one
    return default


def check_row(node: str, schema_input, row: dict[str, str]) -> list[str]:
    where = f"README, {node}, `{schema_input.id}`"
    problems = []
    io_type = schema_input.get_io_type()
    if row["type"] != io_type:
        problems.append(f"{where}: type {row['type']!r}, the node says {io_type}")
    default, cell = expected_default(schema_input), row["default"].strip("`")
    if default is None:
        ok = cell == ""
    elif isinstance(default, bool):
        ok = cell == str(default).lower()
    elif isinstance(default, (int, float)):
        ok = numbers(cell) == [float(default)]
    else:
        ok = cell == default
    if not ok:
        problems.append(f"{where}: default {row['default']!r}, the node says {default!r}")
    if io_type in ("INT", "FLOAT") and numbers(row["range"]) != [float(schema_input.min), float(schema_input.max)]:
        problems.append(f"{where}: range {row['range']!r}, the node says {schema_input.min} - {schema_input.max}")
    options = getattr(schema_input, "options", None) or []
    if 0 < len(options) <= SHORT_OPTION_LIST:
        listed = re.findall(r"`([^`]*)`", row["range"])
        if listed != [str(o) for o in options]:
            problems.append(f"{where}: range lists {listed}, the node offers {options}")
    if not row["what it does"]:
        problems.append(f"{where}: says nothing about what it does")
    return problems


def test_every_node_has_an_input_table_listing_exactly_its_inputs():
    schemas = node_schemas()
    tables = input_tables(README)
    titles = [title(s) for s in schemas]
    assert len(titles) >= 6 and "Apply TeaCache" in titles  # the extension's node list was read
    assert sorted(tables) == sorted(titles), "README input tables are for other nodes than the pack registers"
    problems = []
    for schema in schemas:
        node = title(schema)
        names = [row["input"].strip("`") for row in tables[node]]
        ids = [i.id for i in schema.inputs]
        if names != ids:
            problems.append(f"README, {node}: lists inputs {names}, the node has {ids}")
            continue
        for schema_input, row in zip(schema.inputs, tables[node]):
            problems += check_row(node, schema_input, row)
    assert problems == [], "\n".join(problems)


def test_the_table_reader_sees_a_wrong_row():
    schema = next(s for s in node_schemas() if title(s) == "CPU Offload")
    prefetch = next(i for i in schema.inputs if i.id == "prefetch_blocks")
    good = {"input": "`prefetch_blocks`", "type": "INT", "default": "1", "range": "0 – 8", "what it does": "x"}
    assert check_row("CPU Offload", prefetch, good) == []
    for field, value in (("type", "FLOAT"), ("default", "2"), ("range", "0 – 9"), ("what it does", "")):
        assert check_row("CPU Offload", prefetch, {**good, field: value}), field
    pin = next(i for i in schema.inputs if i.id == "pin_memory")
    row = {"input": "`pin_memory`", "type": "COMBO", "default": "auto", "range": "`auto`, `on`", "what it does": "x"}
    assert check_row("CPU Offload", pin, row)  # an option left out
