"""Train one of the cache quality benchmark's Wan models (``cache_quality_model.MODELS``) on its synthetic
class-conditional distribution, by flow matching as Wan is trained: x_s = (1 - s) x0 + s noise, the model predicts
noise - x0 at timestep 1000 s; s is drawn half from the sampler's shifted schedule (shift 8, ComfyUI's Wan 2.1 T2V
setting) and half uniformly. One CPU thread: a few minutes (small), about ten (wide, deep), fifteen (long). Writes the
model's ``weights`` file under ``benchmarks/data/`` (float16).

Run: COMFYUI_PATH=... .venv/bin/python benchmarks/train_cache_quality_model.py [--model small|wide|deep|long]
     [--steps 2000]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]
from omnitest.comfy_path import use_comfyui_in_process  # noqa: E402

if use_comfyui_in_process() is None:
    sys.exit("train_cache_quality_model: no ComfyUI checkout (set COMFYUI_PATH)")
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import cache_quality_model as cqm  # noqa: E402

SHIFT = 8.0


def draw_sigmas(n: int, g: torch.Generator) -> torch.Tensor:
    u = torch.rand(n, generator=g)
    shifted = SHIFT * u / (1 + (SHIFT - 1) * u)
    pick = torch.rand(n, generator=g) < 0.5
    return torch.where(pick, shifted, torch.rand(n, generator=g)).clamp(1e-3, 1.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(cqm.MODELS), default="small")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    opts = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = cqm.MODELS[opts.model]
    case = model.build(trained=False)
    dm = case.patcher.model.diffusion_model
    dm.train()
    for p in dm.parameters():
        p.requires_grad_(True)
    contexts = torch.cat([model.class_context(k) for k in range(cqm.CLASSES)] + [model.class_context(None)])
    optimizer = torch.optim.AdamW(dm.parameters(), lr=opts.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=opts.lr, total_steps=opts.steps, pct_start=0.05)
    g = torch.Generator().manual_seed(0)
    start, running = time.time(), None
    for step in range(opts.steps):
        labels = torch.randint(0, cqm.CLASSES, (opts.batch,), generator=g)
        x0 = model.sample_data(labels, g)
        noise = torch.randn(x0.shape, generator=g)
        s = draw_sigmas(opts.batch, g)
        xs = (1 - s)[:, None, None, None, None] * x0 + s[:, None, None, None, None] * noise
        drop = torch.rand(opts.batch, generator=g) < cqm.DROPOUT
        context = contexts[torch.where(drop, torch.full_like(labels, cqm.CLASSES), labels)]
        pred = dm(xs, s * 1000, context)
        loss = torch.mean((pred - (noise - x0)) ** 2)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(dm.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if step % 100 == 0 or step == opts.steps - 1:
            print(f"step {step:5d}  loss {running:.4f}  {time.time() - start:.0f} s", flush=True)
    model.weights.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in dm.state_dict().items()}
    save_file(state, str(model.weights))
    print(f"wrote {model.weights} ({model.weights.stat().st_size / 1e6:.2f} MB, "
          f"{sum(v.numel() for v in state.values())} parameters)")


if __name__ == "__main__":
    main()
