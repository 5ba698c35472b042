"""Cache quality on trained models: PSNR of the final latent against the uncached run, against model evaluations.

The models are ``cache_quality_model.MODELS`` (ComfyUI's WanModel, trained on synthetic class-conditional
distributions by ``train_cache_quality_model.py``: ``small``, ``wide``, ``deep`` and ``long``, of different size and
data), sampled in-process through ComfyUI's KSampler path: ``--steps`` steps (30; 8 or 4 for a few-step run) of
``--sampler`` (euler), scheduler simple, cfg 3 (cond and uncond batched, so one model evaluation per step), 4
prompts (one per class, seed = class).
TeaCache and MagCache run on the model's own calibration (TeaCache Calibrate / MagCache Calibrate on class 0, seed
100, at the same step count, like a user calibrating a new model), each swept over thresholds with forecast off /
1st / 2nd order / auto; then the forward budget swept over its number of steps with each forecast, the threshold at
0 (the plan alone: TeaCache and MagCache then compute the same steps, so it runs once, as Apply TeaCache), and with
the threshold of ``BUDGET_PULLS`` (it can bring a planned compute forward); core EasyCache
(``comfy_extras/nodes_easycache.py``, its default window 0.15-0.95) is the reference. A model evaluation is counted
when the last block's feed-forward runs (a skipped step runs no block; EasyCache skips the whole model).

Writes a markdown table to stdout, ``docs/cache_quality[_<model>][_<steps>steps].json`` and the plot of the same name
(``.png``; the small model at 30 steps is ``docs/cache_quality.json``).
Run: COMFYUI_PATH=... .venv/bin/python benchmarks/bench_cache_quality.py [--model small|wide|deep|long] [--steps 30]
"""
from __future__ import annotations

import argparse
import atexit
import json
import math
import shutil
import sys
import tempfile
from functools import partial
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

CFG = 3.0
FORECASTS = ["off", "1st order", "2nd order", "auto"]
# fine sweeps: a threshold gives a whole number of evaluations, so a coarse sweep leaves budgets without a point
TEA_THRESHOLDS = [0.04, 0.05, 0.06, 0.07, 0.08, 0.09, 0.1, 0.11, 0.12, 0.14, 0.16, 0.18, 0.2, 0.23, 0.26, 0.3, 0.35,
                  0.4, 0.45, 0.5, 0.6]
MAG_THRESHOLDS = [0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.05, 0.06, 0.075, 0.09, 0.1, 0.12, 0.15, 0.2, 0.25,
                  0.3]
MAG_K = 6
MAG_RETENTION = 0.1
EASY_THRESHOLDS = [0.005, 0.02, 0.05, 0.1, 0.2, 0.5]
# few-step runs: coarser steps change more per step, so larger thresholds
FEW_TEA_THRESHOLDS = [0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.6, 0.8, 1.2, 1.5]
FEW_MAG_THRESHOLDS = [0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.6, 0.8]
FEW_EASY_THRESHOLDS = [0.05, 0.2, 0.5]
BUDGETS = {30: [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 14, 16, 20], 8: [3, 4, 5, 6, 7], 6: [3, 4, 5]}
# a budget with the threshold on: (cache, threshold, forecast); the cache's threshold can bring a compute forward
BUDGET_PULLS = [("tea", 0.1, "auto"), ("mag", 0.06, "auto")]


class Evaluations:
    """Counts the model evaluations that ran the blocks (a pre-hook on the last block's feed-forward)."""

    def __init__(self, dm: torch.nn.Module):
        self.count = 0
        dm.blocks[-1].ffn.register_forward_pre_hook(lambda m, a: setattr(self, "count", self.count + 1))


def budgets(steps: int) -> tuple[int, ...]:
    """The evaluation budgets of the summary table for a run of ``steps``."""
    return {30: (6, 8, 10, 12, 14, 20), 8: (5, 6, 7), 6: (4, 5)}.get(steps, (steps // 4, steps // 2, 3 * steps // 4))


def setting(row: dict) -> str:
    """A row's knob: its speed-up, else its forward budget, else its threshold."""
    if row.get("speedup"):
        return f"{row['speedup']:g}x"
    return f"budget {row['budget']}" if row.get("budget") else f"{row['threshold']:g}"


def best_per_budget(results: list[dict], steps: int) -> str:
    """A markdown table: per configuration and budget, the best mean PSNR (with its worst prompt and setting) of
    the sweep's points that computed at most that many evaluations on average."""
    cols = budgets(steps)
    lines = ["| configuration | " + " | ".join(f"≤ {b}" for b in cols) + " |", "|---|" + "---|" * len(cols)]
    for name in dict.fromkeys(r["configuration"] for r in results):
        cells = []
        for b in cols:
            points = [r for r in results if r["configuration"] == name and r["evaluations"] <= b + 1e-9]
            best = max(points, key=lambda r: r["psnr_mean"], default=None)
            cells.append("—" if best is None else
                         f"{best['psnr_mean']:.1f} / {best['psnr_min']:.1f} ({setting(best)})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sample_all(spec: cqm.QualityModel, case, model, counter: Evaluations, steps: int,
               classes=range(cqm.CLASSES), sampler: str = "euler") -> tuple[list[torch.Tensor], list[int]]:
    """The final latents and model evaluations of one run per class in ``classes`` (seed = class)."""
    outs, evals = [], []
    for k in classes:
        case.positive, case.negative = spec.conditioning(k), spec.conditioning(None)
        counter.count = 0
        outs.append(tiny_models.sample(case, model=model, steps=steps, cfg=CFG, seed=k, sampler_name=sampler))
        evals.append(counter.count)
    return outs, evals


def calibrated_case(spec: cqm.QualityModel, steps: int, sampler: str = "euler"):
    """The model built, both caches calibrated on it as a fresh Calibrate node does (class 0, seed 100, ``steps``,
    ``sampler``, the speed-up's trial: the ``calibration: quality`` entries) and its evaluation counter:
    ``(case, counter)``. The user directory they are saved in is removed when the process exits."""
    torch.set_num_threads(1)
    directory = tempfile.mkdtemp(prefix="omnihooks-quality-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    folder_paths.set_user_directory(directory)
    teacache, magcache = pack_module("nodes.caches.teacache"), pack_module("nodes.caches.magcache")
    case = spec.build()
    counter = Evaluations(case.patcher.model.diffusion_model)
    for node in (teacache.TeaCacheCalibrate, magcache.MagCacheCalibrate):
        run_node(node, model=case.patcher, seed=100, steps=steps, cfg=CFG, sampler_name=sampler, scheduler="simple",
                 positive=spec.conditioning(0), negative=spec.conditioning(None),
                 latent_image={"samples": torch.zeros(spec.latent_shape)}, name="quality", try_speedups=True)
    return case, counter


def tea(case, t: float, forecast: str, budget: int = 0, correction: float = 0.0):
    """The case's MODEL with Apply TeaCache at threshold ``t`` on its own calibration (``budget``: its forward
    budget, 0 = none; ``correction``: its skip correction, 0 = off)."""
    return run_node(pack_module("nodes.caches.teacache").ApplyTeaCache, model=case.patcher, rel_l1_thresh=t,
                    start_percent=0.0, end_percent=1.0, cache_device="compute device",
                    model_variant="calibration: quality", forecast=forecast, forward_budget=budget,
                    skip_correction=correction)[0]


def mag(case, t: float, forecast: str, budget: int = 0, correction: float = 0.0):
    """The case's MODEL with Apply MagCache (K ``MAG_K``, retention ``MAG_RETENTION``) at threshold ``t``
    (``budget``: its forward budget, 0 = none; ``correction``: its skip correction, 0 = off)."""
    return run_node(pack_module("nodes.caches.magcache").ApplyMagCache, model=case.patcher, threshold=t,
                    max_skip_steps=MAG_K, retention_ratio=MAG_RETENTION, start_percent=0.0, end_percent=1.0,
                    cache_device="compute device", curve="calibration: quality", forecast=forecast,
                    forward_budget=budget, skip_correction=correction)[0]


def fresh(case, speedup: float, cache: str = "tea", **inputs):
    """The case's MODEL with a fresh Apply TeaCache (``cache`` "mag": Apply MagCache) on its own calibration, only its
    ``speedup`` (and ``inputs``) set: every other input at its widget's default."""
    module, node, variant = (("teacache", "ApplyTeaCache", "model_variant") if cache == "tea"
                             else ("magcache", "ApplyMagCache", "curve"))
    node_cls = getattr(pack_module(f"nodes.caches.{module}"), node)
    widgets = {i.id: i.default for i in node_cls.define_schema().inputs if getattr(i, "default", None) is not None}
    chosen = {variant: "calibration: quality", "speedup": speedup, **inputs}
    return run_node(node_cls, model=case.patcher, **{**widgets, **chosen})[0]


def corrected(name: str, correction: float) -> str:
    """A configuration's name with its skip correction (none when 0): "TeaCache + skip correction 0.5, forecast auto",
    so that its cache (before the first comma) and its forecast (the last word) read as without it."""
    if not correction:
        return name
    head, _, tail = name.partition(", ")
    return f"{head} + skip correction {correction:g}, {tail}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    parser.add_argument("--model", choices=sorted(cqm.MODELS), default="small")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--forecasts", nargs="*", default=FORECASTS, help="the forecast values to sweep")
    parser.add_argument("--tea-thresholds", type=float, nargs="*", help="replace TeaCache's thresholds")
    parser.add_argument("--mag-thresholds", type=float, nargs="*", help="replace MagCache's thresholds")
    parser.add_argument("--easy-thresholds", type=float, nargs="*", help="replace EasyCache's thresholds")
    parser.add_argument("--budgets", type=int, nargs="*", help="replace the forward budgets swept (none: no budget "
                        "sweep)")
    parser.add_argument("--budget-pulls", action=argparse.BooleanOptionalAction, default=True,
                        help="also sweep the budgets with the thresholds of BUDGET_PULLS")
    parser.add_argument("--skip-corrections", type=float, nargs="*", default=[0.0],
                        help="run every TeaCache and MagCache configuration with each of these skip corrections (0: "
                        "off; a row's name says a correction above 0)")
    parser.add_argument("--speedups", type=float, nargs="*", default=[],
                        help="also run a fresh Apply TeaCache and Apply MagCache with only these speed-ups set")
    parser.add_argument("--sampler", default="euler", help="ComfyUI's sampler name, for the calibrations and every "
                        "run (the file names end in _<sampler> for any but euler)")
    opts = parser.parse_args()
    spec, steps = cqm.MODELS[opts.model], opts.steps
    few = steps <= 10
    from comfy_extras.nodes_easycache import EasyCacheNode

    sampler = opts.sampler
    case, counter = calibrated_case(spec, steps, sampler)
    reference, _ = sample_all(spec, case, None, counter, steps, sampler=sampler)

    def easy(t, _):
        return run_node(EasyCacheNode, model=case.patcher, reuse_threshold=t, start_percent=0.15, end_percent=0.95,
                        verbose=False)[0]

    tea_thresholds = opts.tea_thresholds if opts.tea_thresholds is not None else (
        FEW_TEA_THRESHOLDS if few else TEA_THRESHOLDS)
    mag_thresholds = opts.mag_thresholds if opts.mag_thresholds is not None else (
        FEW_MAG_THRESHOLDS if few else MAG_THRESHOLDS)
    easy_thresholds = opts.easy_thresholds if opts.easy_thresholds is not None else (
        FEW_EASY_THRESHOLDS if few else EASY_THRESHOLDS)
    families = [(f"TeaCache, forecast {f}", partial(tea, case), tea_thresholds, f) for f in opts.forecasts]
    families += [(f"MagCache (K {MAG_K}), forecast {f}", partial(mag, case), mag_thresholds, f) for f in opts.forecasts]
    families += [("core EasyCache (reference)", easy, easy_thresholds, None)]
    budgets = opts.budgets if opts.budgets is not None else BUDGETS.get(steps, list(range(2, steps)))
    caches = {"tea": ("TeaCache", partial(tea, case)), "mag": (f"MagCache (K {MAG_K})", partial(mag, case))}
    runs = [(name, apply, t, forecast, 0) for name, apply, thresholds, forecast in families for t in thresholds]
    runs += [(f"budget, forecast {f}", partial(tea, case), 0.0, f, b) for f in opts.forecasts for b in budgets]
    runs += [(f"{caches[c][0]} {t:g} + budget, forecast {f}", caches[c][1], t, f, b)
             for c, t, f in (BUDGET_PULLS if opts.budget_pulls else []) if f in opts.forecasts for b in budgets]
    runs = [(corrected(name, c), apply, t, forecast, budget, c) for name, apply, t, forecast, budget in runs
            for c in (opts.skip_corrections if apply is not easy else [0.0])]
    runs += [(f"{caches[c][0]} speed-up (fresh node)", partial(fresh, case, s, c), 0.0, None, 0, 0.0, s)
             for c in caches for s in opts.speedups]
    results = []
    for name, apply, t, forecast, budget, correction, *speedup in runs:
        model = (apply() if speedup else apply(t, forecast, budget, correction) if apply is not easy
                 else apply(t, forecast))
        outs, evals = sample_all(spec, case, model, counter, steps, sampler=sampler)
        psnrs = [psnr_db(o, r) for o, r in zip(outs, reference)]
        results.append({"configuration": name, "threshold": t, "budget": budget, "skip_correction": correction,
                        **({"speedup": speedup[0]} if speedup else {}),
                        "evaluations": sum(evals) / len(evals),
                        "evaluations_per_prompt": evals, "psnr_mean": sum(psnrs) / len(psnrs),
                        "psnr_min": min(psnrs), "psnr_per_prompt": psnrs})
        print(f"{name:44s} {setting(results[-1]):>10s}  evals {results[-1]['evaluations']:5.2f}  "
              f"PSNR mean {results[-1]['psnr_mean']:6.2f}  min {results[-1]['psnr_min']:6.2f}", flush=True)
    opts.out.mkdir(parents=True, exist_ok=True)
    # identical outputs have an infinite PSNR: JSON has no such number, so it is written as null
    finite = [{k: [None if isinstance(x, float) and math.isinf(x) else x for x in v] if isinstance(v, list)
               else None if isinstance(v, float) and math.isinf(v) else v for k, v in r.items()} for r in results]
    name = ("cache_quality" + ("" if spec.name == "small" else f"_{spec.name}")
            + ("" if steps == 30 else f"_{steps}steps") + ("" if sampler == "euler" else f"_{sampler}"))
    (opts.out / f"{name}.json").write_text(json.dumps(finite, indent=1))
    plot_curves(results, opts.out / f"{name}.png", steps=steps, targets=() if few else ((12, 45.0), (8, 40.0)),
                title=f"{spec.name} model ({spec.description}), {steps} steps, {sampler}")
    print(f"\nbest point per budget of model evaluations (of {steps}), mean / worst prompt in dB "
          "(threshold or budget):\n")
    print(best_per_budget(results, steps))
    print(f"\n| configuration | setting | model evaluations (of {steps}) | latent PSNR mean (dB) "
          "| worst prompt (dB) |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['configuration']} | {setting(r)} | {r['evaluations']:.2f} | {r['psnr_mean']:.1f} | "
              f"{r['psnr_min']:.1f} |")


if __name__ == "__main__":
    main()
