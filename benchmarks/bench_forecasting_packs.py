"""Forecasting packs against this pack's caches, on the quality benchmark's trained models.

Runs TaylorSeerLite (philipy1219/ComfyUI-TaylorSeer), Spectrum (judian17/ComfyUI-Spectrum) and Spectrum Apply WAN
(xmarre/ComfyUI-Spectrum-WAN-Proper) on ``cache_quality_model.MODELS`` exactly as ``bench_cache_quality.py`` runs
TeaCache and MagCache (same ComfyUI KSampler path, ``--sampler`` (euler), scheduler simple, cfg 3, the 4 prompts,
seed = class, the same reference), each swept over its knobs (``forecasting_packs.PACKS``). A model evaluation (a
forward) is counted when the last block runs. The packs are not part of this repository: fetch them into a folder of
your own and pass it as ``--packs`` (``forecasting_packs`` has the commands; the benchmark prints them for a pack it
cannot find). Each pack runs on a model of its own: Spectrum Apply WAN leaves its wrapper on the shared model, so
later runs of any clone of it still forecast.

Writes ``docs/forecasting_packs[_<model>][_<steps>steps].json`` (every point), then compares with this pack's own
sweep of the same model and step count (``docs/cache_quality*.json``, from ``bench_cache_quality.py``): per budget of
forwards the best point of each (mean / worst prompt), and the plot of the frontiers, forwards against PSNR, the mean
solid and the worst prompt of the same point dashed (``.png`` of the same name).

Run: COMFYUI_PATH=... .venv/bin/python benchmarks/bench_forecasting_packs.py --packs PACKS
[--model small|wide|deep|long] [--steps 30] [--compare-only]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]
from omnitest.comfy_path import use_comfyui_in_process  # noqa: E402

if use_comfyui_in_process() is None:
    sys.exit("bench_forecasting_packs: no ComfyUI checkout (set COMFYUI_PATH)")
import torch  # noqa: E402

import bench_cache_quality as bcq  # noqa: E402
import cache_quality_model as cqm  # noqa: E402
import forecasting_packs as fp  # noqa: E402
from cache_quality_plot import plot_frontiers  # noqa: E402
from omnitest.quality import psnr_db  # noqa: E402

OURS = "this pack (best setting)"
WORST_GAP_DB = 2.0  # a setting counts as consistent when its worst prompt is within this of its mean
COMPARED_BUDGETS = {30: (6, 8, 10, 12, 14, 20), 8: (5, 6, 7), 6: (4, 5)}


def result_name(prefix: str, model: str, steps: int, sampler: str = "euler") -> str:
    return (prefix + ("" if model == "small" else f"_{model}") + ("" if steps == 30 else f"_{steps}steps")
            + ("" if sampler == "euler" else f"_{sampler}"))


def sweep_pack(pack: fp.ForecastingPack, node_cls: type, spec: cqm.QualityModel, steps: int,
               reference: list[torch.Tensor], sampler: str = "euler") -> list[dict]:
    """Every setting of ``pack`` at ``steps``, on a model of its own: one row per setting (as the quality bench's)."""
    case = spec.build()
    counter = bcq.Evaluations(case.patcher.model.diffusion_model)
    rows = []
    for setting in pack.settings(steps):
        started = time.perf_counter()
        model = fp.apply_node(node_cls, case.patcher, setting)
        with fp.quiet():
            outs, evals = bcq.sample_all(spec, case, model, counter, steps, sampler=sampler)
        psnrs = [psnr_db(o, r) for o, r in zip(outs, reference)]
        rows.append({"configuration": pack.name, "setting": pack.label(setting), "evaluations": sum(evals) / len(evals),
                     "evaluations_per_prompt": evals, "psnr_mean": sum(psnrs) / len(psnrs), "psnr_min": min(psnrs),
                     "psnr_per_prompt": psnrs})
        print(f"{pack.name:22s} {pack.label(setting):52s} forwards {rows[-1]['evaluations']:5.2f}  PSNR mean "
              f"{rows[-1]['psnr_mean']:6.2f}  min {rows[-1]['psnr_min']:6.2f}  ({time.perf_counter() - started:.1f} s)",
              flush=True)
    return rows


def finite(rows: list[dict]) -> list[dict]:
    """The rows with an infinite PSNR (identical outputs) written as null, which JSON has."""
    def fix(v):
        if isinstance(v, list):
            return [fix(x) for x in v]
        return None if isinstance(v, float) and math.isinf(v) else v
    return [{k: fix(v) for k, v in r.items()} for r in rows]


def psnr(value: float | None) -> float:
    return math.inf if value is None else value


def best(rows: list[dict], budget: float, consistent: bool = False) -> dict | None:
    """The row with the best mean PSNR among those that computed at most ``budget`` forwards on average
    (``consistent``: only those whose worst prompt is within ``WORST_GAP_DB`` of their mean)."""
    fits = [r for r in rows if r["evaluations"] <= budget + 1e-9
            and (not consistent or psnr(r["psnr_min"]) >= psnr(r["psnr_mean"]) - WORST_GAP_DB)]
    return max(fits, key=lambda r: psnr(r["psnr_mean"]), default=None)


def describe(row: dict | None) -> str:
    if row is None:
        return "—"
    if "setting" in row:  # a pack's
        what = row["setting"]
    elif row.get("budget"):  # "budget, forecast auto" -> "budget 8, forecast auto"
        what = row["configuration"].replace("budget", f"budget {row['budget']}", 1)
    else:
        what = f"{row['configuration']} {row['threshold']:g}"
    return f"{psnr(row['psnr_mean']):.1f} / {psnr(row['psnr_min']):.1f} ({what}, {row['evaluations']:g})"


def comparison(ours: list[dict], packs: list[dict], steps: int) -> tuple[str, list[tuple[int, float | None]]]:
    """The markdown table (per budget: ours best, ours best with a consistent worst prompt, each pack's best and the
    margin of ours over the best pack) and the margins."""
    budgets = COMPARED_BUDGETS.get(steps, (steps // 4, steps // 2, 3 * steps // 4))
    names = list(dict.fromkeys(r["configuration"] for r in packs))
    lines = ["| at most N forwards | this pack, best | this pack, best with worst prompt within 2 dB | "
             + " | ".join(names) + " | margin over the best pack (dB) |",
             "|---|---|---|" + "---|" * len(names) + "---|"]
    margins = []
    for budget in budgets:
        mine, steady = best(ours, budget), best(ours, budget, consistent=True)
        theirs = [best([r for r in packs if r["configuration"] == n], budget) for n in names]
        top = max((psnr(t["psnr_mean"]) for t in theirs if t is not None), default=None)
        margin = None if steady is None or top is None else psnr(steady["psnr_mean"]) - top
        margins.append((budget, margin))
        lines.append(f"| {budget} | {describe(mine)} | {describe(steady)} | " + " | ".join(map(describe, theirs))
                     + f" | {'—' if margin is None else f'{margin:+.1f}'} |")
    return "\n".join(lines), margins


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--packs", type=Path, help="the folder the packs were fetched into (see forecasting_packs)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    parser.add_argument("--model", choices=sorted(cqm.MODELS), default="small")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--only", nargs="*", choices=[p.name for p in fp.PACKS], help="run only these packs")
    parser.add_argument("--compare-only", action="store_true",
                        help="run nothing: compare the packs' results already in --out with this pack's")
    parser.add_argument("--more-rows", type=Path, nargs="*", default=[],
                        help="folders with more of this pack's rows for the same model and steps (the --out of "
                        "bench_cache_quality.py, e.g. a sweep with --skip-corrections)")
    parser.add_argument("--sampler", default="euler", help="ComfyUI's sampler name (the files end in _<sampler> for "
                        "any but euler, as bench_cache_quality.py's)")
    opts = parser.parse_args()
    sampler = opts.sampler
    spec, steps = cqm.MODELS[opts.model], opts.steps
    packs_file = opts.out / (result_name("forecasting_packs", spec.name, steps, sampler) + ".json")
    if not opts.compare_only:
        if opts.packs is None:
            parser.error("--packs is required (the folder the packs were fetched into); see forecasting_packs.py")
        chosen = [p for p in fp.PACKS if not opts.only or p.name in opts.only]
        try:
            nodes = {p.name: fp.load_node(opts.packs, p) for p in chosen}
        except fp.PackMissing as e:
            sys.exit(f"bench_forecasting_packs: {e}")
        torch.set_num_threads(1)
        case = spec.build()
        reference, _ = bcq.sample_all(spec, case, None, bcq.Evaluations(case.patcher.model.diffusion_model), steps,
                                      sampler=sampler)
        rows = [r for p in chosen for r in sweep_pack(p, nodes[p.name], spec, steps, reference, sampler)]
        if opts.only and packs_file.is_file():  # keep the other packs' rows
            rows = [r for r in json.loads(packs_file.read_text()) if r["configuration"] not in opts.only] + rows
        opts.out.mkdir(parents=True, exist_ok=True)
        packs_file.write_text(json.dumps(finite(rows), indent=1))
    packs = json.loads(packs_file.read_text())
    ours_file = opts.out / (result_name("cache_quality", spec.name, steps, sampler) + ".json")
    if not ours_file.is_file():
        sys.exit(f"bench_forecasting_packs: no {ours_file.name}; run bench_cache_quality.py --model {spec.name} "
                 f"--steps {steps} --sampler {sampler} first")
    more = [folder / ours_file.name for folder in opts.more_rows]
    missing = [str(f) for f in more if not f.is_file()]
    if missing:
        sys.exit(f"bench_forecasting_packs: no {', '.join(missing)}")
    ours = [r for f in (ours_file, *more) for r in json.loads(f.read_text()) if "EasyCache" not in r["configuration"]]
    table, _ = comparison(ours, packs, steps)
    groups = {OURS: ours, **{name: [r for r in packs if r["configuration"] == name]
                             for name in dict.fromkeys(r["configuration"] for r in packs)}}
    plot_frontiers(groups, packs_file.with_suffix(".png"), steps=steps,
                   title=f"{spec.name} model, {steps} steps, {sampler}: best setting per number of forwards")
    print(f"\n{spec.name} model, {steps} steps, {sampler}: best point at most N forwards, mean / worst prompt in dB "
          f"(setting, forwards):\n")
    print(table)


if __name__ == "__main__":
    main()
