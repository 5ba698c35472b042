"""Cost of the hook registry per forward call: direct call vs. 0, 1 and 3 pass-through hooks, side by side.

Run: .venv/bin/python benchmarks/bench_dispatch.py   (prints a markdown table for docs/benchmarks.md)
"""
from __future__ import annotations

import sys
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from omni_hooks import HookRegistry, ModelHook  # noqa: E402


class PassThroughHook(ModelHook):
    """Does what an offload or statistics hook minimally does: looks at the call and hands it on."""

    def pre_forward(self, module, *args, **kwargs):
        return args, kwargs

    def post_forward(self, module, output):
        return output


def make_module(hooks: int | None) -> torch.nn.Module:
    module = torch.nn.Linear(8, 8)
    if hooks is not None:
        registry = HookRegistry.get_or_create(module)
        for i in range(hooks):
            registry.register_hook(f"hook_{i}", PassThroughHook())
    return module


def microseconds_per_call(module: torch.nn.Module, x: torch.Tensor, number: int = 20000, repeat: int = 7) -> float:
    with torch.no_grad():
        times = timeit.repeat(lambda: module(x), number=number, repeat=repeat)
    return min(times) / number * 1e6


def main() -> None:
    torch.set_num_threads(1)
    x = torch.randn(1, 8)
    cases = [("direct call (no registry)", None), ("registry, 0 hooks", 0), ("registry, 1 hook", 1),
             ("registry, 3 hooks", 3)]
    results = [(label, microseconds_per_call(make_module(n), x)) for label, n in cases]
    base = results[0][1]
    print("| case | µs per call | added vs direct |")
    print("|---|---|---|")
    for label, us in results:
        print(f"| {label} | {us:.2f} | {us - base:+.2f} µs |")


if __name__ == "__main__":
    main()
