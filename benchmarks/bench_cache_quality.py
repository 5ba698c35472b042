"""Cache quality on a trained model: PSNR of the final latent against the uncached run, against model evaluations.

The model is ``cache_quality_model`` (ComfyUI's WanModel, small, trained on a synthetic class-conditional
distribution by ``train_cache_quality_model.py``), sampled in-process through ComfyUI's KSampler path: 30 euler steps,
scheduler simple, cfg 3 (cond and uncond batched, so one model evaluation per step), 4 prompts (one per class, seed =
class). TeaCache and MagCache run on this model's own calibration (TeaCache Calibrate / MagCache Calibrate on class 0,
seed 100, like a user calibrating a new model), each swept over thresholds with forecast off / 1st / 2nd order; core
EasyCache (``comfy_extras/nodes_easycache.py``, its default window 0.15-0.95) is the reference. A model evaluation is
counted when the last block's feed-forward runs (a skipped step runs no block; EasyCache skips the whole model).

Writes a markdown table to stdout, ``docs/cache_quality.json`` and the plot ``docs/cache_quality.png``.
Run: COMFYUI_PATH=... .venv/bin/python benchmarks/bench_cache_quality.py
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]
from omnitest.comfy_path import use_comfyui_in_process  # noqa: E402

if use_comfyui_in_process() is None:
    sys.exit("bench_cache_quality: no ComfyUI checkout (set COMFYUI_PATH)")
import folder_paths  # noqa: E402
import torch  # noqa: E402

import cache_quality_model as cqm  # noqa: E402
from cache_quality_plot import plot_curves  # noqa: E402
from omnitest import tiny_models  # noqa: E402
from omnitest.pack import pack_module, run_node  # noqa: E402
from omnitest.quality import psnr_db  # noqa: E402

STEPS = 30
CFG = 3.0
FORECASTS = ["off", "1st order", "2nd order"]
TEA_THRESHOLDS = [0.05, 0.08, 0.1, 0.12, 0.14, 0.16, 0.18, 0.2, 0.3, 0.45, 0.6]
MAG_THRESHOLDS = [0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.35]
MAG_K = 6
MAG_RETENTION = 0.1
EASY_THRESHOLDS = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5]


class Evaluations:
    """Counts the model evaluations that ran the blocks (a pre-hook on the last block's feed-forward)."""

    def __init__(self, dm: torch.nn.Module):
        self.count = 0
        dm.blocks[-1].ffn.register_forward_pre_hook(lambda m, a: setattr(self, "count", self.count + 1))


def sample_all(case, model, counter: Evaluations) -> tuple[list[torch.Tensor], list[int]]:
    outs, evals = [], []
    for k in range(cqm.CLASSES):
        case.positive, case.negative = cqm.conditioning(k), cqm.conditioning(None)
        counter.count = 0
        outs.append(tiny_models.sample(case, model=model, steps=STEPS, cfg=CFG, seed=k))
        evals.append(counter.count)
    return outs, evals


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    folder_paths.set_user_directory(tempfile.mkdtemp(prefix="omnihooks-quality-"))
    teacache = pack_module("nodes.caches.teacache")
    magcache = pack_module("nodes.caches.magcache")
    from comfy_extras.nodes_easycache import EasyCacheNode

    case = cqm.build()
    counter = Evaluations(case.patcher.model.diffusion_model)
    for node in (teacache.TeaCacheCalibrate, magcache.MagCacheCalibrate):
        run_node(node, model=case.patcher, seed=100, steps=STEPS, cfg=CFG, sampler_name="euler", scheduler="simple",
                 positive=cqm.conditioning(0), negative=cqm.conditioning(None),
                 latent_image={"samples": torch.zeros(cqm.LATENT_SHAPE)}, name="quality")
    reference, _ = sample_all(case, None, counter)

    def tea(t, forecast):
        return run_node(teacache.ApplyTeaCache, model=case.patcher, rel_l1_thresh=t, start_percent=0.0,
                        end_percent=1.0, cache_device="compute device", model_variant="calibration: quality",
                        forecast=forecast)[0]

    def mag(t, forecast):
        return run_node(magcache.ApplyMagCache, model=case.patcher, threshold=t, max_skip_steps=MAG_K,
                        retention_ratio=MAG_RETENTION, start_percent=0.0, end_percent=1.0,
                        cache_device="compute device", curve="calibration: quality", forecast=forecast)[0]

    def easy(t, _):
        return run_node(EasyCacheNode, model=case.patcher, reuse_threshold=t, start_percent=0.15, end_percent=0.95,
                        verbose=False)[0]

    families = [(f"TeaCache, forecast {f}", tea, TEA_THRESHOLDS, f) for f in FORECASTS]
    families += [(f"MagCache (K {MAG_K}), forecast {f}", mag, MAG_THRESHOLDS, f) for f in FORECASTS]
    families += [("core EasyCache (reference)", easy, EASY_THRESHOLDS, None)]
    results = []
    for name, apply, thresholds, forecast in families:
        for t in thresholds:
            outs, evals = sample_all(case, apply(t, forecast), counter)
            psnrs = [psnr_db(o, r) for o, r in zip(outs, reference)]
            results.append({"configuration": name, "threshold": t, "evaluations": sum(evals) / len(evals),
                            "evaluations_per_prompt": evals, "psnr_mean": sum(psnrs) / len(psnrs),
                            "psnr_min": min(psnrs), "psnr_per_prompt": psnrs})
            print(f"{name:40s} {t:5g}  evals {results[-1]['evaluations']:5.2f}  "
                  f"PSNR mean {results[-1]['psnr_mean']:6.2f}  min {results[-1]['psnr_min']:6.2f}", flush=True)
    opts.out.mkdir(parents=True, exist_ok=True)
    # identical outputs have an infinite PSNR: JSON has no such number, so it is written as null
    finite = [{k: [None if isinstance(x, float) and math.isinf(x) else x for x in v] if isinstance(v, list)
               else None if isinstance(v, float) and math.isinf(v) else v for k, v in r.items()} for r in results]
    (opts.out / "cache_quality.json").write_text(json.dumps(finite, indent=1))
    plot_curves(results, opts.out / "cache_quality.png", steps=STEPS)
    print("\n| configuration | threshold | model evaluations (of 30) | latent PSNR mean (dB) | worst prompt (dB) |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['configuration']} | {r['threshold']:g} | {r['evaluations']:.2f} | {r['psnr_mean']:.1f} | "
              f"{r['psnr_min']:.1f} |")


if __name__ == "__main__":
    main()
