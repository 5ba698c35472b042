"""The speed-up's tables in docs/benchmarks.md ("One setting for the speed-up"), from the sweeps in ``docs/samplers/``.

Per sampler, per forward budget of 30 steps and per benchmark model: what a fresh node at that speed-up gives
(``speedup*.json``: Apply TeaCache with only its speed-up set), its recipe (``omni_hooks.caching.speedup.recipe``:
'1st order', skip correction 0.5 where the sampler is euler) as a forward budget placed by the calibration's step
profile (a row of the sweep; with euler it is the speed-up itself, bit for bit), the best forecast and correction of
the sweep at that budget, 'auto' against the best of 'off' / '1st order' / '2nd order', and TaylorSeerLite's best
point at that many forwards or fewer (``bench_forecasting_packs.py``).

The sweeps (ComfyUI 0.33.0, this repository's machine):
  bench_cache_quality.py --model M --sampler S --budgets 5 6 8 10 12 15 --no-budget-pulls --tea-thresholds
      --mag-thresholds --easy-thresholds --skip-corrections 0 [0.5] --out docs/samplers
  bench_cache_quality.py --model M --sampler S --budgets --no-budget-pulls --tea-thresholds --mag-thresholds
      --easy-thresholds --skip-corrections 0 --speedups 2 3 3.75 5 6 --out OUT
      (OUT's cache_quality*.json saved as docs/samplers/speedup*.json; heun's, not tabled here, with --budgets 15 10
      8 6 5 --forecasts "1st order" too)
  bench_forecasting_packs.py --packs PACKS --only TaylorSeerLite --model M --sampler S --out docs/samplers
(euler's packs: docs/forecasting_packs*.json, every pack). Run: python benchmarks/speedup_tables.py
"""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLERS = ("euler", "uni_pc", "dpmpp_2m", "res_multistep")
MODELS = ("small", "wide", "deep", "long")
BUDGETS = (15, 10, 8, 6, 5)
FIXED = ("off", "1st order", "2nd order")
RECIPE_FORECAST = "1st order"


def name(prefix: str, model: str, sampler: str) -> str:
    return prefix + ("" if model == "small" else f"_{model}") + ("" if sampler == "euler" else f"_{sampler}") + ".json"


def forecast(row: dict) -> str:
    return row["configuration"].rsplit("forecast ", 1)[1]


def label(row: dict) -> str:
    correction = row.get("skip_correction") or 0
    return forecast(row) + (f" + correction {correction:g}" if correction else "")


def cell(row: dict) -> str:
    return f"{row['psnr_mean']:.1f} / {row['psnr_min']:.1f}"


def speedup_row(model: str, sampler: str, budget: int) -> dict:
    """The fresh node's row at the speed-up that computes ``budget`` of 30 steps (Apply TeaCache's)."""
    rows = json.loads((ROOT / "docs" / "samplers" / name("speedup", model, sampler)).read_text())
    return next(r for r in rows if r["configuration"].startswith("TeaCache speed-up")
                and round(30 / r["speedup"]) == budget)


def table(sampler: str) -> tuple[str, list[tuple[str, int, float, float, float | None]]]:
    """The markdown table of ``sampler`` and, per model and budget, (model, budget, the speed-up's mean, the best
    mean of the sweep and the speed-up, the best pack's mean or None)."""
    correction = 0.5 if sampler == "euler" else 0.0
    lines = ["| forwards (speed-up) | model | the speed-up | its recipe, placed by the step profile "
             "| best of the sweep | `auto` against the best fixed order | TaylorSeerLite, at most as many |",
             "|---|---|---|---|---|---|---|"]
    figures = []
    for budget in BUDGETS:
        for model in MODELS:
            rows = [r for r in json.loads((ROOT / "docs" / "samplers" / name("cache_quality", model, sampler))
                                          .read_text()) if r.get("budget") == budget]
            recipe = next(r for r in rows if forecast(r) == RECIPE_FORECAST
                          and (r.get("skip_correction") or 0) == correction)
            speedup = speedup_row(model, sampler, budget)
            best = max(rows, key=lambda r: r["psnr_mean"])
            same = [r for r in rows if (r.get("skip_correction") or 0) == correction]
            auto = next(r for r in same if forecast(r) == "auto")
            fixed = max((r for r in same if forecast(r) in FIXED), key=lambda r: r["psnr_mean"])
            packs_file = (ROOT / "docs" / name("forecasting_packs", model, sampler) if sampler == "euler"
                          else ROOT / "docs" / "samplers" / name("forecasting_packs", model, sampler))
            packs = [r for r in json.loads(packs_file.read_text()) if r["evaluations"] <= budget + 1e-9]
            pack = max(packs, key=lambda r: r["psnr_mean"], default=None)
            lines.append(f"| {budget} ({30 / budget:.3g}x) | {model} | {cell(speedup)} | {cell(recipe)} "
                         f"| {cell(best)} ({label(best)}) "
                         f"| {auto['psnr_mean'] - fixed['psnr_mean']:+.1f} ({forecast(fixed)}) | "
                         + ("—" if pack is None else f"{cell(pack)} ({pack['configuration']}: {pack['setting']}, "
                                                     f"{pack['evaluations']:g})") + " |")
            figures.append((model, budget, speedup["psnr_mean"], max(best["psnr_mean"], speedup["psnr_mean"]),
                            None if pack is None else pack["psnr_mean"]))
    return "\n".join(lines), figures


def summary(figures: dict[str, list]) -> str:
    """The README's table: per speed-up and sampler, the lowest and highest mean over the models, and the best pack's
    at 8 forwards."""
    lines = ["| `speedup` (computed) | " + " | ".join(SAMPLERS) + " |", "|---|" + "---|" * len(SAMPLERS)]
    for budget in BUDGETS:
        cells = []
        for sampler in SAMPLERS:
            means = [recipe for _, b, recipe, _, _ in figures[sampler] if b == budget]
            cells.append(f"{min(means):.1f}-{max(means):.1f}")
        lines.append(f"| {30 / budget:.3g} ({budget}) | " + " | ".join(cells) + " |")
    packs = []
    for sampler in SAMPLERS:
        means = [pack for _, b, _, _, pack in figures[sampler] if b == 8 and pack is not None]
        packs.append(f"{min(means):.1f}-{max(means):.1f}")
    lines.append("| best forecasting pack, 8 forwards | " + " | ".join(packs) + " |")
    return "\n".join(lines)


def main() -> None:
    figures = {sampler: table(sampler)[1] for sampler in SAMPLERS}
    print(summary(figures))
    for sampler in SAMPLERS:
        text, figures = table(sampler)
        print(f"\n{sampler}:\n\n{text}\n")
        within = sum(best - recipe <= 1.0 for _, budget, recipe, best, _ in figures if budget >= 8)
        print(f"the speed-up within 1 dB of the best (the sweep's or its own) at 2x to 3.75x: {within} of "
              f"{sum(budget >= 8 for _, budget, *_ in figures)}")
        margins = [recipe - pack for _, budget, recipe, _, pack in figures if budget == 8 and pack is not None]
        print(f"at 8 forwards, the speed-up over TaylorSeerLite: {min(margins):+.1f} to {max(margins):+.1f} dB")


if __name__ == "__main__":
    main()
