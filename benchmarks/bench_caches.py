"""Caches side by side on one in-process Wan model big enough that the transformer dominates the sampling time.

Wan 2.1 T2V architecture (ComfyUI's own WanModel) at dim 512, 8 blocks, 4 heads, 30 euler steps, cfg 5, on a
[1, 16, 3, 32, 32] latent (768 tokens). The weights are random, so published coefficients and curves do not fit it:
the bench first runs TeaCache Calibrate and MagCache Calibrate on the same model and schedule (as a user would for a
new model) and uses those files.
Every configuration is timed in this one process, interleaved, best of ``--repeats``.

Run: .venv/bin/python benchmarks/bench_caches.py        (needs a ComfyUI checkout; prints markdown)
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests")]
from omnitest.comfy_path import use_comfyui_in_process  # noqa: E402

if use_comfyui_in_process() is None:
    sys.exit("bench_caches: no ComfyUI checkout (set COMFYUI_PATH)")
import folder_paths  # noqa: E402
import torch  # noqa: E402

from omnitest import tiny_models  # noqa: E402
from omnitest.pack import pack_module, run_node  # noqa: E402

STEPS = 30
CFG = 5.0
WAN_BENCH = {"dim": 512, "ffn_dim": 2048, "num_heads": 4, "num_layers": 8}
LATENT = (1, 16, 3, 32, 32)


def psnr(out: torch.Tensor, ref: torch.Tensor) -> float:
    mse = torch.mean((out.double() - ref.double()) ** 2).item()
    peak = (ref.max() - ref.min()).item()
    return math.inf if mse == 0 else 10 * math.log10(peak * peak / mse)


def timed(fn, repeats: int):
    best, result = math.inf, None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def print_table(configs, sample, runs, repeats: int) -> None:
    """Time every configuration (interleaved, so drift on the machine hits every config alike), best of ``repeats``."""
    results = {label: {"seconds": math.inf} for label, _ in configs}
    for _ in range(repeats):
        for label, model in configs:
            seconds, out = timed(lambda: sample(model), 1)
            entry = results[label]
            entry["seconds"] = min(entry["seconds"], seconds)
            entry["out"] = out
            if model is not None:
                entry["computed"] = runs.recent_runs(1)[0]["summary"]["computed"]
    base = results["no node"]
    print(f"Wan 2.1 T2V architecture, dim {WAN_BENCH['dim']}, {WAN_BENCH['num_layers']} blocks, latent {LATENT}, "
          f"{STEPS} euler steps, cfg {CFG} (cond+uncond batched), CPU, {torch.get_num_threads()} threads, "
          f"best of {repeats}\n")
    print("| configuration | computed evaluations | wall time (s) | speedup | max abs error | latent PSNR (dB) |")
    print("|---|---|---|---|---|---|")
    for label, _ in configs:
        r = results[label]
        err = (r["out"] - base["out"]).abs().max().item()
        print(f"| {label} | {r.get('computed', STEPS)}/{STEPS} | {r['seconds']:.2f} | "
              f"{base['seconds'] / r['seconds']:.2f}x | {err:.3g} | {psnr(r['out'], base['out']):.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--overhead-repeats", type=int, default=9,
                        help="rounds of no node vs threshold 0, for the overhead figure")
    parser.add_argument("--overhead-only", action="store_true", help="skip the threshold table")
    parser.add_argument("--thresholds", type=float, nargs="*", default=[0.0, 0.05, 0.1, 0.2, 0.4])
    parser.add_argument("--mag-thresholds", type=float, nargs="*", default=[0.0, 0.03, 0.06, 0.12, 0.24])
    opts = parser.parse_args()
    folder_paths.set_user_directory(tempfile.mkdtemp(prefix="omnihooks-bench-"))
    teacache = pack_module("nodes.caches.teacache")
    calibrate = pack_module("nodes.caches.teacache")
    magcache = pack_module("nodes.caches.magcache")
    mag_calibrate = pack_module("nodes.caches.magcache")
    runs = pack_module("nodes.stats_store")

    case = tiny_models.build_case("wan21_t2v", unet_overrides=WAN_BENCH, latent_shape=LATENT)
    sample = lambda model=None: tiny_models.sample(case, model=model, steps=STEPS, cfg=CFG)  # noqa: E731
    sample()  # warm-up: loads the model, first-call allocations
    for calibrate_node in (calibrate.TeaCacheCalibrate, mag_calibrate.MagCacheCalibrate):
        run_node(calibrate_node, model=case.patcher, seed=0, steps=STEPS, cfg=CFG, sampler_name="euler",
                 scheduler="simple", positive=case.positive, negative=case.negative,
                 latent_image={"samples": case.latent}, name="bench")

    configs = [("no node", None)] + [
        (f"TeaCache {t:g}", run_node(teacache.ApplyTeaCache, model=case.patcher, rel_l1_thresh=t, start_percent=0.0,
                                     end_percent=1.0, cache_device="compute device",
                                     model_variant="calibration: bench")[0])
        for t in opts.thresholds] + [
        (f"MagCache {t:g} (K 2, retention 0.2)",
         run_node(magcache.ApplyMagCache, model=case.patcher, threshold=t, max_skip_steps=2, retention_ratio=0.2,
                  start_percent=0.0, end_percent=1.0, cache_device="compute device", curve="calibration: bench")[0])
        for t in opts.mag_thresholds]
    if not opts.overhead_only:
        print_table(configs, sample, runs, opts.repeats)
    # Overhead: threshold 0 computes every step, so any difference to "no node" is the hooks' cost, expected far below
    # timing noise (< 1 ms of a ~600 ms step). To see through the noise of a shared 2-core machine: one thread,
    # rounds of back-to-back runs (no node, TeaCache 0, MagCache 0), the median over rounds of each run's ratio to
    # the "no node" run of its own round.
    zero_labels = ["no node", "TeaCache 0", "MagCache 0 (K 2, retention 0.2)"]
    models = dict(configs)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ratios = {label: [] for label in zero_labels[1:]}
    for _ in range(opts.overhead_repeats):
        round_times = {label: timed(lambda: sample(models[label]), 1)[0] for label in zero_labels}
        for label in ratios:
            ratios[label].append(round_times[label] / round_times["no node"])
    torch.set_num_threads(threads)
    print(f"\nOverhead at threshold 0 (hooks installed, every step computed; 1 thread; median over "
          f"{opts.overhead_repeats} rounds of the ratio to the same round's no-node run): " + "; ".join(
              f"{label.split()[0]} {(sorted(r)[len(r) // 2] - 1) * 100:+.1f}% "
              f"(rounds {min(r) * 100 - 100:+.1f}% .. {max(r) * 100 - 100:+.1f}%)" for label, r in ratios.items()))

if __name__ == "__main__":
    main()
