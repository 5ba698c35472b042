"""How close two outputs are, for tests that compare a parallel or cached run with the plain one."""
from __future__ import annotations

import math
import sys

import torch


def psnr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    """Peak signal-to-noise ratio of ``got`` against ``want`` (peak: ``want``'s largest magnitude); inf if equal."""
    error = torch.mean((got.double() - want.double()) ** 2).item()
    peak = want.double().abs().max().item()
    return math.inf if error == 0 else 10 * math.log10(peak ** 2 / error)


def benchmark_module(name: str):
    """The module ``name`` of ``benchmarks/``, imported in this process (a host test: the benchmarks need a ComfyUI)."""
    import importlib

    from omnitest.comfy_path import PACK_ROOT

    sys.path.insert(0, str(PACK_ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(PACK_ROOT / "benchmarks"))


def benchmark_modules():
    """The quality benchmark (``benchmarks/bench_cache_quality.py``) and its models."""
    return benchmark_module("bench_cache_quality"), benchmark_module("cache_quality_model")
