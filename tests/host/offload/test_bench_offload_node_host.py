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
    """With ``--weights-file``: the file is written, then read as ComfyUI's Load Diffusion Model reads it."""
    import comfy.model_management as mm
    import folder_paths
    import torch

    from omnitest.pack import pack_module

    bench = load_benchmark(monkeypatch)
    host = pack_module("nodes.offload.host")
    target, reserved, user_dir = host.offload_target, mm.EXTRA_RESERVED_VRAM, folder_paths.get_user_directory()
    threads = torch.get_num_threads()
    out, weights = tmp_path / "offload_node.json", tmp_path / "wan.safetensors"
    summary = bench.main(["--device", "cpu", "--out", str(out), "--weights-file", str(weights)])

    assert summary["failures"] == []
    assert "read from wan.safetensors (written now)" in summary["header"]["text"] and weights.is_file()
    rows = summary["rows"]
    expected = bench.rows_for("legacy", summary["header"]["caps_gib"], extra=True)
    assert [r["label"] for r in rows] == [row.label for row in expected]
    by_label = {}
    for row, r in zip(expected, rows):
        by_label[row.label] = r
        assert r["mode"] == "legacy"
        if row.comfy_only:
            assert r["na"].startswith("n/a on CPU"), r
            continue
        assert r["model_calls"] == 6 and len(r["step_seconds"]) == 6, r
        if row.offload is not None:
            assert r["diff"].startswith("0 (row "), r
            assert r["node"]["active"] and r["node"]["bytes_moved"] > 0 and r["node"]["sync_loads"] == 0, r["node"]
    cap = bench.gib_label(summary["header"]["caps_gib"][0])
    auto = by_label[f"CPU Offload auto, prefetch 1, at {cap}"]["node"]
    assert 0 < auto["blocks_offloaded"] < auto["blocks_total"]  # the cap keeps some blocks resident
    every = by_label["CPU Offload all blocks, prefetch 1"]["node"]
    assert every["blocks_offloaded"] == every["blocks_total"]
    cached = by_label[f"CPU Offload auto at {cap} + Apply TeaCache"]
    assert cached["diff"] == f"0 (row {[r['label'] for r in rows].index('Apply TeaCache alone') + 1})"
    assert cached["node"]["calls_skipped"] == cached["cache"]["reused"] > 0
    assert cached["node"]["bytes_moved_on_skipped_calls"] == 0
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))
    assert host.offload_target is target and mm.EXTRA_RESERVED_VRAM == reserved
    assert folder_paths.get_user_directory() == user_dir and torch.get_num_threads() == threads

    # the file is kept when it holds the shape's weights, and another shape's file is refused
    tiny = bench.SHAPES["tiny"]
    assert bench.ensure_weights_file(weights, tiny, torch.device("cpu")) is False
    with pytest.raises(SystemExit, match="holds other weights"):
        bench.ensure_weights_file(weights, bench.Shape(tiny.dim, tiny.ffn, tiny.blocks + 1), torch.device("cpu"))


def test_two_caps_make_a_row_of_each_kind_per_cap_and_dynamic_rows_compare_with_their_own_mode(monkeypatch):
    bench = load_benchmark(monkeypatch)
    legacy = bench.rows_for("legacy", [12.0, 24.0], extra=False)
    assert [r.label for r in legacy] == [
        "fully resident", "ComfyUI partial load at 12 GiB", "ComfyUI partial load at 24 GiB",
        "CPU Offload auto, prefetch 1, at 12 GiB", "CPU Offload auto, prefetch 1, at 24 GiB", "Apply TeaCache alone",
        "CPU Offload auto at 12 GiB + Apply TeaCache", "CPU Offload auto at 24 GiB + Apply TeaCache"]
    dynamic = bench.rows_for("dynamic", [12.0, 24.0], extra=False)
    assert all(r.mode == "dynamic" for r in dynamic)
    labels = {r.label for r in dynamic}
    assert all(r.reference in labels for r in dynamic if r.reference)  # compared within their own process
    assert [r.cap for r in dynamic if r.offload is None and not r.teacache] == [None, 12.0, 24.0]
    assert not any(r.takeover for r in dynamic)
    trial = bench.rows_for("dynamic", [12.0, 24.0], extra=False, takeover=True)
    takeover = [r for r in trial if r.takeover]
    assert [(r.cap, r.offload, r.reference) for r in takeover] == [(12.0, (-1, 1), "dynamic VRAM, no cap"),
                                                                    (24.0, (-1, 1), "dynamic VRAM, no cap")]
    assert trial[:len(dynamic)] == dynamic


def test_chosen_rows_keep_the_rows_they_are_compared_with(monkeypatch):
    bench = load_benchmark(monkeypatch)
    legacy = bench.rows_for("legacy", [12.0, 24.0], extra=False)
    assert bench.chosen_rows(legacy, None) == legacy
    assert [r.label for r in bench.chosen_rows(legacy, [2, 4, 5, 8])] == [
        "fully resident", "ComfyUI partial load at 12 GiB", "CPU Offload auto, prefetch 1, at 12 GiB",
        "CPU Offload auto, prefetch 1, at 24 GiB", "Apply TeaCache alone",
        "CPU Offload auto at 24 GiB + Apply TeaCache"]
