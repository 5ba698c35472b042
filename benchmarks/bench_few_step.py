"""Few-step runs: the caches with and without the few-step rule (``caching.few_step``) at 4 and 8 steps.

ComfyUI's own Wan 2.1 T2V model class (random weights) at dim 256, 4 blocks, on a [1, 16, 3, 16, 16] latent, euler,
cfg 5, in-process through ComfyUI's KSampler. TeaCache Calibrate and MagCache Calibrate first run once on the same
model at the longest step count (what a user does for a model without published numbers); then at each step count
each Apply node runs with the rule (as the nodes do) and with it turned off, at a few thresholds. Error and PSNR compare
the final latent with the no-node latent of the same step count. Interleaved, best of ``--repeats``.

Run: .venv/bin/python benchmarks/bench_few_step.py        (needs a ComfyUI checkout; prints markdown)
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]
from omnitest.comfy_path import use_comfyui_in_process  # noqa: E402

if use_comfyui_in_process() is None:
    sys.exit("bench_few_step: no ComfyUI checkout (set COMFYUI_PATH)")
import folder_paths  # noqa: E402
import torch  # noqa: E402
from bench_caches import psnr, timed  # noqa: E402

from omnitest import tiny_models  # noqa: E402
from omnitest.pack import pack_module, run_node  # noqa: E402

CFG = 5.0
WAN_BENCH = {"dim": 256, "ffn_dim": 1024, "num_heads": 4, "num_layers": 4}
LATENT = (1, 16, 3, 16, 16)


@contextlib.contextmanager
def rule_off(*node_modules):
    """The Apply nodes build their configs without the few-step rule (the library's default)."""
    saved = [m.FewStepRule for m in node_modules]
    for m in node_modules:
        m.FewStepRule = lambda: None
    try:
        yield
    finally:
        for m, rule in zip(node_modules, saved):
            m.FewStepRule = rule


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, nargs="*", default=[4, 8])
    parser.add_argument("--thresholds", type=float, nargs="*", default=[0.3, 1.0])
    parser.add_argument("--mag-thresholds", type=float, nargs="*", default=[0.12, 0.5])
    opts = parser.parse_args()
    folder_paths.set_user_directory(tempfile.mkdtemp(prefix="omnihooks-bench-"))
    teacache = pack_module("nodes.caches.teacache")
    magcache = pack_module("nodes.caches.magcache")
    runs = pack_module("nodes.stats_store")
    case = tiny_models.build_case("wan21_t2v", unet_overrides=WAN_BENCH, latent_shape=LATENT)

    print(f"Wan 2.1 T2V architecture, dim {WAN_BENCH['dim']}, {WAN_BENCH['num_layers']} blocks, latent {LATENT}, "
          f"euler, cfg {CFG}, CPU, {torch.get_num_threads()} threads, best of {opts.repeats}\n")
    print("| steps | configuration | few-step rule | computed | wall time (s) | speedup | max abs error | "
          "latent PSNR (dB) |")
    print("|---|---|---|---|---|---|---|---|")
    # one calibration at the longest step count (a 4-step run has too few distinct points to fit a polynomial);
    # both caches interpolate it to the run's step count
    name = "bench"
    for node in (teacache.TeaCacheCalibrate, magcache.MagCacheCalibrate):
        run_node(node, model=case.patcher, seed=0, steps=max(opts.steps), cfg=CFG, sampler_name="euler",
                 scheduler="simple", positive=case.positive, negative=case.negative,
                 latent_image={"samples": case.latent}, name=name)
    for steps in opts.steps:
        sample = lambda model=None: tiny_models.sample(case, model=model, steps=steps, cfg=CFG)  # noqa: E731
        sample()  # warm-up

        def tea(t):
            return run_node(teacache.ApplyTeaCache, model=case.patcher, rel_l1_thresh=t, start_percent=0.0,
                            end_percent=1.0, cache_device="compute device", model_variant=f"calibration: {name}")[0]

        def mag(t):
            return run_node(magcache.ApplyMagCache, model=case.patcher, threshold=t, max_skip_steps=2,
                            retention_ratio=0.0, start_percent=0.0, end_percent=1.0, cache_device="compute device",
                            curve=f"calibration: {name}")[0]

        configs = [("no node", None, "-")]
        for rule in ("on", "off"):
            configs += [(f"TeaCache {t:g}", lambda t=t: tea(t), rule) for t in opts.thresholds]
            configs += [(f"MagCache {t:g} (K 2)", lambda t=t: mag(t), rule) for t in opts.mag_thresholds]
        results = {}
        for _ in range(opts.repeats):
            for label, make, rule in configs:
                with rule_off(teacache, magcache) if rule == "off" else contextlib.nullcontext():
                    model = make() if make else None
                    seconds, out = timed(lambda: sample(model), 1)
                entry = results.setdefault((label, rule), {"seconds": seconds})
                entry["seconds"] = min(entry["seconds"], seconds)
                entry["out"] = out
                entry["computed"] = runs.recent_runs(1)[0]["summary"]["computed"] if make else steps
                if make and rule == "on":
                    entry["notes"] = runs.recent_runs(1)[0]["summary"]["notes"]
        base = results[("no node", "-")]
        for label, _, rule in configs:
            r = results[(label, rule)]
            err = (r["out"] - base["out"]).abs().max().item()
            print(f"| {steps} | {label} | {rule} | {r['computed']}/{steps} | {r['seconds']:.2f} | "
                  f"{base['seconds'] / r['seconds']:.2f}x | {err:.3g} | {psnr(r['out'], base['out']):.1f} |")
    notes = {n for r in results.values() for n in r.get("notes", []) if n.startswith("few-step")}
    print("\nWhat the runs' statistics said: " + " / ".join(sorted(notes)))


if __name__ == "__main__":
    main()
