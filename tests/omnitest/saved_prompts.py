"""Apply TeaCache / Apply MagCache inputs as prompts of the release before the speed-up input saved them (no
``speedup``), run on the quality benchmark's small trained model (``benchmarks/cache_quality_model.py``, calibrated
as the benchmark calibrates it), one prompt each: what ``tests/host/caches/test_speedup_host.py`` checks a later
release still computes.

``python tests/omnitest/saved_prompts.py OUT`` (with ``COMFYUI_PATH``) writes, per prompt, the steps it computed
and its final latent, from the pack this file lies in: run it from a checkout of the release that saved them."""
from __future__ import annotations

import json
import sys
from pathlib import Path

STEPS = 30
PROMPT = 1  # the class (and seed) sampled
#: (cache, sampler, the node's inputs as the prompt holds them, the calibration's left out)
PROMPTS = [
    ("tea", "euler", {"rel_l1_thresh": -1.0, "start_percent": 0.0, "end_percent": 1.0,
                      "cache_device": "compute device"}),
    ("tea", "euler", {"rel_l1_thresh": 0.1, "start_percent": 0.0, "end_percent": 1.0, "cache_device": "compute device",
                      "forecast": "auto", "forward_budget": 0, "skip_correction": 0.0}),
    ("tea", "euler", {"rel_l1_thresh": 0.0, "start_percent": 0.0, "end_percent": 1.0, "cache_device": "compute device",
                      "forecast": "1st order", "forward_budget": 8, "skip_correction": 0.5}),
    ("mag", "euler", {"threshold": 0.06, "max_skip_steps": 2, "retention_ratio": 0.2, "start_percent": 0.0,
                      "end_percent": 1.0, "cache_device": "compute device"}),
    ("mag", "uni_pc", {"threshold": 0.06, "max_skip_steps": 6, "retention_ratio": 0.1, "start_percent": 0.0,
                       "end_percent": 1.0, "cache_device": "compute device", "forecast": "1st order",
                       "forward_budget": 0, "skip_correction": 0.0}),
]


def node_and_inputs(cache: str, inputs: dict) -> tuple[type, dict]:
    """The Apply node of ``cache`` and its inputs with the benchmark's calibration chosen."""
    from omnitest.pack import pack_module

    if cache == "tea":
        return pack_module("nodes.caches.teacache").ApplyTeaCache, {**inputs, "model_variant": "calibration: quality"}
    return pack_module("nodes.caches.magcache").ApplyMagCache, {**inputs, "curve": "calibration: quality"}


def run(bench, models) -> list[dict]:
    """Each of ``PROMPTS`` run: its computed steps and final latent (calibrations made per sampler)."""
    from omnitest.pack import run_node

    spec = models.MODELS["small"]
    results = []
    for cache, sampler, inputs in PROMPTS:
        case, counter = bench.calibrated_case(spec, STEPS, sampler)  # "calibration: quality" is this one
        node, full = node_and_inputs(cache, inputs)
        model = run_node(node, model=case.patcher, **full)[0]
        (latent,), (computed,) = bench.sample_all(spec, case, model, counter, STEPS, classes=[PROMPT], sampler=sampler)
        results.append({"cache": cache, "sampler": sampler, "inputs": inputs, "computed": computed,
                        "latent": latent.flatten().tolist(), "shape": list(latent.shape)})
    return results


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[2]
    sys.path[:0] = [str(root / "tests"), str(root / "benchmarks")]
    from omnitest.comfy_path import use_comfyui_in_process

    use_comfyui_in_process()
    import bench_cache_quality
    import cache_quality_model

    Path(sys.argv[1]).write_text(json.dumps(run(bench_cache_quality, cache_quality_model)))
