"""The Sequence Parallel node's run in ComfyUI: time per sampling step at 1 rank vs N ranks, side by side in one run.

ComfyUI in this process (rank 0) samples a Wan 2.1, LTX-2 (video and audio) or Kandinsky 5 model (``--model``; the last
two need ComfyUI 0.33) built from ComfyUI's own classes (random weights of a chosen size) with ComfyUI's KSampler, once
without the node and through the node's session (Ulysses, ring, CFG parallel) at each ``--ranks`` (the pack starts N - 1
local worker processes, sends them the weights, and every call is split across the ranks). Rounds are interleaved; the
table gives the median round (and the best); the first run of each (worker start, weight transfer) is a warm-up and not
timed. "control" is rank 0's time in the group's commands (encoding and sending the call, waiting for every worker's
answer: the control path alone), per model call; "sent per step" is what rank 0 sent through torch.distributed per step
(the model's exchanges and the cache agreement, the card's ``bytes_sent``; a call's large tensors over the broadcast
size count too). "added per call" is the median step's time over 1 rank's, divided by the model calls per step: at a
tiny shape (``--dim 256 --layers 1 --frames 1 --size 8``) compute is near zero and it is what the control path, the
call's setup on every rank and the model's own exchanges cost per model call.

CPU (default): gloo ranks, one thread each (every exchange a gloo collective). CUDA (``--devices cuda``, at least N
GPUs): NCCL ranks; adds rank 0's peak memory (``torch.cuda.max_memory_allocated``) and each GPU's memory in use after
the run (device-wide, all processes).

Run: .venv/bin/python benchmarks/bench_sequence_parallel_node.py [--ranks 2 4] [--devices cpu|cuda]
(needs a ComfyUI checkout: COMFYUI_PATH or ~/ComfyUI; prints markdown for docs/benchmarks.md)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the workers: one thread per rank
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests")]

import torch  # noqa: E402


def _wan(args):
    heads = args.dim // 128
    overrides = {"dim": args.dim, "num_heads": heads, "ffn_dim": 4 * args.dim, "num_layers": args.layers}
    return "wan21_t2v", overrides, (1, 16, args.frames, args.size, args.size), args.frames * (args.size // 2) ** 2


def _ltx2(args):
    heads = args.dim // 128
    overrides = {"num_attention_heads": heads, "attention_head_dim": 128, "cross_attention_dim": args.dim,
                 "audio_num_attention_heads": heads, "audio_attention_head_dim": 64,
                 "audio_cross_attention_dim": args.dim // 2, "num_layers": args.layers}
    return "ltxav", overrides, None, args.frames * args.size ** 2


def _kandinsky5(args):
    overrides = {"model_dim": args.dim, "ff_dim": 4 * args.dim, "axes_dims": (32, 48, 48),
                 "num_visual_blocks": args.layers}
    return "kandinsky5", overrides, (1, 16, args.frames, args.size, args.size), args.frames * (args.size // 2) ** 2


#: --model: (tiny case, its config at --dim and --layers, latent shape or None, video tokens)
MODELS = {"wan": _wan, "ltx2": _ltx2, "kandinsky5": _kandinsky5}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2], help="one or more world sizes")
    parser.add_argument("--devices", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--model", choices=sorted(MODELS), default="wan")
    parser.add_argument("--dim", type=int, default=512, help="width (heads = dim / 128; LTX-2's audio: half of it)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--frames", type=int, default=5, help="latent frames")
    parser.add_argument("--size", type=int, default=32,
                        help="latent height = width (tokens = frames * (size / patch)^2; patch 2, LTX-2's 1)")
    parser.add_argument("--audio", type=int, default=40, help="LTX-2's audio tokens")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    from omnitest.comfy_path import use_comfyui_in_process

    if use_comfyui_in_process(cpu=args.devices == "cpu") is None:
        print("no ComfyUI checkout (COMFYUI_PATH or ~/ComfyUI): nothing to measure")
        return 1
    torch.set_num_threads(1)
    import comfy.model_management
    from omnitest.pack import pack_module, run_node
    from omnitest.quality import psnr_db
    from omnitest.tiny_models import build_case, sample

    sp_node = pack_module("nodes.sequence_parallel.node")
    group = pack_module("nodes.sequence_parallel.group")
    stats = pack_module("nodes.stats_store")
    heads = args.dim // 128
    case_name, overrides, latent_shape, tokens = MODELS[args.model](args)
    case = build_case(case_name, unet_overrides=overrides, latent_shape=latent_shape)
    if args.model == "ltx2":
        import comfy.nested_tensor

        case.latent = comfy.nested_tensor.NestedTensor([torch.zeros(1, 128, args.frames, args.size, args.size),
                                                        torch.zeros(1, 8, args.audio, 16)])
    if args.devices == "cuda":
        case.patcher.load_device = comfy.model_management.get_torch_device()
    def parallel(ranks: int, **inputs):
        settings = dict(world_size=ranks, ulysses_degree="auto", ring_degree="auto", devices="auto",
                        backend="auto", master_address="127.0.0.1", master_port=0, cfg_parallel=False)
        return run_node(sp_node.SequenceParallel, node_id="1", model=case.patcher, **{**settings, **inputs})[0]

    blocks: dict[int, dict[str, object]] = {}  # per world size: its runs, measured beside 1 rank
    for n in args.ranks:
        ulysses = n if heads % n == 0 else heads  # Ulysses as far as the heads allow, ring for the rest
        name = "Ulysses" if ulysses == n else f"Ulysses {ulysses} x ring {n // ulysses}"
        blocks[n] = {f"1 rank (beside {n})": case.patcher,
                     f"{n} ranks, {name}": parallel(n, ulysses_degree=str(ulysses), ring_degree=str(n // ulysses)),
                     f"{n} ranks, ring": parallel(n, ulysses_degree="1", ring_degree=str(n)),
                     f"{n} ranks, cfg parallel": parallel(n, cfg_parallel=True)}
    control = [0.0]  # seconds rank 0 spent in the group's commands (sending one, waiting for every worker's answer)
    untimed = {name: getattr(group.SequenceParallelGroup, name) for name in ("send_command", "await_answers")}

    def timed(method):
        def run(self, *a, **kw):
            start = time.perf_counter()
            try:
                return method(self, *a, **kw)
            finally:
                control[0] += time.perf_counter() - start
        return run

    for name, method in untimed.items():
        setattr(group.SequenceParallelGroup, name, timed(method))
    calls = [0]
    counter = case.patcher.model.diffusion_model.register_forward_pre_hook(
        lambda *_: calls.__setitem__(0, calls[0] + 1))
    times: dict[str, list[float]] = {name: [] for runs in blocks.values() for name in runs}
    sent: dict[str, float] = {}  # bytes rank 0 sent per step (the same every round)
    controls: dict[str, list[float]] = {name: [] for runs in blocks.values() for name in runs}
    latents: dict[str, torch.Tensor] = {}
    peaks: dict[str, int] = {}
    load_before = os.getloadavg()[0]
    try:
        calls[0] = 0
        reference = sample(case, model=case.patcher, steps=args.steps)
        calls_per_step = calls[0] / args.steps
        for runs in blocks.values():  # one world size at a time: changing it restarts the group
            for name, model in runs.items():  # warm-up: worker start, weights, allocator
                latents[name] = sample(case, model=model, steps=args.steps)
            for _ in range(args.repeats):
                for name, model in runs.items():
                    if args.devices == "cuda":
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                    control[0] = 0.0
                    start = time.perf_counter()
                    sample(case, model=model, steps=args.steps)
                    if args.devices == "cuda":
                        torch.cuda.synchronize()
                        peaks[name] = torch.cuda.max_memory_allocated()
                    times[name].append((time.perf_counter() - start) / args.steps)
                    controls[name].append(control[0] / args.steps)
                    cards = [f["summary"] for f in stats.recent_runs(1)[0]["features"]
                             if f["kind"] == "sequence_parallel"]
                    sent[name] = cards[0]["bytes_sent"] / args.steps if cards else 0.0
        in_use = []
        if args.devices == "cuda":
            for i in range(torch.cuda.device_count()):
                free, total = torch.cuda.mem_get_info(i)
                in_use.append((total - free) / 2**30)
    finally:
        for name, method in untimed.items():
            setattr(group.SequenceParallelGroup, name, method)
        counter.remove()
        group.close_group()
    load_after = os.getloadavg()[0]
    median = {name: statistics.median(t) for name, t in times.items()}
    device = (torch.cuda.get_device_name(0) if args.devices == "cuda"
              else "CPU, 1 thread per rank, gloo")
    described = {"wan": f"Wan 2.1 (ComfyUI's WanModel, random weights) dim {args.dim}, {heads} heads",
                 "ltx2": f"LTX-2 (ComfyUI's LTXAVModel, random weights) video dim {args.dim}, {heads} heads, audio "
                         f"dim {args.dim // 2}, {args.audio} audio tokens (whole on every rank)",
                 "kandinsky5": f"Kandinsky 5 (ComfyUI's Kandinsky5, random weights) dim {args.dim}, "
                               f"{args.dim // 128} heads"}[args.model]
    print(f"{described}, {args.layers} blocks, "
          f"{tokens} video tokens, batch 2 (cond + uncond), {args.steps} euler steps ({calls_per_step:g} model "
          f"call(s) per step), float32; {device}; median (best) of {args.repeats} interleaved rounds per world size; "
          f"1-minute load average {load_before:.1f} before, {load_after:.1f} after\n")
    header = ("| run | ms per step, median (best) | added per call vs 1 rank (ms) | of which control (ms) | speedup | "
              "sent per step, rank 0 (MB) | PSNR to 1 rank (dB) |")
    if peaks:
        header += " rank 0 peak (GiB) |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for runs in blocks.values():
        one = median[next(iter(runs))]
        for i, name in enumerate(runs):
            added = "-" if i == 0 else f"{(median[name] - one) * 1e3 / calls_per_step:.1f}"
            control_ms = "-" if i == 0 else f"{statistics.median(controls[name]) * 1e3 / calls_per_step:.1f}"
            quality = ("identical" if torch.equal(latents[name], reference)
                       else f"{psnr_db(latents[name], reference):.1f}")
            sent_mb = "-" if i == 0 else f"{sent[name] / 1e6:.2f}"
            row = (f"| {name} | {median[name] * 1e3:.1f} ({min(times[name]) * 1e3:.1f}) | {added} | {control_ms} | "
                   f"{one / median[name]:.2f}x | {sent_mb} | {quality} |")
            if peaks:
                row += f" {peaks[name] / 2**30:.2f} |"
            print(row)
    if in_use:
        print("\nGPU memory in use after the runs (device-wide, GiB): "
              + ", ".join(f"cuda:{i} {v:.2f}" for i, v in enumerate(in_use)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
