"""Sequence parallelism: what each exchange sends at Wan 14B and LTX-2 19B size, and a CPU run of the toy DiT at 1 vs 2
ranks.

1. Communication volume per rank and model evaluation for Ulysses, ring and the hybrid on a Wan 2.1 14B-sized
   sequence (720p, 81 frames: 75600 tokens, 40 heads of 128, bf16, 40 blocks, batch 1). The numbers are the
   implementation's own accounting (``CommStats``): the real split/gather hooks and attention entry run on "meta"
   tensors over a simulated mesh, whose collectives count the bytes they would send and move nothing. The rank tests
   check that a simulated mesh counts exactly what a real gloo exchange sends. One attention call per block: Wan's
   cross-attention reads the replicated text and sends nothing. The same for LTX-2 19B (720p, 121 frames: 14080 video
   tokens, 32 heads of 128; 121 audio tokens, 32 heads of 64; 48 blocks): per block the video's self-attention and
   the audio's attention to the video (its keys split with the video, its queries whole), whose exchange is the one
   the audio adds.
2. The toy DiT of the tests (tests/omnitest/toy_dit.py, scaled up) on CPU: one process vs two gloo processes
   (Ulysses 2, ring 2), one thread each, interleaved rounds, best of ``--repeats``.

Run: .venv/bin/python benchmarks/bench_sequence_parallel.py      (prints markdown for docs/benchmarks.md)
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

from omni_hooks.sequence_parallel import (  # noqa: E402
    SequenceParallelConfig,
    SequenceParallelCrossAttention,
    SequenceParallelInput,
    SequenceParallelMesh,
    SequenceParallelOutput,
    SequenceParallelSelfAttention,
    apply_sequence_parallel,
    remove_sequence_parallel,
    sdpa_attention,
)

WAN = {"tokens": 75600, "heads": 40, "head_dim": 128, "blocks": 40, "out_channels": 64}  # 64 = 16 x patch 1x2x2
LAYOUTS = [(2, 1), (1, 2), (4, 1), (1, 4), (2, 2), (8, 1), (1, 8), (4, 2), (2, 4)]
GB = 1e9


class SelfAttentionStandIn(torch.nn.Module):
    """The communicating part of a Wan block: its self-attention call with q, k, v of ``[B, L, H·D]``."""

    def forward(self, x, heads, options):
        return options["attention_override"](sdpa_attention, x, x, x, heads)


class WanShaped(torch.nn.Module):
    def __init__(self, blocks: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Module() for _ in range(blocks))
        for block in self.blocks:
            block.self_attn = SelfAttentionStandIn()
        self.head = torch.nn.Identity()

    def forward(self, x, options):
        for block in self.blocks:
            x = block.self_attn(x, WAN["heads"], options)
        return self.head(x[..., :WAN["out_channels"]])


WAN_PLAN = {"": {"x": SequenceParallelInput(split_dim=1, expected_dims=3)},
            "blocks.*.self_attn": SequenceParallelSelfAttention(),
            "head": SequenceParallelOutput(gather_dim=1, expected_dims=3)}


def wan_volume_table() -> None:
    width = WAN["heads"] * WAN["head_dim"]
    print(f"Wan 2.1 14B-sized self-attention: {WAN['tokens']} tokens, {WAN['heads']} heads x {WAN['head_dim']}, "
          f"bf16, {WAN['blocks']} blocks, batch 1; bytes sent by one rank per model evaluation (CFG batched as "
          f"batch 2 doubles every figure)\n")
    print("| ranks | layout (U x R) | all-to-all per block (MB) | ring hops per block (MB) | output gather (MB) | "
          "cache agreement (B) | per evaluation, all blocks (GB) |")
    print("|---|---|---|---|---|---|---|")
    for u, r in LAYOUTS:
        config = SequenceParallelConfig(ulysses_degree=u, ring_degree=r)
        model = WanShaped(WAN["blocks"])
        sp = apply_sequence_parallel(model, config, WAN_PLAN, mesh=SequenceParallelMesh.simulated_for(config, 0))
        x = torch.empty(1, WAN["tokens"], width, dtype=torch.bfloat16, device="meta")
        out = model(x, {"attention_override": sp.attention})
        assert out.shape == (1, WAN["tokens"], WAN["out_channels"])
        sp.agreement.mean(torch.zeros(2))  # what TeaCache adds per evaluation with two branches
        sp.agreement.any(True)
        remove_sequence_parallel(model, WAN_PLAN)
        stats = sp.stats.by_kind

        def sent(kind: str) -> int:
            return stats[kind].bytes_sent if kind in stats else 0

        label = "Ulysses" if r == 1 else "ring" if u == 1 else "hybrid"
        print(f"| {u * r} | {label} {u} x {r} | {sent('ulysses_all_to_all') / WAN['blocks'] / 1e6:.1f} | "
              f"{sent('ring_hop') / WAN['blocks'] / 1e6:.1f} | {sent('output_all_gather') / 1e6:.1f} | "
              f"{sent('cache_agreement')} | {sp.stats.bytes_sent / GB:.2f} |")


LTX2 = {"video": 14080, "audio": 121, "heads": 32, "video_head": 128, "audio_head": 64, "blocks": 48}


class CrossAttentionStandIn(torch.nn.Module):
    """LTX-2's video-to-audio attention: the audio's queries ``[B, La, H·Da]`` over keys/values of the video's tokens
    projected to the audio's width."""

    def forward(self, q, kv, heads, options):
        return options["attention_override"](sdpa_attention, q, kv, kv, heads)


class LTX2Shaped(torch.nn.Module):
    def __init__(self, blocks: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Module() for _ in range(blocks))
        for block in self.blocks:
            block.attn1 = SelfAttentionStandIn()
            block.video_to_audio_attn = CrossAttentionStandIn()
        self.norm_out = torch.nn.Identity()

    def forward(self, vx, ax, options):
        audio_width = LTX2["heads"] * LTX2["audio_head"]
        for block in self.blocks:
            vx = block.attn1(vx, LTX2["heads"], options)
            ax = block.video_to_audio_attn(ax, vx[..., :audio_width], LTX2["heads"], options)
        return self.norm_out(vx)


LTX2_PLAN = {"": {"vx": SequenceParallelInput(split_dim=1, expected_dims=3, auto_pad=True)},
             "blocks.*.attn1": SequenceParallelSelfAttention(),
             "blocks.*.video_to_audio_attn": SequenceParallelCrossAttention(),
             "norm_out": SequenceParallelOutput(gather_dim=1, expected_dims=3)}


def ltx2_volume_table() -> None:
    video_width, audio_width = LTX2["heads"] * LTX2["video_head"], LTX2["heads"] * LTX2["audio_head"]
    print(f"\nLTX-2 19B-sized: {LTX2['video']} video tokens ({LTX2['heads']} heads x {LTX2['video_head']}, split), "
          f"{LTX2['audio']} audio tokens ({LTX2['heads']} heads x {LTX2['audio_head']}, whole on every rank), bf16, "
          f"{LTX2['blocks']} blocks, batch 1; bytes sent by one rank per model evaluation\n")
    print("| ranks | layout (U x R) | video self-attention per block (MB) | "
          "the audio's attention to the video per block (MB) | output gather (MB) | per evaluation, all blocks (GB) | "
          "of which the audio's |")
    print("|---|---|---|---|---|---|---|")
    for u, r in LAYOUTS[:5]:
        config = SequenceParallelConfig(ulysses_degree=u, ring_degree=r)
        model = LTX2Shaped(LTX2["blocks"])
        sp = apply_sequence_parallel(model, config, LTX2_PLAN, mesh=SequenceParallelMesh.simulated_for(config, 0))
        vx = torch.empty(1, LTX2["video"], video_width, dtype=torch.bfloat16, device="meta")
        ax = torch.empty(1, LTX2["audio"], audio_width, dtype=torch.bfloat16, device="meta")
        cross = []

        def count_cross(module, args, output):  # the bytes of each audio-to-video call
            cross.append(sp.stats.bytes_sent - cross_start[0])

        cross_start = [0]
        handles = [block.video_to_audio_attn.register_forward_pre_hook(
            lambda *_: cross_start.__setitem__(0, sp.stats.bytes_sent)) for block in model.blocks]
        handles += [block.video_to_audio_attn.register_forward_hook(count_cross) for block in model.blocks]
        assert model(vx, ax, {"attention_override": sp.attention}).shape == vx.shape
        for handle in handles:
            handle.remove()
        remove_sequence_parallel(model, LTX2_PLAN)
        gather = sp.stats.by_kind["output_all_gather"].bytes_sent
        total = sp.stats.bytes_sent
        label = "Ulysses" if r == 1 else "ring" if u == 1 else "hybrid"
        print(f"| {u * r} | {label} {u} x {r} | {(total - sum(cross) - gather) / LTX2['blocks'] / 1e6:.1f} | "
              f"{sum(cross) / LTX2['blocks'] / 1e6:.2f} | {gather / 1e6:.1f} | {total / GB:.2f} | "
              f"{100 * sum(cross) / total:.1f}% |")


# -- the toy DiT on CPU ----------------------------------------------------------------------------------------------

TOY = {"dim": 128, "heads": 8, "depth": 4}
TOY_INPUT = {"batch": 1, "image_tokens": 2048, "text_tokens": 32}


def rank_time_toy(mode: str, repeats: int):
    """Best forward time of the toy in this rank for ``mode`` ("one process": rank 0 alone; "ulysses"/"ring": all
    ranks); also the max abs difference to the one-process output and the bytes sent per forward."""
    import torch.distributed as dist

    from omnitest.toy_dit import ToyDiT, sp_plan, toy_inputs

    if mode == "one process" and dist.get_rank() != 0:
        return None
    model = ToyDiT(in_channels=4, dim=TOY["dim"], heads=TOY["heads"], depth=TOY["depth"])
    inputs = toy_inputs(batch=TOY_INPUT["batch"], image_tokens=TOY_INPUT["image_tokens"],
                        text_tokens=TOY_INPUT["text_tokens"])
    with torch.no_grad():
        reference = model(**inputs)
        options, sp, plan = {}, None, sp_plan(depth=TOY["depth"])
        if mode != "one process":
            world = dist.get_world_size()
            config = SequenceParallelConfig(ulysses_degree=world if mode == "ulysses" else 1,
                                            ring_degree=world if mode == "ring" else 1)
            sp = apply_sequence_parallel(model, config, plan)
            options = {"attention_override": sp.attention}
        out = model(**inputs, transformer_options=options)  # warm-up
        best = float("inf")
        for _ in range(repeats):
            if sp is not None:
                dist.barrier()
            start = time.perf_counter()
            out = model(**inputs, transformer_options=options)
            best = min(best, time.perf_counter() - start)
        error = (out - reference).abs().max().item()
        per_forward = sp.stats.bytes_sent / (repeats + 1) if sp is not None else 0
        if sp is not None:
            remove_sequence_parallel(model, plan)
    return best, error, per_forward


def toy_table(rounds: int, repeats: int) -> None:
    from omnitest.rank_pool import RankPool

    modes = ["one process", "ulysses", "ring"]
    best = {m: (float("inf"), 0.0, 0) for m in modes}
    load_before = os.getloadavg()[0]
    pool = RankPool(2)
    try:
        for _ in range(rounds):
            for mode in modes:
                results = [r for r in pool.run(rank_time_toy, mode, repeats, timeout=600) if r is not None]
                seconds = max(r[0] for r in results)  # a parallel forward ends when its slowest rank does
                if seconds < best[mode][0]:
                    best[mode] = (seconds, max(r[1] for r in results), results[0][2])
    finally:
        pool.close()
    base = best["one process"][0]
    print(f"\nToy DiT (dim {TOY['dim']}, {TOY['heads']} heads, {TOY['depth']} blocks: joint text+image and "
          f"self+cross attention), batch {TOY_INPUT['batch']}, {TOY_INPUT['image_tokens']} image + "
          f"{TOY_INPUT['text_tokens']} text tokens, float32, CPU, 1 thread per process, gloo on loopback; best of "
          f"{rounds} interleaved rounds x {repeats} forwards; {os.cpu_count()} CPU cores, 1-minute load average "
          f"{load_before:.1f} before and {os.getloadavg()[0]:.1f} after\n")
    print("| run | forward (ms) | speedup | max abs difference to 1 process | bytes sent per rank per forward |")
    print("|---|---|---|---|---|")
    for mode in modes:
        seconds, error, sent = best[mode]
        label = "1 process" if mode == "one process" else f"2 processes, {mode}"
        print(f"| {label} | {seconds * 1e3:.1f} | {base / seconds:.2f}x | {error:.2g} | {sent / 1e6:.2f} MB |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--volume-only", action="store_true")
    opts = parser.parse_args()
    wan_volume_table()
    ltx2_volume_table()
    if not opts.volume_only:
        toy_table(opts.rounds, opts.repeats)


if __name__ == "__main__":
    main()
