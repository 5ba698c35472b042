"""The cache quality plot: latent PSNR against model evaluations, one curve per configuration (Pillow, which every
ComfyUI installation has; no plotting library needed)."""
from __future__ import annotations

import math
from pathlib import Path

from PIL import Image, ImageDraw

WIDTH, HEIGHT = 900, 560
LEFT, RIGHT, TOP, BOTTOM = 70, 300, 40, 60
Y_MIN, Y_MAX = 15.0, 75.0
COLOURS = {
    "TeaCache, forecast off": (147, 197, 253), "TeaCache, forecast 1st order": (59, 130, 246),
    "TeaCache, forecast 2nd order": (30, 58, 138),
    "TeaCache, forecast auto": (22, 163, 74),
    "forecast off": (253, 186, 116), "forecast 1st order": (249, 115, 22), "forecast 2nd order": (154, 52, 18),
    "forecast auto": (190, 24, 93),
    "EasyCache": (113, 113, 122),
    "budget, forecast off": (196, 181, 253), "budget, forecast 1st order": (139, 92, 246),
    "budget, forecast 2nd order": (76, 29, 149), "budget, forecast auto": (17, 24, 39),
    "+ budget": (13, 148, 136),
}


def colour_of(name: str) -> tuple[int, int, int]:
    if name in COLOURS:
        return COLOURS[name]
    if "+ budget" in name:
        return COLOURS["+ budget"] if name.startswith("TeaCache") else (161, 98, 7)
    for key, colour in COLOURS.items():
        if key in name and not name.startswith("TeaCache"):
            return colour
    return (0, 0, 0)


def axes(steps: int, x_label: str, y_label: str, title: str, title_x: int):
    """A white canvas with the plot's grid, ticks and labels: ``(image, draw, px)``, ``px(evals, db)`` the pixel of a
    point (the PSNR clipped to the plot's range)."""
    img = Image.new("RGB", (WIDTH, HEIGHT), "white")
    d = ImageDraw.Draw(img)
    x0, x1, y0, y1 = LEFT, WIDTH - RIGHT, HEIGHT - BOTTOM, TOP

    def px(evals: float, db: float) -> tuple[float, float]:
        db = min(max(db, Y_MIN), Y_MAX)
        return x0 + (x1 - x0) * evals / steps, y0 - (y0 - y1) * (db - Y_MIN) / (Y_MAX - Y_MIN)

    for e in range(0, steps + 1, 5 if steps > 10 else 1):
        x, _ = px(e, Y_MIN)
        d.line([(x, y0), (x, y1)], fill=(235, 235, 235))
        d.text((x - 6, y0 + 6), str(e), fill="black")
    for db in range(int(Y_MIN), int(Y_MAX) + 1, 10):
        _, y = px(0, db)
        d.line([(x0, y), (x1, y)], fill=(235, 235, 235))
        d.text((x0 - 30, y - 6), str(db), fill="black")
    d.rectangle([x0, y1, x1, y0], outline="black")
    d.text(((x0 + x1) / 2 - 3 * len(x_label), y0 + 28), x_label, fill="black")
    d.text((8, y1 - 25), y_label, fill="black")
    if title:
        d.text((x0 + title_x, y1 - 25), title, fill="black")
    return img, d, px


def plot_curves(results: list[dict], path: Path, steps: int, targets=((12, 45.0), (8, 40.0)), title: str = "") -> None:
    """``results``: dicts with configuration, evaluations, psnr_mean; written as a PNG at ``path``."""
    img, d, px = axes(steps, f"model evaluations (of {steps} steps)",
                      "final latent PSNR vs uncached (dB, mean of 4 prompts)", title, 250)
    x1 = WIDTH - RIGHT
    for evals, db in targets:
        x, y = px(evals, db)
        d.line([(x - 6, y), (x + 6, y)], fill=(220, 38, 38), width=2)
        d.line([(x, y - 6), (x, y + 6)], fill=(220, 38, 38), width=2)
        d.text((x + 6, y - 14), f"target {db:g} dB @ {evals}", fill=(220, 38, 38))
    names = list(dict.fromkeys(r["configuration"] for r in results))
    for i, name in enumerate(names):
        colour = colour_of(name)
        points = sorted((r["evaluations"], r["psnr_mean"]) for r in results if r["configuration"] == name)
        points = [px(e, db if math.isfinite(db) else Y_MAX) for e, db in points]
        width = 1 if "forecast off" in name or "EasyCache" in name else 2
        if len(points) > 1:
            d.line(points, fill=colour, width=width)
        for x, y in points:
            d.ellipse([x - 3, y - 3, x + 3, y + 3], fill=colour)
        ly = TOP + 10 + 22 * i
        d.line([(x1 + 15, ly + 6), (x1 + 45, ly + 6)], fill=colour, width=3)
        d.text((x1 + 52, ly), name, fill="black")
    img.save(path, optimize=True)


FRONTIER_COLOURS = [(22, 163, 74), (37, 99, 235), (234, 88, 12), (147, 51, 234), (113, 113, 122)]


def frontier(rows: list[dict], steps: int) -> list[tuple[int, float, float]]:
    """Per number of forwards b (1..steps): the best mean PSNR of the rows that computed at most b on average, with
    that row's worst prompt (finite PSNRs only); budgets without a row are left out."""
    points = []
    for b in range(1, steps + 1):
        fits = [r for r in rows if r["evaluations"] <= b + 1e-9 and r["psnr_mean"] is not None]
        if fits:
            top = max(fits, key=lambda r: r["psnr_mean"])
            points.append((b, top["psnr_mean"], top["psnr_min"] if top["psnr_min"] is not None else top["psnr_mean"]))
    return points


def plot_frontiers(groups: dict[str, list[dict]], path: Path, steps: int, title: str = "") -> None:
    """One frontier per group (``frontier``): its best mean PSNR per number of forwards as a solid staircase and the
    worst prompt of the same points dashed; written as a PNG at ``path``."""
    img, d, px = axes(steps, f"at most this many forwards (model evaluations, of {steps})",
                      "best final latent PSNR vs uncached (dB): mean solid, its worst prompt dashed", title, 380)
    x1 = WIDTH - RIGHT
    for i, (name, rows) in enumerate(groups.items()):
        colour = FRONTIER_COLOURS[i % len(FRONTIER_COLOURS)]
        points = frontier(rows, steps)
        mean = [p for b, m, _ in points for p in (px(b, m), px(min(b + 1, steps), m))]
        worst = [p for b, _, w in points for p in (px(b, w), px(min(b + 1, steps), w))]
        if len(mean) > 1:
            d.line(mean, fill=colour, width=3 if i == 0 else 2)
            for (xa, ya), (xb, yb) in zip(worst[::2], worst[1::2]):
                for t in range(0, 10, 2):
                    d.line([(xa + (xb - xa) * t / 10, ya), (xa + (xb - xa) * (t + 1) / 10, yb)], fill=colour)
        ly = TOP + 10 + 22 * i
        d.line([(x1 + 15, ly + 6), (x1 + 45, ly + 6)], fill=colour, width=3)
        d.text((x1 + 52, ly), name, fill="black")
    img.save(path, optimize=True)
