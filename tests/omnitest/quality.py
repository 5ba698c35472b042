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


def benchmark_modules():
    """The quality benchmark's modules (``benchmarks/bench_cache_quality.py`` and its models), imported in this process
    (a host test: they need a ComfyUI)."""
    from omnitest.comfy_path import PACK_ROOT

    sys.path.insert(0, str(PACK_ROOT / "benchmarks"))
    try:
        import bench_cache_quality
        import cache_quality_model
    finally:
        sys.path.remove(str(PACK_ROOT / "benchmarks"))
    return bench_cache_quality, cache_quality_model
