"""The CPU Offload node benchmark (``benchmarks/bench_offload_node.py``) in its CPU mode, on this ComfyUI: every row's
plumbing runs (ComfyUI's partial-load rows say n/a), the offload rows are bit-identical to their reference rows, and the
benchmark leaves the node, the cap, ComfyUI's user directory and torch's threads as it found them."""
from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from omnitest.comfy_path import PACK_ROOT

pytestmark = pytest.mark.host


def load_benchmark(monkeypatch):
    name = "bench_offload_node_under_test"
    spec = importlib.util.spec_from_file_location(name, PACK_ROOT / "benchmarks" / "bench_offload_node.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_runs_every_row_on_the_cpu_and_offload_rows_are_bit_identical(tmp_path, monkeypatch):
    import comfy.model_management as mm
    import folder_paths
    import torch

    from omnitest.pack import pack_module

    bench = load_benchmark(monkeypatch)
    node = pack_module("nodes.offload.node")
    target, reserved, user_dir = node.offload_target, mm.EXTRA_RESERVED_VRAM, folder_paths.get_user_directory()
    threads = torch.get_num_threads()
    out = tmp_path / "offload_node.json"
    summary = bench.main(["--device", "cpu", "--out", str(out)])

    assert summary["failures"] == []
    rows = summary["rows"]
    assert [r["label"] for r in rows] == [row.label for row in bench.ROWS]
    for row, r in zip(bench.ROWS, rows):
        if row.comfy_only:
            assert r["na"].startswith("n/a on CPU"), r
            continue
        assert r["model_calls"] == 6 and len(r["step_seconds"]) == 6, r
        if row.offload is not None:
            assert r["diff"] == f"0 (row {row.reference})", r
            assert r["node"]["active"] and r["node"]["bytes_moved"] > 0 and r["node"]["sync_loads"] == 0, r["node"]
    auto = rows[3]["node"]
    assert 0 < auto["blocks_offloaded"] < auto["blocks_total"]  # the cap keeps some blocks resident
    assert rows[4]["node"]["blocks_offloaded"] == rows[4]["node"]["blocks_total"]
    cached = rows[7]
    assert cached["node"]["calls_skipped"] == cached["cache"]["reused"] > 0
    assert cached["node"]["bytes_moved_on_skipped_calls"] == 0
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))
    assert node.offload_target is target and mm.EXTRA_RESERVED_VRAM == reserved
    assert folder_paths.get_user_directory() == user_dir and torch.get_num_threads() == threads
