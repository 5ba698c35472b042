"""Block-level CPU offload side by side with full residency and per-block streaming, in one run.

A DiT-shaped stack (pre-norm attention + 4x MLP blocks, no affine norms, so a block's weights are its four Linears:
12 * dim^2 parameters) between a resident input and output projection. Rows:
  * fully resident: every weight on the device;
  * naive per-block streaming: before each block its weights are copied from pageable CPU memory, synchronously,
    and dropped after it (a stand-in for ComfyUI's --lowvram streaming when ComfyUI is not importable);
  * ComfyUI lowvram (0.3.64 cast path), if ComfyUI is importable and the device is CUDA: the same blocks built from
    ``comfy.ops.disable_weight_init`` layers with ``comfy_cast_weights`` set and weights on the CPU, i.e. what
    ``ModelPatcher.load`` leaves for layers that do not fit: ``cast_bias_weight`` copies each layer's weights just in
    time; once with one stream (the default) and once with ``--async-offload``'s two offload streams;
  * omni_hooks offload at prefetch 0, 1 and 2 (``apply_layerwise_offload``).
Every row's output is compared with the resident row's (max abs difference).

On CUDA it reports peak allocated memory, the weights held between steps, and the median time per step (CUDA
events), plus one block's pinned host-to-device copy time next to its compute time (offload hides copies only when
compute is longer). On the CPU (no streams) it reports residency and copy counts only.

Run: .venv/bin/python benchmarks/bench_offload.py [--device cuda] [--dim 3072 --heads 24 --tokens 32768 --blocks 12]
Without --device it uses CUDA when available, else the CPU with a small default shape.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from omni_hooks.offload import apply_layerwise_offload  # noqa: E402

MIB = 1024 ** 2
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CUDA_SHAPE = {"dim": 3072, "heads": 24, "tokens": 32768, "blocks": 12, "dtype": "bf16"}  # Wan-14B-like 480p tokens
CPU_SHAPE = {"dim": 256, "heads": 4, "tokens": 256, "blocks": 8, "dtype": "fp32"}


class BenchBlock(torch.nn.Module):
    def __init__(self, dim: int, heads: int, ops: Any, dtype: torch.dtype):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(dim, elementwise_affine=False)
        self.qkv = ops.Linear(dim, 3 * dim, dtype=dtype)
        self.out = ops.Linear(dim, dim, dtype=dtype)
        self.norm2 = torch.nn.LayerNorm(dim, elementwise_affine=False)
        self.ff1 = ops.Linear(dim, 4 * dim, dtype=dtype)
        self.ff2 = ops.Linear(4 * dim, dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        x = x + self.out(attended)
        return x + self.ff2(F.gelu(self.ff1(self.norm2(x)), approximate="tanh"))


class BenchModel(torch.nn.Module):
    def __init__(self, dim: int, heads: int, blocks: int, dtype: torch.dtype, ops: Any = torch.nn):
        super().__init__()
        self.embed = torch.nn.Linear(dim, dim, dtype=dtype)
        self.blocks = torch.nn.ModuleList(BenchBlock(dim, heads, ops, dtype) for _ in range(blocks))
        self.head = torch.nn.Linear(dim, dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def nbytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def fill_weights(model: BenchModel, device: torch.device) -> None:
    """Deterministic weights (std 0.02, small enough that 'blocks' stay numerically tame), drawn on ``device``."""
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, device=device).mul_(0.02))


class Clock:
    """Times steps: CUDA events on CUDA (no host sync inside a step), perf_counter elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def run(self, step: Callable[[], torch.Tensor], count: int) -> tuple[list[float], torch.Tensor | None]:
        times, out = [], None
        for _ in range(count):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = step()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1000.0)
            else:
                start = time.perf_counter()
                out = step()
                times.append(time.perf_counter() - start)
        return times, out


class Resident:
    """Every weight on the device."""

    label = "fully resident"

    def __init__(self, model: BenchModel, device: torch.device):
        self.runner, self.device = model, device

    def place(self) -> None:
        self.runner.blocks.to(self.device)

    def counts(self) -> dict | None:
        return None

    def remove(self) -> None:
        self.runner.blocks.to("cpu")


class NaiveStreaming:
    """Before each block its weights are copied from their pageable CPU tensors to the device, synchronously; after
    it they point back at the CPU tensors and the device copies are dropped. Counts copies like the offload stats."""

    label = "naive per-block streaming (pageable, synchronous)"

    def __init__(self, model: BenchModel, device: torch.device):
        self.runner, self.device = model, device
        self.copies = self.bytes_moved = 0
        self._hooks: list = []
        self._cpu: dict[int, list[torch.Tensor]] = {}

    def _before(self, block: torch.nn.Module, args: tuple) -> None:
        kept = self._cpu[id(block)] = []
        for p in block.parameters():
            kept.append(p.data)
            p.data = p.data.to(self.device, copy=True)  # copy=True: a real copy on the CPU too
            self.bytes_moved += p.numel() * p.element_size()
        self.copies += 1

    def _after(self, block: torch.nn.Module, args: tuple, output: Any) -> None:
        for p, cpu in zip(block.parameters(), self._cpu.pop(id(block))):
            p.data = cpu

    def place(self) -> None:
        for block in self.runner.blocks:
            self._hooks += [block.register_forward_pre_hook(self._before), block.register_forward_hook(self._after)]

    def counts(self) -> dict | None:
        return {"copies": self.copies, "bytes_moved": self.bytes_moved, "sync_loads": self.copies,
                "peak_resident_blocks": 1}

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


class ComfyLowvram:
    """ComfyUI 0.3.64's lowvram path for layers that did not fit: the same blocks from ``comfy.ops`` layers with
    ``comfy_cast_weights`` on and weights on the CPU, so ``cast_bias_weight`` copies each layer's weights just in
    time. ``streams`` = 2 is what ``--async-offload`` sets (0.3.64 reads ``NUM_STREAMS`` at every call)."""

    def __init__(self, model: BenchModel, streams: int):
        self.runner, self.streams = model, streams
        self.label = "ComfyUI 0.3.64 lowvram cast path" + (", --async-offload" if streams > 1 else "")

    def place(self) -> None:
        import comfy.model_management

        comfy.model_management.NUM_STREAMS = self.streams

    def counts(self) -> dict | None:
        return None

    def remove(self) -> None:
        import comfy.model_management

        comfy.model_management.NUM_STREAMS = 1


class OmniOffload:
    def __init__(self, model: BenchModel, device: torch.device, prefetch: int):
        self.runner, self.device, self.prefetch = model, device, prefetch
        self.label = f"omni_hooks offload, prefetch {prefetch}"
        self.handle = None

    def place(self) -> None:
        self.handle = apply_layerwise_offload(self.runner.blocks, self.device, prefetch_blocks=self.prefetch)

    def counts(self) -> dict | None:
        return self.handle.collect_stats(wait=True).summary()

    def remove(self) -> None:
        self.handle.remove()


def comfy_lowvram_model(reference: BenchModel, opts: argparse.Namespace, device: torch.device) -> BenchModel | None:
    """``reference`` rebuilt from ComfyUI's cast-capable layers (blocks on the CPU, cast on), or None when ComfyUI
    is not importable."""
    from omnitest.comfy_path import use_comfyui_in_process

    if use_comfyui_in_process(cpu=False) is None:
        return None
    import comfy.ops

    model = BenchModel(opts.dim, opts.heads, opts.blocks, DTYPES[opts.dtype], ops=comfy.ops.disable_weight_init)
    model.load_state_dict(reference.state_dict())
    model.embed.to(device)
    model.head.to(device)
    for module in model.blocks.modules():
        if isinstance(module, comfy.ops.CastWeightBiasOp):
            module.comfy_cast_weights = True
    return model


def pinned_copy_seconds(block_bytes: int, device: torch.device) -> float:
    """Median time of one block-sized host-to-device copy from pinned memory."""
    source = torch.empty(block_bytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(block_bytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000.0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    for key in ("dim", "heads", "tokens", "blocks"):
        parser.add_argument(f"--{key}", type=int, default=None)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per row (median reported)")
    parser.add_argument("--warmup", type=int, default=2)
    opts = parser.parse_args()
    device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    defaults = CUDA_SHAPE if device.type == "cuda" else CPU_SHAPE
    for key, value in defaults.items():
        if getattr(opts, key) is None:
            setattr(opts, key, value)
    dtype = DTYPES[opts.dtype]
    cuda = device.type == "cuda"

    model = BenchModel(opts.dim, opts.heads, opts.blocks, dtype)
    fill_weights(model, torch.device("cpu"))
    model.embed.to(device)
    model.head.to(device)
    block_bytes = nbytes(model.blocks[0])
    resident_bytes = nbytes(model.embed) + nbytes(model.head)
    x = torch.randn(1, opts.tokens, opts.dim, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    # ComfyUI's cast path copies nothing when the weights are already on the compute device, so only on CUDA
    comfy_model = comfy_lowvram_model(model, opts, device) if cuda else None

    rows = [Resident(model, device), NaiveStreaming(model, device)]
    if comfy_model is not None:
        rows += [ComfyLowvram(comfy_model, 1), ComfyLowvram(comfy_model, 2)]
    rows += [OmniOffload(model, device, prefetch) for prefetch in (0, 1, 2)]

    def step(runner: BenchModel) -> torch.Tensor:
        with torch.inference_mode():
            return runner(x)

    clock = Clock(device)
    results = []
    floor = 0
    if cuda:  # what the device holds besides weights and input: cuBLAS workspaces, allocated on first use
        with torch.inference_mode():
            model.embed(x)
        torch.cuda.synchronize()
        floor = torch.cuda.memory_allocated() - resident_bytes - x.numel() * x.element_size()
    for row in rows:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        row.place()
        try:
            clock.run(lambda: step(row.runner), opts.warmup)
            before = row.counts()
            if cuda:
                torch.cuda.synchronize()
                between = torch.cuda.memory_allocated() - x.numel() * x.element_size() - floor
                torch.cuda.reset_peak_memory_stats()
            times, out = clock.run(lambda: step(row.runner), opts.steps)
            result = {"label": row.label, "seconds": statistics.median(times), "out": out.float().cpu()}
            if cuda:
                result.update(peak=torch.cuda.max_memory_allocated(), between=between)
            after = row.counts()
            if after is not None:
                result.update({key: (after[key] - before[key]) / opts.steps
                               for key in ("copies", "bytes_moved", "sync_loads")})
                result.update({key: after[key] for key in ("slots", "peak_resident_blocks") if key in after})
            results.append(result)
        finally:
            row.remove()

    base = results[0]
    print(f"Device {torch.cuda.get_device_name(device) if cuda else 'CPU'}, torch {torch.__version__}; model: "
          f"{opts.blocks} blocks, dim {opts.dim}, {opts.heads} heads, {opts.tokens} tokens, {opts.dtype}; one block "
          f"{block_bytes / MIB:.1f} MiB of weights, non-block modules {resident_bytes / MIB:.1f} MiB; "
          f"{opts.steps} steps after {opts.warmup} warm-up" + (", median time" if cuda else "") + "\n")
    if cuda:
        copy_s = pinned_copy_seconds(block_bytes, device)
        compute_s = base["seconds"] / opts.blocks
        print(f"One block: pinned host-to-device copy {copy_s * 1e3:.2f} ms, compute (resident step / blocks) "
              f"{compute_s * 1e3:.2f} ms: compute is {compute_s / copy_s:.2f}x the copy\n")
        activations = base["peak"] - base["between"]
        print("| configuration | time per step (ms) | vs resident | peak allocated (MiB) | weights between steps "
              "(MiB) | peak minus activations (MiB) | block copies per step | sync loads per step | max abs diff |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in results:
            print(f"| {r['label']} | {r['seconds'] * 1e3:.1f} | {(r['seconds'] / base['seconds'] - 1) * 100:+.1f}% | "
                  f"{r['peak'] / MIB:.0f} | {r['between'] / MIB:.0f} | {(r['peak'] - activations) / MIB:.0f} | "
                  f"{r.get('copies', 0):.1f} | {r.get('sync_loads', 0):.1f} | "
                  f"{(r['out'] - base['out']).abs().max().item():.3g} |")
        print("\nTargets: weights on the device at most non-block + (1 + prefetch) blocks; at most 10% "
              "slower than fully resident when block compute exceeds its copy time.")
        for r in results:
            if "slots" in r:
                bound = resident_bytes + r["slots"] * block_bytes
                print(f"- {r['label']}: weights between steps {r['between'] / MIB:.0f} MiB vs bound "
                      f"{bound / MIB:.0f} MiB; time {(r['seconds'] / base['seconds'] - 1) * 100:+.1f}% vs resident")
    else:
        # no times: on the CPU every copy is synchronous and the computation is the CPU's too, so they say nothing
        # about a GPU
        print("| configuration | device slots | blocks resident at peak | block copies per step | MiB moved per step | "
              "sync loads per step | max abs diff |")
        print("|---|---|---|---|---|---|---|")
        for r in results:
            slots = r.get("slots", "all" if r is base else "-")
            peak_blocks = r.get("peak_resident_blocks", opts.blocks if r is base else "-")
            print(f"| {r['label']} | {slots} | {peak_blocks} | {r.get('copies', 0):.1f} | "
                  f"{r.get('bytes_moved', 0) / MIB:.2f} | {r.get('sync_loads', 0):.1f} | "
                  f"{(r['out'] - base['out']).abs().max().item():.3g} |")


if __name__ == "__main__":
    main()
