"""Reference runs of the caches on tiny models: the check that a change to the cache core changes no latent.

Samples tiny Wan 2.1 and Flux models in-process through ComfyUI's KSampler path with each cache at each forecast,
with forward budgets, skip corrections (euler, and heun where it applies nothing), few steps, 30 steps, a published
entry and both Calibrate nodes followed by a budgeted run on their files. Keeps each run's final latent and what its
statistics say (the summary without timings, and every decision: step, computed, branch, reason, metric, the forecast
candidate used).

    COMFYUI_PATH=... .venv/bin/python -m tools.reference_runs save    # before the change
    COMFYUI_PATH=... .venv/bin/python -m tools.reference_runs check   # after it: exit 1 naming every run that differs

The file (``--file``, default test-artifacts/reference_runs.pt) holds tensors and strings only and is read with
``weights_only``. Compare on the machine and host that saved it: another CPU's matrix kernels round otherwise.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from omnitest.comfy_path import PACK_ROOT, use_comfyui_in_process  # noqa: E402

STEPS = 10
TIMINGS = ("model_seconds", "estimated_seconds_saved", "estimated_speedup")


def last_run_record() -> str:
    """The newest run's statistics as canonical JSON, timings left out."""
    from omnitest.pack import pack_module

    store = pack_module("nodes.stats_store")
    run = store.get_run(store.recent_runs(1)[0]["run_id"])
    summary = {k: v for k, v in run["summary"].items() if k not in TIMINGS}
    decisions = [(e["step"], e["computed"], [(b["branch"], b["reason"], b["metric"], b.get("candidate"))
                                             for b in e["branches"]]) for e in run["evaluations"]]
    return json.dumps({"summary": summary, "decisions": decisions}, sort_keys=True, default=str)


def reference_runs() -> dict[str, tuple]:
    """Every reference run by name: (final latent, what its statistics or its calibration file say)."""
    import folder_paths

    folder_paths.set_user_directory(tempfile.mkdtemp(prefix="omnihooks-reference-"))
    from omnitest import tiny_models as tm
    from omnitest.cache_nodes import apply_magcache, apply_teacache, save_identity_calibrations
    from omnitest.pack import pack_module, run_node

    save_identity_calibrations("ident", STEPS)
    save_identity_calibrations("identflux", STEPS, family="flux")
    wan, flux = tm.build_case("wan21_t2v"), tm.build_case("flux")
    runs: dict[str, tuple] = {}

    def run(name: str, case, model, steps: int = STEPS, **sampling) -> None:
        latent = tm.sample(case, model=model, steps=steps, **({"cfg": 3.0} if case is wan else {}), **sampling)
        runs[name] = (latent.clone(), last_run_record())

    for forecast in ("off", "1st order", "2nd order", "auto"):
        run(f"tea-{forecast}", wan, apply_teacache(wan.patcher, "ident", 1.5, forecast=forecast))
        run(f"mag-{forecast}", wan, apply_magcache(wan.patcher, "ident", 0.3, forecast=forecast, max_skip_steps=2))
    for forecast in ("off", "1st order", "auto"):
        run(f"tea-budget-{forecast}", wan, apply_teacache(wan.patcher, "ident", 0.5, forecast=forecast,
                                                          forward_budget=4))
        run(f"mag-budget-{forecast}", wan, apply_magcache(wan.patcher, "ident", 0.1, forecast=forecast,
                                                          forward_budget=5))
    for correction in (0.5, 1.0):
        for forecast in ("off", "1st order", "auto"):
            run(f"tea-sc{correction}-{forecast}", wan, apply_teacache(wan.patcher, "ident", 1.5, forecast=forecast,
                                                                      skip_correction=correction))
            run(f"mag-sc{correction}-{forecast}", wan, apply_magcache(wan.patcher, "ident", 0.3, forecast=forecast,
                                                                      skip_correction=correction))
        run(f"tea-sc{correction}-budget", wan, apply_teacache(wan.patcher, "ident", 0.0, forecast="1st order",
                                                              forward_budget=4, skip_correction=correction))
    run("tea-sc-heun", wan, apply_teacache(wan.patcher, "ident", 1.5, forecast="1st order", skip_correction=0.5),
        sampler_name="heun")
    for steps in (4, 6, 8):
        run(f"tea-few{steps}", wan, apply_teacache(wan.patcher, "ident", 3.0, forecast="auto"), steps=steps)
        run(f"mag-few{steps}", wan, apply_magcache(wan.patcher, "ident", 1.0, forecast="off", max_skip_steps=3),
            steps=steps)
    run("tea-30-auto", wan, apply_teacache(wan.patcher, "ident", 2.0, forecast="auto"), steps=30)
    run("mag-30-auto", wan, apply_magcache(wan.patcher, "ident", 0.5, forecast="auto", max_skip_steps=3), steps=30)
    run("tea-flux", flux, apply_teacache(flux.patcher, "identflux", 1.5, forecast="auto"))
    run("mag-flux", flux, apply_magcache(flux.patcher, "identflux", 0.3, forecast="2nd order"))
    teacache = pack_module("nodes.caches.teacache")
    run("tea-published", flux, run_node(teacache.ApplyTeaCache, node_id="31", model=flux.patcher, rel_l1_thresh=0.3,
                                        start_percent=0.0, end_percent=1.0, cache_device="compute device",
                                        model_variant="flux")[0])
    for kind, calibrate in (("teacache", teacache.TeaCacheCalibrate),
                            ("magcache", pack_module("nodes.caches.magcache").MagCacheCalibrate)):
        latent, text = run_node(calibrate, model=wan.patcher, seed=0, steps=12, cfg=3.0, sampler_name="euler",
                                scheduler="simple", positive=wan.positive, negative=wan.negative,
                                latent_image={"samples": wan.latent}, name=f"cal-{kind}")
        runs[f"cal-{kind}"] = (latent["samples"].clone(), json.dumps(json.loads(text), sort_keys=True))
        apply = apply_teacache if kind == "teacache" else apply_magcache
        run(f"{kind}-with-cal-budget", wan, apply(wan.patcher, f"cal-{kind}", 0.2 if kind == "teacache" else 0.1,
                                                  forecast="auto", forward_budget=5))
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("save", "check"))
    parser.add_argument("--file", type=Path, default=PACK_ROOT / "test-artifacts" / "reference_runs.pt")
    opts = parser.parse_args()
    if use_comfyui_in_process() is None:
        print("reference_runs: no ComfyUI found; set COMFYUI_PATH")
        return 2
    import torch

    runs = reference_runs()
    if opts.mode == "save":
        opts.file.parent.mkdir(parents=True, exist_ok=True)
        torch.save({name: list(value) for name, value in runs.items()}, opts.file)
        print(f"reference_runs: saved {len(runs)} runs to {opts.file}")
        return 0
    saved = torch.load(opts.file, weights_only=True)
    differ = [name for name, (latent, record) in saved.items()
              if name not in runs or not torch.equal(runs[name][0], latent) or runs[name][1] != record]
    for name in differ:
        if name in runs and runs[name][1] != saved[name][1]:
            print(f"{name}: statistics differ\n  saved {saved[name][1][:2000]}\n  now   {runs[name][1][:2000]}")
    new = sorted(set(runs) - set(saved))
    print(f"reference_runs: {len(saved)} runs checked against {opts.file}; differ: {differ or 'none'}"
          + (f"; not in the file: {new}" if new else ""))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
