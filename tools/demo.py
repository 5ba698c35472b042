"""The pack's main job, headless: a real ComfyUI server, a tiny Wan 2.1 model, with and without Apply TeaCache.

Starts the ComfyUI that tools/comfy_host.py finds (`./run demo` fetches one when there is none) on a free loopback
port with this pack and a tiny Wan 2.1 checkpoint it writes itself, then, through ComfyUI's HTTP API (/prompt,
/history, the websocket):
  1. runs TeaCache Calibrate once, as a fresh node does (random tiny weights fit no published polynomial, as with any
     new model), which also tries the speed-up's forecasts;
  2. runs the Wan example workflow's sampling chain (UNETLoader -> KSampler -> SaveLatent) without a cache node;
  3. runs it again with Apply TeaCache between the loader and the sampler;
and prints what the cache did (from the pack's /omni_hooks/runs route), the speedup and the latent difference.
The server is stopped at the end, also on errors.

Apply TeaCache runs as a fresh node does: at its `speedup` of 2 (half the steps computed, placed by the calibration).
`--threshold` runs the published-threshold path instead (`speedup` 0 and that `rel_l1_thresh`).

Usage: ./run demo [--steps 30] [--speedup 2 | --threshold 0.1]
"""
from __future__ import annotations

import argparse
import math
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from omnitest.comfy_path import PACK_ROOT, comfyui_path  # noqa: E402

LOG_COPY = PACK_ROOT / "test-artifacts" / "demo-comfyui.log"  # the server's own folder is deleted when it stops


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--speedup", type=float, default=None,
                        help="Apply TeaCache speedup (default: what a fresh node shows, read from the server)")
    choice.add_argument("--threshold", type=float, default=None,
                        help="Apply TeaCache rel_l1_thresh on the published-threshold path (speedup 0)")
    opts = parser.parse_args()
    if comfyui_path() is None:
        print("demo: no ComfyUI found; `./run demo` fetches one, or set COMFYUI_PATH to a ComfyUI 0.3.64 or newer "
              "(see README, 'Try it, test it').")
        return 2

    from omnitest.server import ComfyServer

    sampling = dict(steps=opts.steps, cfg=5.0, width=256, height=256, length=9)
    with ComfyServer(threads=None) as server:
        print(f"ComfyUI started on {server.url}; its log will be kept in {LOG_COPY}")
        try:
            run(server, opts, sampling)
        finally:
            server.stop()
            LOG_COPY.parent.mkdir(exist_ok=True)
            shutil.copyfile(server.log_path, LOG_COPY)
    print(f"ComfyUI stopped; its log: {LOG_COPY}")
    return 0


def run(server, opts, sampling: dict) -> None:
    from omnitest.graphs import tiny_wan_graph

    client = server.client()
    calibrate = tiny_wan_graph(**sampling)
    calibrate.sampler.class_type = "OmniHooks.TeaCacheCalibrate"  # same inputs as KSampler, plus a name
    calibrate.sampler.set_input("name", "tiny-wan-demo")
    calibrate.sampler.set_input("try_speedups", True)  # a fresh node's default
    client.run(calibrate.prompt(), timeout=600)
    print("1. TeaCache Calibrate fitted the tiny model, tried the speed-up's forecasts and saved 'tiny-wan-demo'")

    timings, latents = {}, {}
    threshold_path = opts.threshold is not None
    if not threshold_path and opts.speedup is None:  # a fresh node's, as the server's schema gives it
        info = client.get_json("/object_info/OmniHooks.ApplyTeaCache")["OmniHooks.ApplyTeaCache"]
        opts.speedup = float(info["input"]["optional"]["speedup"][1]["default"])
    setting = f"rel_l1_thresh {opts.threshold:g}" if threshold_path else f"speedup {opts.speedup:g}"
    teacache = ("OmniHooks.ApplyTeaCache", {"rel_l1_thresh": opts.threshold if threshold_path else -1.0,
                                            "start_percent": 0.0, "end_percent": 1.0,
                                            "cache_device": "compute device",
                                            "model_variant": "calibration: tiny-wan-demo",
                                            "speedup": 0.0 if threshold_path else opts.speedup})
    for label, patches in (("without cache", []), ("with Apply TeaCache", [teacache])):
        graph = tiny_wan_graph(patches, **sampling)
        start = time.perf_counter()
        result = client.run(graph.prompt(), timeout=600)
        timings[label] = time.perf_counter() - start
        latents[label] = result.latent("5")
        prompt_id = result.prompt_id
    runs = client.get_json("/omni_hooks/runs", {"prompt_id": prompt_id})["runs"]
    summary = runs[0]["summary"]
    print(f"2./3. sampled {opts.steps} steps at cfg 5 without and with Apply TeaCache ({setting})")
    print(f"   TeaCache: reused {summary['reused']} of {summary['evaluations']} model evaluations "
          f"({summary['hit_rate']:.0%}); per branch: "
          + ", ".join(f"{b} {c['reused']} reused/{c['computed']} computed"
                      for b, c in sorted(summary["branches"].items())))
    print(f"   time in the model {summary['model_seconds']:.2f} s, estimated saved "
          f"{summary['estimated_seconds_saved']:.2f} s ({summary['estimated_speedup']:.2f}x in the model)")
    base, cached = latents["without cache"], latents["with Apply TeaCache"]
    diff = (cached - base).abs().max().item()
    mse = ((cached.double() - base.double()) ** 2).mean().item()
    peak = (base.max() - base.min()).item()
    psnr = math.inf if mse == 0 else 10 * math.log10(peak * peak / mse)
    print(f"   prompt wall time {timings['without cache']:.2f} s -> {timings['with Apply TeaCache']:.2f} s "
          f"({timings['without cache'] / timings['with Apply TeaCache']:.2f}x); "
          f"latent max abs difference {diff:.4f}, PSNR {psnr:.1f} dB")
    for note in summary.get("notes", []):
        print(f"   note: {note}")
    for warning in summary["warnings"]:
        print(f"   warning: {warning}")


if __name__ == "__main__":
    sys.exit(main())
