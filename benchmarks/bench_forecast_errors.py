"""What a cache's skipped steps add to the latent: each forecast's error at every skipped step, and their sum.

The reference run's block-stack residual is kept at every step (threshold 0), then a cached run (``--cache``,
``--threshold``, ``--forecast``) is observed: at each skipped step and branch, every candidate forecast the branch's
history allows (``caching.forecast.CANDIDATES``: reuse, 1st and 2nd order, the Taylor step, the Chebyshev fit; one
the history is too short for falls back as the cache's own forecast does) is compared with the reference's residual at
that sigma. What reaches the latent at cfg c is
``dt * (c * e_cond - (c - 1) * e_uncond)`` per skipped step; the table gives, for the same skipped steps, the norm of
its sum over the run (how much the errors add up) against the root of its summed squares (their size alone),
relative to the sum of the reference's residuals weighted alike, mean over the 4 prompts, each for: every candidate,
the cache's own choice, and at each skip the candidate closest to the reference (which no cache can know). Then the
same skipped-step policies are run for real (each candidate forced at every skip, the closest one at every skip) and
the final latent's PSNR against no cache is given, with the cache's own run.

The models, prompts and calibration are those of ``bench_cache_quality.py``.
Run: COMFYUI_PATH=... .venv/bin/python benchmarks/bench_forecast_errors.py --model deep --cache tea --threshold 0.12
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench_cache_quality import CFG, calibrated_case, cqm, mag, psnr_db, sample_all, tea

CACHES = {"tea": tea, "mag": mag}
CACHE_CHOICE, CLOSEST = "the cache's choice", "closest to the reference"


@dataclass
class Observer:
    """What the patched stack cache records (``recording``: the reference residuals) or forces (``forced``: a
    candidate's key, ``CLOSEST``, or None for the cache's own choice) while ``prompt`` is sampled."""

    prompt: int = 0
    recording: bool = False
    forced: int | str | None = None
    reference: dict = field(default_factory=dict)  # (prompt, label, sigma) -> residual
    skips: list = field(default_factory=list)  # (prompt, label, sigma, [error per candidate], the cache's choice)

    def clear(self) -> None:
        self.skips.clear()


def pack_module(name: str):
    """The pack's module ``omni_hooks.<name>``, as ComfyUI loaded it."""
    return next(m for n, m in sys.modules.items() if n.endswith(f"omni_hooks.{name}"))


def stack_cache_run() -> type:
    """The pack's ``StackCacheRun`` class, as ComfyUI loaded it."""
    return pack_module("caching.run").StackCacheRun


def coordinate(context) -> float | None:
    """Where a call lies for forecasting (``omni_hooks.caching.residuals.coordinate``)."""
    return pack_module("caching.residuals").coordinate(context)


def candidate_names() -> dict[int, str]:
    """Every candidate forecast's key and name (``omni_hooks.caching.forecast.CANDIDATE_NAMES``)."""
    return dict(pack_module("caching.forecast").CANDIDATE_NAMES)


@contextlib.contextmanager
def observed(observer: Observer):
    """Patch the stack cache to record residuals and observe (or force) skipped steps; restored on exit."""
    run = stack_cache_run()
    store, skipped = run.store_residual, run.skipped_residuals

    def store_residual(self, head_input, output):
        if observer.recording and output.shape == head_input.shape:
            call, residual = self.active_call, (output - head_input).detach().float()
            size = output.shape[0] // call.chunk
            for i, label in enumerate(call.labels):
                key = (observer.prompt, label, round(float(coordinate(call.context)), 6))
                observer.reference[key] = residual[i * size:(i + 1) * size].clone()
        return store(self, head_input, output)

    def skipped_residuals(self):
        call = self.active_call
        residuals = skipped(self)
        sigma = coordinate(call.context)
        for i, (key, label) in enumerate(zip(call.keys, call.labels)):
            want = observer.reference.get((observer.prompt, label, round(float(sigma), 6)))
            history = self.branch_state(key).history
            if want is None or not history.residuals:
                continue
            made = [history.forecast(sigma, candidate=key).residual for key in candidate_names()]
            errors = [m.float() - want for m in made]
            chosen = call.record.branches[i].candidate if call.record is not None else 0
            observer.skips.append((observer.prompt, label, float(sigma), errors, chosen))
            if observer.forced is not None:
                pick = (min(range(len(errors)), key=lambda c: float(errors[c].square().sum()))
                        if observer.forced == CLOSEST else observer.forced)
                residuals[i] = made[pick]
        return residuals

    run.store_residual, run.skipped_residuals = store_residual, skipped_residuals
    try:
        yield observer
    finally:
        run.store_residual, run.skipped_residuals = store, skipped


def sampled(observer: Observer, spec, case, model, counter, steps):
    """``sample_all`` with ``observer.prompt`` following the prompt being sampled."""
    outs, evals = [], []
    for k in range(cqm.CLASSES):
        observer.prompt = k
        out, ev = sample_all(spec, case, model, counter, steps, classes=[k])
        outs += out
        evals += ev
    return outs, evals


def summed_errors(observer: Observer) -> dict[str, tuple[float, float]]:
    """Per policy: (norm of the summed latent error, root of its summed squares), each over the norm of the
    reference's residuals summed alike, mean over the prompts."""
    policies = {name: (lambda key: lambda errors, chosen: key)(key) for key, name in candidate_names().items()}
    policies[CACHE_CHOICE] = lambda errors, chosen: chosen
    policies[CLOSEST] = lambda errors, chosen: min(range(len(errors)), key=lambda c: float(errors[c].square().sum()))
    results = {name: [0.0, 0.0] for name in policies}
    prompts = sorted({p for p, *_ in observer.skips})
    for prompt in prompts:
        sigmas = sorted({s for p, _, s in observer.reference if p == prompt}, reverse=True) + [0.0]
        following = {round(s, 6): sigmas[j + 1] for j, s in enumerate(sigmas[:-1])}
        scale = sum(abs(following[s] - s) * weight(label) * observer.reference[(prompt, label, s)]
                    for p, label, s in observer.reference if p == prompt).norm().item()
        for name, pick in policies.items():
            total, squares = 0, 0.0
            for p, label, sigma, errors, chosen in observer.skips:
                if p == prompt:
                    step = (following[round(sigma, 6)] - sigma) * weight(label) * errors[pick(errors, chosen)]
                    total, squares = total + step, squares + step.square().sum().item()
            results[name][0] += torch.as_tensor(total).norm().item() / scale / len(prompts)
            results[name][1] += squares ** 0.5 / scale / len(prompts)
    return {name: (a, b) for name, (a, b) in results.items()}


def weight(label: str) -> float:
    """A branch's weight in the cfg combination: ``CFG`` for cond, ``1 - CFG`` for uncond, 1 without cfg."""
    return (1 - CFG) if label.startswith("uncond") else CFG if label.startswith("cond") else 1.0


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(cqm.MODELS), default="deep")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--cache", choices=sorted(CACHES), default="tea")
    parser.add_argument("--threshold", type=float, default=0.12)
    parser.add_argument("--forecast", default="auto", help="the cache's forecast: off, 1st order, 2nd order, auto")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    opts = parser.parse_args(argv)
    spec, steps, apply = cqm.MODELS[opts.model], opts.steps, CACHES[opts.cache]
    case, counter = calibrated_case(spec, steps)
    reference, _ = sample_all(spec, case, None, counter, steps)
    with observed(Observer()) as observer:
        observer.recording = True
        sampled(observer, spec, case, apply(case, 0.0, "off"), counter, steps)
        observer.recording = False
        psnr, evaluations = {}, {}
        for forced, name in [(None, CACHE_CHOICE), *candidate_names().items(), (CLOSEST, CLOSEST)]:
            observer.clear()
            observer.forced = forced
            outs, evals = sampled(observer, spec, case, apply(case, opts.threshold, opts.forecast), counter, steps)
            psnr[name] = sum(psnr_db(o, r) for o, r in zip(outs, reference)) / len(outs)
            evaluations[name] = sum(evals) / len(evals)
            if forced is None:
                sums, skips = summed_errors(observer), len(observer.skips)
    print(f"{spec.name} model, {steps} steps, cfg {CFG:g}, {opts.cache} {opts.threshold:g}, forecast {opts.forecast}: "
          f"{evaluations[CACHE_CHOICE]:.2f} evaluations on average, {skips} skipped branch steps observed\n")
    print("| at the cache's skipped steps | norm of the summed error | root of the summed squared errors | "
          "mean PSNR, used at every skip (dB) |")
    print("|---|---|---|---|")
    for name, (summed, rss) in sums.items():
        print(f"| {name} | {summed:.4f} | {rss:.4f} | {psnr[name]:.1f} ({evaluations[name]:.2f} evaluations) |")
    rows = {name: {"summed": summed, "root_of_squares": rss, "psnr_mean": psnr[name], "evaluations": evaluations[name]}
            for name, (summed, rss) in sums.items()}
    result = {"skipped_branch_steps": skips, "evaluations": evaluations[CACHE_CHOICE], "rows": rows}
    if opts.json:
        opts.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
