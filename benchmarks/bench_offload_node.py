"""The CPU Offload node inside ComfyUI on one CUDA GPU, side by side with full residency and ComfyUI's own ways of
running a model bigger than the VRAM, at one or more VRAM caps: seconds per step, VRAM, the run's start and end, the
node's own numbers, the final latent.

The model is Wan 2.1 T2V-shaped (``--shape 1.3b``: dim 1536, ffn 8960, 30 blocks; ``--shape 14b``: dim 5120, ffn
13824, 40 blocks) with random bf16 weights (matrices N(0, 1/fan_in), so activations keep their scale at any width).
They are drawn on the device and loaded through ``comfy.sd.load_diffusion_model_state_dict``, or, with
``--weights-file``, read from a safetensors file through ``comfy.sd.load_diffusion_model`` as ComfyUI's Load Diffusion
Model node reads a checkpoint (the file is written once, from weights drawn on the device, when it does not exist).
Every row samples with ComfyUI's KSampler path (``comfy.sample.sample``, euler, simple) from the same latent, noise
(seed 0) and random text conditioning (512 tokens x 4096, Wan's text width).

ComfyUI's loading mode ("host mode") is per process:
  * legacy: ComfyUI's estimate-based ``ModelPatcher`` (ComfyUI 0.3.x; 0.33 with ``--disable-dynamic-vram``);
  * dynamic: ComfyUI 0.33's dynamic VRAM (``ModelPatcherDynamic``), comfy-aimdo initialised as ComfyUI's ``main.py``
    does, which streams each layer's weights itself.
``--host-mode both`` (the default on CUDA with a ComfyUI that has dynamic VRAM) runs one process per mode, one after
the other, and prints their rows in one table. Rows, per cap of ``--caps``:
  legacy: fully resident; ComfyUI's partial load at the cap; CPU Offload auto (prefetch 1) at the cap; Apply TeaCache
  alone (no cap); CPU Offload auto at the cap + Apply TeaCache (compared with TeaCache alone); with ``--extra-rows``
  also the partial load with ``--async-offload`` at the first cap and CPU Offload of every block, prefetch 1 and 2;
  dynamic: fully resident; ComfyUI's dynamic VRAM at the cap; Apply TeaCache alone; CPU Offload auto + Apply TeaCache
  at the first cap (the node stands aside there; compared with TeaCache alone); with ``--takeover-trial`` (and
  ``--weights-file``), per cap, CPU Offload auto on the model's non-dynamic delegate (``get_non_dynamic_delegate``: the
  model loaded again from its file with dynamic VRAM off, for that model only), the node's stand-aside rule lifted for
  the row: what the node would do if it took a model over from dynamic VRAM.
``--rows 1,4`` runs only those rows of a mode (numbered as in its full list), with the rows they are compared with.
On CUDA each process first samples the fully resident model once, untimed (a warm-up): on an H200 under ComfyUI 0.33
the first sampling call of a process ended 0.0162 (max abs) away from every later one, whatever the loading.
A cap is made real with a ballast (``--cap-mode ballast``, the default on CUDA): before the row a tensor takes all free
VRAM but the cap, so ComfyUI's loader, its dynamic VRAM and the node all see a card of that size; ``--cap-mode
reserve`` sets ``--reserve-vram`` instead (``EXTRA_RESERVED_VRAM`` = free VRAM less the cap), which only ComfyUI's
estimate-based loader and the node obey.
TeaCache runs on an identity calibration at threshold 5 (random weights make published coefficients meaningless): it
skips every step the few-step rule allows (steps 2 and 4 of 6), which is what shows the bytes moved on skipped steps (0
by design). Between rows every model is unloaded, memory freed, the ballast dropped and the settings reset.

Per row: seconds per step (the median of the steps after the first, and the mean of all; a sampler callback ends each
step, after a device synchronisation; the first step starts at the first model call), ComfyUI's loaded weights and the
weights on the GPU during the steps (ComfyUI's ``loaded_size()``: under dynamic VRAM what it holds resident, which the
cap must bound; under the node, the count it updates), the device memory in use during the steps (from
``cudaMemGetInfo``, the ballast left out), peak allocated memory during the steps and over the whole sampling call, the
start (sampling call to first model call: ComfyUI's load plus the node's placement) and the end (last step to the
call's return: the node's restore), the max abs difference of the final latent to the reference row, and the node's
summary (``OffloadSession.summary()``) with its placement and restore seconds.

CPU mode (``--device cpu``, the default without CUDA; tiny shape, legacy mode, one cap, the extra rows): ComfyUI runs on
the CPU, so ComfyUI's partial-load rows are n/a and the node's target is forced to the CPU (``offload_target``
monkeypatched, as tests/host/offload does) so its real path runs: master copies, slots, ComfyUI's cast layers reading
slot views. The cap reaches the node as ``vram_budget_gb`` there. Times on the CPU say nothing about a GPU.

On any device it then checks that every offload row's latent is bit-identical to its reference row's, that the node
offloaded where it is meant to (and stood aside under dynamic VRAM), that no bytes moved on a skipped call, that every
latent is finite and that under dynamic VRAM ComfyUI's resident weights stayed within the cap, and exits with status 1
if not.

Run: COMFYUI_PATH=/path/to/ComfyUI .venv/bin/python benchmarks/bench_offload_node.py [--shape 14b]
[--weights-file wan14b.safetensors] [--caps 12,24] [--host-mode legacy|dynamic|both] [--frames 33 --height 480
--width 832 --steps 6 --cfg 1.0] [--out results.json]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import logging
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "tests") not in sys.path:  # omnitest; ComfyUI's root goes first later (its nodes/ must win over ours)
    sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

from omnitest.tiny_wan import TEXT_DIM, tiny_wan_shapes  # noqa: E402

log = logging.getLogger("bench_offload_node")
GIB, MIB = 1024 ** 3, 1024 ** 2
CONTEXT_TOKENS = 512
TEACACHE_CALIBRATION = "bench-offload-identity"
TEACACHE_THRESHOLD = 5.0


@dataclasses.dataclass(frozen=True)
class Shape:
    dim: int
    ffn: int
    blocks: int

    @property
    def heads(self) -> int:
        return self.dim // 128  # ComfyUI's Wan detection


SHAPES = {"tiny": Shape(128, 256, 8), "1.3b": Shape(1536, 8960, 30), "14b": Shape(5120, 13824, 40)}
CUDA_DEFAULTS = {"shape": "1.3b", "frames": 33, "height": 480, "width": 832}
CPU_DEFAULTS = {"shape": "tiny", "frames": 5, "height": 64, "width": 64}


@dataclasses.dataclass(frozen=True)
class Row:
    label: str
    mode: str = "legacy"                   # ComfyUI's loading mode: "legacy" or "dynamic"
    cap: float | None = None               # the VRAM cap in GiB (None: none)
    streams: int | None = None             # ComfyUI's NUM_STREAMS during the row (--async-offload: 2)
    offload: tuple[int | str, int] | None = None  # CPU Offload's (blocks_to_offload, prefetch_blocks): -1 auto, ALL
    teacache: bool = False
    reference: str | None = None           # the label of the row whose latent this one's is compared with
    takeover: bool = False                 # dynamic mode: the node on the model's non-dynamic delegate (a trial)

    @property
    def comfy_only(self) -> bool:
        """ComfyUI alone below the model's size: n/a where ComfyUI loads the whole model on the CPU."""
        return self.cap is not None and self.offload is None


ALL = "all"  # blocks_to_offload: every block of the model


def gib_label(cap: float) -> str:
    return f"{cap:g} GiB" if cap >= 1 else f"{cap * 1024:.1f} MiB"


RESIDENT = {"legacy": "fully resident", "dynamic": "dynamic VRAM, no cap"}  # each mode's first row, the reference


def rows_for(mode: str, caps: list[float], extra: bool, takeover: bool = False) -> list[Row]:
    """The rows of one host mode (see the module docstring); ``takeover``: the dynamic mode's takeover trial rows
    (they need a model loaded from a file)."""
    resident = RESIDENT[mode]
    if mode == "dynamic":
        cached = "dynamic VRAM, Apply TeaCache alone"
        rows = [Row(resident, mode),
                *(Row(f"ComfyUI dynamic VRAM at {gib_label(c)}", mode, c, reference=resident) for c in caps),
                Row(cached, mode, teacache=True, reference=resident),
                Row(f"dynamic VRAM at {gib_label(caps[0])}: CPU Offload auto + Apply TeaCache", mode, caps[0],
                    offload=(-1, 1), teacache=True, reference=cached)]
        if takeover:
            rows += [Row(f"takeover trial at {gib_label(c)}: CPU Offload auto on the non-dynamic delegate", mode, c,
                         offload=(-1, 1), reference=resident, takeover=True) for c in caps]
        return rows
    cached = "Apply TeaCache alone"
    rows = [Row(resident)]
    rows += [Row(f"ComfyUI partial load at {gib_label(c)}", cap=c, reference=resident) for c in caps]
    if extra:
        rows.append(Row(f"ComfyUI partial load at {gib_label(caps[0])}, --async-offload", cap=caps[0], streams=2,
                        reference=resident))
    rows += [Row(f"CPU Offload auto, prefetch 1, at {gib_label(c)}", cap=c, offload=(-1, 1), reference=resident)
             for c in caps]
    if extra:
        rows += [Row("CPU Offload all blocks, prefetch 1", offload=(ALL, 1), reference=resident),
                 Row("CPU Offload all blocks, prefetch 2", offload=(ALL, 2), reference=resident)]
    rows.append(Row(cached, teacache=True, reference=resident))
    rows += [Row(f"CPU Offload auto at {gib_label(c)} + Apply TeaCache", cap=c, offload=(-1, 1), teacache=True,
                 reference=cached) for c in caps]
    return rows


def comfy_has_dynamic_vram() -> bool:
    """Whether the ComfyUI found has dynamic VRAM (``ModelPatcherDynamic``), read from its source without importing
    it (the mode must be chosen before ComfyUI is imported)."""
    from omnitest.comfy_path import comfyui_path

    root = comfyui_path()
    source = root / "comfy" / "model_patcher.py" if root is not None else None
    return source is not None and source.is_file() and "class ModelPatcherDynamic" in source.read_text()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: 1.3b on CUDA, tiny on CPU")
    parser.add_argument("--frames", type=int, default=None, help="video frames (latent frames: (frames - 1) / 4 + 1)")
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--cfg", type=float, default=1.0, help="above 1 ComfyUI computes cond and uncond")
    parser.add_argument("--weights-file", type=Path, default=None,
                        help="read the weights from this safetensors file as ComfyUI's Load Diffusion Model does "
                             "(written first, from weights drawn on the device, when it does not exist)")
    parser.add_argument("--caps", default=None,
                        help="VRAM caps in GiB, comma-separated (default: 12,24 for the 14b shape on CUDA; else 40%% "
                             "of the blocks' weights + the weights outside the blocks + ComfyUI's activation estimate)")
    parser.add_argument("--cap-gb", type=float, default=None, help="one VRAM cap in GiB (the same as --caps X)")
    parser.add_argument("--cap-mode", choices=["ballast", "reserve"], default="ballast",
                        help="how a cap is made on CUDA: a ballast tensor taking all free VRAM but the cap (every "
                             "loader sees it), or --reserve-vram (only ComfyUI's estimate-based loader and the node)")
    parser.add_argument("--host-mode", choices=["legacy", "dynamic", "both"], default=None,
                        help="ComfyUI's loading mode; both runs one process per mode (default: both on CUDA with a "
                             "ComfyUI that has dynamic VRAM, else legacy)")
    parser.add_argument("--extra-rows", action=argparse.BooleanOptionalAction, default=None,
                        help="also --async-offload and CPU Offload of every block (default: on with one cap)")
    parser.add_argument("--takeover-trial", action="store_true",
                        help="dynamic mode: also the node on the model's non-dynamic delegate (needs --weights-file)")
    parser.add_argument("--rows", default=None,
                        help="only these rows of each mode, by number in the mode's list (e.g. 1,4), with the rows "
                             "they are compared with")
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here (after every row)")
    parser.add_argument("--first-row", type=int, default=1, help=argparse.SUPPRESS)  # a host mode's process: its rows
    opts = parser.parse_args(argv)
    if opts.device is None:
        opts.device = "cuda" if torch.cuda.is_available() else "cpu"
    for key, value in (CUDA_DEFAULTS if opts.device == "cuda" else CPU_DEFAULTS).items():
        if getattr(opts, key) is None:
            setattr(opts, key, value)
    if opts.height % 16 or opts.width % 16 or (opts.frames - 1) % 4 or opts.steps < 2:
        parser.error("Wan needs --height and --width multiples of 16 and --frames 4k + 1; --steps at least 2")
    if opts.caps is not None and opts.cap_gb is not None:
        parser.error("give --caps or --cap-gb, not both")
    caps = opts.caps or (str(opts.cap_gb) if opts.cap_gb is not None else None)
    if caps is None and opts.device == "cuda" and opts.shape == "14b":
        caps = "12,24"
    try:
        opts.caps = [float(c) for c in caps.split(",")] if caps else None
    except ValueError:
        parser.error(f"--caps takes GiB numbers separated by commas, got {caps!r}")
    if opts.caps is not None and any(c <= 0 for c in opts.caps):
        parser.error("every cap must be above 0 GiB")
    if opts.host_mode is None:
        opts.host_mode = "both" if opts.device == "cuda" and comfy_has_dynamic_vram() else "legacy"
    if opts.host_mode != "legacy" and opts.device != "cuda":
        parser.error("dynamic VRAM needs an NVIDIA GPU (--device cuda)")
    if opts.extra_rows is None:
        opts.extra_rows = opts.caps is None or len(opts.caps) == 1
    if opts.takeover_trial and opts.weights_file is None:
        parser.error("--takeover-trial needs --weights-file (the delegate loads the model again from its file)")
    try:
        opts.rows = sorted({int(n) for n in opts.rows.split(",")}) if opts.rows else None
    except ValueError:
        parser.error(f"--rows takes row numbers separated by commas, got {opts.rows!r}")
    return opts


def chosen_rows(rows: list[Row], numbers: list[int] | None) -> list[Row]:
    """``rows`` numbered 1.. kept where their number is in ``numbers`` (all when None), with their references."""
    if numbers is None:
        return rows
    keep = {rows[n - 1].label for n in numbers if 1 <= n <= len(rows)}
    keep |= {row.reference for row in rows if row.label in keep and row.reference}
    return [row for row in rows if row.label in keep]


# -- the model and its inputs ------------------------------------------------------------------------------------------

def random_state_dict(shape: Shape, device: torch.device) -> dict[str, torch.Tensor]:
    """Wan 2.1 T2V weights for ``shape``, bf16, drawn on ``device``: matrices N(0, 1/fan_in), norm gains 1 + N(0,
    0.02^2), biases and modulations N(0, 0.02^2)."""
    generator = torch.Generator(device=device).manual_seed(0)
    sd = {}
    for key, dims in tiny_wan_shapes(shape.blocks, shape.dim, shape.ffn).items():
        tensor = torch.empty(dims, dtype=torch.bfloat16, device=device)
        if key.endswith(("norm_q.weight", "norm_k.weight", "norm3.weight")):
            tensor.normal_(1.0, 0.02, generator=generator)
        elif key.endswith("modulation") or len(dims) == 1:
            tensor.normal_(0.0, 0.02, generator=generator)
        else:
            fan_in = 1
            for d in dims[1:]:
                fan_in *= d
            tensor.normal_(0.0, fan_in ** -0.5, generator=generator)
        sd[key] = tensor
    return sd


def ensure_weights_file(path: Path, shape: Shape, device: torch.device) -> bool:
    """Make ``path`` hold ``shape``'s weights: written (True) from weights drawn on ``device`` when it does not exist;
    an existing file is kept (False) when its tensors have the shape's names and sizes, else SystemExit."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    expected = {key: tuple(dims) for key, dims in tiny_wan_shapes(shape.blocks, shape.dim, shape.ffn).items()}
    if path.exists():
        with safe_open(str(path), framework="pt") as f:
            found = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
        if found != expected:
            raise SystemExit(f"{path} holds other weights than Wan shape (dim {shape.dim}, {shape.blocks} blocks): "
                             "remove it or name another --weights-file")
        return False
    log.info("writing %s (random weights drawn on %s)", path, device)
    on_device = random_state_dict(shape, device)
    weights = {key: tensor.to("cpu") for key, tensor in on_device.items()}
    del on_device
    partial = path.with_name(path.name + ".partial")
    save_file(weights, str(partial))
    partial.replace(path)
    return True


@dataclasses.dataclass
class Inputs:
    latent: torch.Tensor
    noise: torch.Tensor
    positive: list
    negative: list


def make_inputs(opts: argparse.Namespace) -> Inputs:
    import comfy.sample

    frames = (opts.frames - 1) // 4 + 1
    latent = torch.zeros(1, 16, frames, opts.height // 8, opts.width // 8)
    g = torch.Generator().manual_seed(1)
    positive = [[torch.randn(1, CONTEXT_TOKENS, TEXT_DIM, generator=g), {}]]
    negative = [[torch.randn(1, CONTEXT_TOKENS, TEXT_DIM, generator=g), {}]]
    return Inputs(latent, comfy.sample.prepare_noise(latent, 0), positive, negative)


def tokens(latent: torch.Tensor) -> int:
    _, _, t, h, w = latent.shape
    return t * (h // 2) * (w // 2)


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# -- measuring one sampling call ---------------------------------------------------------------------------------------

class Clock:
    """Marks one sampling call: its start, the first model call, the end of every step (sampler callback) and its
    return, each after a device synchronisation on CUDA; the peaks of allocated memory before the first model call,
    during the steps and to the return; ComfyUI's loaded-weight count at the first model call; the model calls."""

    def __init__(self, device: torch.device, patcher, ballast_bytes: int = 0):
        self.cuda = device.type == "cuda"
        self.device = device
        self.patcher = patcher
        self.ballast_bytes = ballast_bytes
        self.marks: dict[str, float] = {}
        self.step_ends: list[float] = []
        self.calls = 0
        self.weights_in_steps = 0      # ComfyUI's loaded_size() at the first model call
        self.weights_in_steps_max = 0  # and its largest value at a step's end
        self.used_in_steps = 0         # device memory in use during the steps (cudaMemGetInfo), the ballast left out
        self.peaks = {"before first call": 0, "steps": 0, "whole call": 0}

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self.marks["start"] = self.now()

    def model_call(self, module, args) -> None:
        self.calls += 1
        if "first call" in self.marks:
            return
        self.marks["first call"] = self.now()
        self.weights_in_steps = self.weights_in_steps_max = int(self.patcher.loaded_size())
        if self.cuda:
            self.peaks["before first call"] = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def step(self, step: int, x0, x, total_steps: int) -> None:
        self.step_ends.append(self.now())
        self.weights_in_steps_max = max(self.weights_in_steps_max, int(self.patcher.loaded_size()))
        if self.cuda:
            self.peaks["steps"] = torch.cuda.max_memory_allocated(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            self.used_in_steps = max(self.used_in_steps, total - free - self.ballast_bytes)

    def finish(self) -> None:
        self.marks["end"] = self.now()
        if self.cuda:
            self.peaks["whole call"] = max(self.peaks["before first call"],
                                           torch.cuda.max_memory_allocated(self.device))

    def step_seconds(self) -> list[float]:
        starts = [self.marks["first call"], *self.step_ends[:-1]]
        return [end - start for start, end in zip(starts, self.step_ends)]


class NodeTimer:
    """Wraps ``OffloadSession.after_load`` and ``close`` while active: their seconds (after a device synchronisation),
    ComfyUI's loaded-weight count before the node changed it, and the run's session."""

    def __init__(self, session_class, device: torch.device):
        self.session_class = session_class
        self.cuda = device.type == "cuda"
        self.device = device
        self.session = None
        self.seconds = {"placement": 0.0, "restore": 0.0}
        self.comfy_loaded = 0

    def _timed(self, name: str, method):
        def run(session, *args, **kwargs):
            if name == "placement":
                self.session = session
                self.comfy_loaded = session.patcher.model.model_loaded_weight_memory
            start = time.perf_counter()
            try:
                return method(session, *args, **kwargs)
            finally:
                if self.cuda:
                    torch.cuda.synchronize(self.device)
                self.seconds[name] += time.perf_counter() - start
        return run

    @contextlib.contextmanager
    def active(self):
        cls = self.session_class
        originals = {"after_load": cls.after_load, "close": cls.close}
        cls.after_load = self._timed("placement", originals["after_load"])
        cls.close = self._timed("restore", originals["close"])
        try:
            yield self
        finally:
            cls.after_load, cls.close = originals["after_load"], originals["close"]


@contextlib.contextmanager
def comfy_settings(reserve: int | None, streams: int | None):
    """ComfyUI's reserved VRAM (what ``--reserve-vram`` sets) and offload streams (``--async-offload``) for one row."""
    import comfy.model_management as mm

    saved = mm.EXTRA_RESERVED_VRAM, mm.NUM_STREAMS
    try:
        if reserve is not None:
            mm.EXTRA_RESERVED_VRAM = reserve
        if streams is not None:
            mm.NUM_STREAMS = streams
        yield
    finally:
        mm.EXTRA_RESERVED_VRAM, mm.NUM_STREAMS = saved


@contextlib.contextmanager
def ballast(device: torch.device, cap: int) -> Iterator[int]:
    """A tensor taking all free memory of ``device`` but ``cap`` bytes while the context lasts; yields its size."""
    free, _ = torch.cuda.mem_get_info(device)
    size = max(0, free - cap)
    weight = torch.empty(size, dtype=torch.uint8, device=device) if size else None
    try:
        yield size
    finally:
        del weight
        torch.cuda.empty_cache()


def free_everything(cuda: bool) -> None:
    import comfy.model_management as mm

    mm.unload_all_models()
    gc.collect()
    mm.soft_empty_cache()
    if cuda:
        torch.cuda.synchronize()


# -- the benchmark -----------------------------------------------------------------------------------------------------

class Bench:
    def __init__(self, opts: argparse.Namespace, device: torch.device):
        import comfy.model_management as mm
        import comfy.sd
        from omnitest.pack import pack_module

        self.opts, self.device = opts, device
        self.cuda = device.type == "cuda"
        self.node = pack_module("nodes.offload.node")
        self.session = pack_module("nodes.offload.session")
        self.host = pack_module("nodes.offload.host")  # where the node and its run find the offload target
        self.stats = pack_module("nodes.stats_store")
        self.shape = SHAPES[opts.shape]
        start = time.perf_counter()
        if opts.weights_file is not None:
            written = ensure_weights_file(opts.weights_file, self.shape, device)
            self.patcher = comfy.sd.load_diffusion_model(str(opts.weights_file))  # as Load Diffusion Model does
            self.weights_source = f"read from {opts.weights_file.name}" + (" (written now)" if written else "")
        else:
            sd = random_state_dict(self.shape, device)
            self.patcher = comfy.sd.load_diffusion_model_state_dict(sd, model_options={"dtype": torch.bfloat16})
            del sd  # ComfyUI popped every tensor: the device copies are gone
            self.weights_source = "drawn on the device"
        free_everything(self.cuda)
        self.build_seconds = time.perf_counter() - start
        dm = self.patcher.model.diffusion_model
        self.dtype = str(next(dm.blocks[0].parameters()).dtype).removeprefix("torch.")  # as ComfyUI loaded them
        self.block_bytes = nbytes([*dm.blocks[0].parameters(), *dm.blocks[0].buffers()])
        self.weight_bytes = nbytes([*dm.parameters(), *dm.buffers()])
        self.other_bytes = self.weight_bytes - self.shape.blocks * self.block_bytes
        self.inputs = make_inputs(opts)
        self.total = int(mm.get_total_memory(device))
        self.activation_estimate = int(self.patcher.model.memory_required([2, *self.inputs.latent.shape[1:]]))
        default_cap = self.other_bytes + 0.4 * self.shape.blocks * self.block_bytes + \
            (self.activation_estimate if self.cuda else 0)
        self.caps = opts.caps or [default_cap / GIB]
        if not all(0 < cap * GIB < self.total for cap in self.caps):
            raise SystemExit(f"every cap must be above 0 and below the device's {self.total / GIB:.2f} GiB")
        self.rows = chosen_rows(rows_for(opts.host_mode, self.caps, opts.extra_rows, takeover=opts.takeover_trial),
                                opts.rows)

    # -- one row --------------------------------------------------------------------------------------------------

    def base_for(self, row: Row):
        """The patcher a row samples: the loaded model, or for a takeover trial its non-dynamic delegate (loaded
        again from the file once, then kept by ComfyUI on the dynamic patcher)."""
        return self.patcher.get_non_dynamic_delegate() if row.takeover else self.patcher

    @contextlib.contextmanager
    def stand_aside_rule(self, row: Row) -> Iterator[None]:
        """For a takeover trial, the node stands aside only for a dynamic patcher (not because comfy-aimdo is on)."""
        if not row.takeover:
            yield
            return
        import comfy.model_patcher

        session, saved = self.session, self.session.dynamic_vram_reason
        session.dynamic_vram_reason = lambda patcher: (
            saved(patcher) if isinstance(patcher, comfy.model_patcher.ModelPatcherDynamic) else None)
        try:
            yield
        finally:
            session.dynamic_vram_reason = saved

    def model_for(self, row: Row, model):
        from omnitest.cache_nodes import apply_teacache
        from omnitest.pack import run_node

        if row.offload is not None:
            blocks, prefetch = row.offload
            budget = row.cap if row.cap is not None and not self.cuda else 0.0
            model = run_node(self.node.CPUOffload, node_id="2", model=model,
                             blocks_to_offload=self.shape.blocks if blocks == ALL else blocks,
                             prefetch_blocks=prefetch, pin_memory="auto", vram_budget_gb=budget)[0]
        if row.teacache:
            model = apply_teacache(model, TEACACHE_CALIBRATION, TEACACHE_THRESHOLD, node_id="3")
        return model

    def sample(self, model, clock: Clock) -> torch.Tensor:
        import comfy.sample

        i = self.inputs
        with torch.inference_mode():
            clock.start()
            out = comfy.sample.sample(model, i.noise, self.opts.steps, self.opts.cfg, "euler", "simple", i.positive,
                                      i.negative, i.latent, disable_pbar=True, seed=0, callback=clock.step)
            clock.finish()
        return out

    @contextlib.contextmanager
    def capped(self, row: Row) -> Iterator[int]:
        """The row's cap on the device (its ballast's bytes; 0 without one) and ComfyUI's settings for it."""
        cap = None if row.cap is None or not self.cuda else int(row.cap * GIB)
        reserve = self.total - cap if cap is not None and self.opts.cap_mode == "reserve" else None
        with contextlib.ExitStack() as stack:
            size = stack.enter_context(ballast(self.device, cap)) \
                if cap is not None and self.opts.cap_mode == "ballast" else 0
            stack.enter_context(comfy_settings(reserve, row.streams))
            yield size

    def run(self, row: Row) -> tuple[dict[str, Any], torch.Tensor | None]:
        if row.comfy_only and not self.cuda:
            return {"label": row.label, "mode": row.mode,
                    "na": "n/a on CPU: ComfyUI loads the whole model on the CPU"}, None
        timer = NodeTimer(self.session.OffloadSession, self.device)
        try:
            base = self.base_for(row)
            with self.capped(row) as ballast_bytes, self.stand_aside_rule(row):
                clock = Clock(self.device, base, ballast_bytes)
                hook = base.model.diffusion_model.register_forward_pre_hook(clock.model_call)
                try:
                    with timer.active():
                        out = self.sample(self.model_for(row, base), clock)
                finally:
                    hook.remove()
        finally:
            free_everything(self.cuda)
        steps = clock.step_seconds()
        result: dict[str, Any] = {
            "label": row.label,
            "mode": row.mode,
            "cap_gib": row.cap,
            "seconds_per_step_median": statistics.median(steps[1:] or steps),
            "seconds_per_step_mean": statistics.fmean(steps),
            "step_seconds": steps,
            "start_seconds": clock.marks["first call"] - clock.marks["start"],
            "end_seconds": clock.marks["end"] - clock.step_ends[-1],
            "model_calls": clock.calls,
            "comfy_loaded_bytes": timer.comfy_loaded if timer.session else clock.weights_in_steps,
            "weights_in_steps_bytes": clock.weights_in_steps,
            "weights_in_steps_max_bytes": clock.weights_in_steps_max,
            "device_used_in_steps_bytes": clock.used_in_steps if self.cuda else None,
            "ballast_bytes": ballast_bytes,
            "peak_bytes": clock.peaks if self.cuda else None,
            "finite": bool(torch.isfinite(out).all()),
        }
        if row.teacache:
            result["cache"] = self.stats.recent_runs(1)[0]["summary"]
        if timer.session is not None:
            result["node"] = {**timer.session.summary(), "placement_seconds": timer.seconds["placement"],
                              "restore_seconds": timer.seconds["restore"], "log_line": timer.session.log_line()}
        return result, out


# -- output ------------------------------------------------------------------------------------------------------------

def device_line(device: torch.device) -> str:
    from omnitest.comfy_path import comfyui_version

    versions = f"torch {torch.__version__}, Python {platform.python_version()}, ComfyUI {comfyui_version()}"
    if device.type != "cuda":
        cpu = platform.processor() or platform.machine()
        return f"CPU ({cpu}, torch threads {torch.get_num_threads()}), {versions}"
    props = torch.cuda.get_device_properties(device)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i",
                                 str(device.index or 0)], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        driver = "?"
    return f"{props.name} ({props.total_memory // MIB} MiB, driver {driver or '?'}), {versions}"


class Report:
    """Prints the header and one table line per row as it completes, the node's table at the end, and the JSON."""

    MAIN = ("| # | host mode | configuration | s/step (median after the 1st) | s/step (mean) | vs resident | model "
            "calls (reused) | ComfyUI loaded ({u}) | weights on the device in steps, first / most ({u}) | device in "
            "use in steps ({u}) | peak in steps ({u}) | peak, whole call ({u}) | start (s) | end (s) | max abs diff "
            "(to row) |")
    NODE = ("| # | configuration | blocks offloaded / kept / promoted | slots ({u}) | pinned ({u}) | moved before the "
            "1st call ({u}) | moved per computed call ({u}) | sync loads | copy wait (s) | calls computed / skipped | "
            "bytes moved on skipped calls | placement (s) | restore (s) |")

    def __init__(self, header: dict[str, Any], out: Path | None, cuda: bool, first_number: int = 1):
        self.header, self.out = header, out
        self.first_number = first_number
        self.unit_bytes, self.unit = (GIB, "GiB") if cuda else (MIB, "MiB")
        self.results: list[dict[str, Any]] = []

    def size(self, value: int | None) -> str:
        return "-" if value is None else f"{value / self.unit_bytes:.2f}"

    def start(self) -> None:
        print(self.header["text"] + "\n")
        print(self.MAIN.format(u=self.unit))
        print("|" + "---|" * (self.MAIN.count("|") - 1))

    def add(self, number: int, result: dict[str, Any]) -> None:
        self.results.append(result)
        print(self.main_line(number, result))
        if self.out is not None:
            self.out.write_text(json.dumps({"header": self.header, "rows": self.results}, indent=1))

    def main_line(self, number: int, r: dict[str, Any]) -> str:
        if "na" in r or "error" in r:
            return f"| {number} | {r['mode']} | {r['label']} | {r.get('na') or 'failed: ' + r['error']} |" + " |" * (
                self.MAIN.count("|") - 5)
        base = next(b for b in self.results if b["mode"] == r["mode"])  # the mode's first row: fully resident
        vs = (f"{(r['seconds_per_step_median'] / base['seconds_per_step_median'] - 1) * 100:+.1f}%"
              if "seconds_per_step_median" in base else "-")
        reused = r.get("cache", {}).get("reused", 0)
        peaks = r["peak_bytes"] or {}
        return (f"| {number} | {r['mode']} | {r['label']} | {r['seconds_per_step_median']:.3f} | "
                f"{r['seconds_per_step_mean']:.3f} | {vs} | {r['model_calls']} ({reused}) | "
                f"{self.size(r['comfy_loaded_bytes'])} | {self.size(r['weights_in_steps_bytes'])} / "
                f"{self.size(r['weights_in_steps_max_bytes'])} | {self.size(r['device_used_in_steps_bytes'])} | "
                f"{self.size(peaks.get('steps'))} | "
                f"{self.size(peaks.get('whole call'))} | {r['start_seconds']:.2f} | {r['end_seconds']:.2f} | "
                f"{r['diff']} |")

    def node_line(self, number: int, r: dict[str, Any]) -> str:
        n = r["node"]
        kept = n["blocks_total"] - n["blocks_offloaded"]
        computed = [s for s in n["steps"] if s["skipped"] < s["calls"]]
        calls = sum(s["calls"] - s["skipped"] for s in computed)
        moved = sum(s["bytes_moved"] for s in computed) / calls if calls else 0
        return (f"| {number} | {r['label']} | {n['blocks_offloaded']} / {kept} / {n['blocks_promoted']} | "
                f"{n['slots']} ({self.size(n['device_bytes'])}) | {self.size(n['pinned_bytes'])} | "
                f"{self.size(n['bytes_moved_before_sampling'])} | {self.size(int(moved))} | {n['sync_loads']} | "
                f"{n['copy_wait_seconds']:.3f} | {n['calls_computed']} / {n['calls_skipped']} | "
                f"{n['bytes_moved_on_skipped_calls']} | {n['placement_seconds']:.2f} | {n['restore_seconds']:.2f} |")

    def finish(self) -> None:
        print("\n" + self.header["text"] + "\n")
        print(self.MAIN.format(u=self.unit))
        print("|" + "---|" * (self.MAIN.count("|") - 1))
        for number, r in enumerate(self.results, self.first_number):
            print(self.main_line(number, r))
        print("\nstart: from the sampling call to its first model call (ComfyUI's load, the node's placement); end: "
              "from the last step to the call's return (the node's restore); ComfyUI loaded: its loaded-weight count "
              "after its load; weights on the device in steps: ComfyUI's loaded_size() at the first model call and "
              "its largest value at a step's end (the node updates it; under dynamic VRAM what ComfyUI holds "
              "resident); device in use: cudaMemGetInfo's used memory during the steps, the ballast left out; peaks: "
              "torch.cuda.max_memory_allocated from the first model call to the last step, and over the whole call.")
        print("\nThe node's own numbers (OffloadSession.summary(); moved per computed call: bytes moved during the "
              "steps' computed model calls, per call):\n")
        print(self.NODE.format(u=self.unit))
        print("|" + "---|" * (self.NODE.count("|") - 1))
        for number, r in enumerate(self.results, self.first_number):
            if "node" in r:
                print(self.node_line(number, r))
        print("\nThe node's log lines:")
        for number, r in enumerate(self.results, self.first_number):
            if "node" in r:
                print(f"- row {number}: {r['node']['log_line']}")


def diff_text(out: torch.Tensor, reference: torch.Tensor | None, number: int) -> str:
    if reference is None:
        return f"- (row {number} n/a)"
    if torch.equal(out, reference):
        return f"0 (row {number})"
    return f"{(out.float() - reference.float()).abs().max().item():.3g} (row {number})"


def check(rows: list[Row], results: list[dict[str, Any]], first_number: int = 1) -> list[str]:
    """What must hold on any device: offload rows identical to their reference, the node active in legacy mode and
    standing aside under dynamic VRAM (with ComfyUI's streaming on its card), no bytes moved on a skipped call, every
    latent finite, and ComfyUI's resident weights under dynamic VRAM within the row's cap. The failures, in words."""
    failures = []
    for number, (row, r) in enumerate(zip(rows, results), first_number):
        if "error" in r:
            failures.append(f"row {number} failed: {r['error']}")
            continue
        if "na" in r:
            continue
        if not r["finite"]:
            failures.append(f"row {number}: the latent is not finite")
        if row.mode == "dynamic" and row.cap is not None and r["ballast_bytes"] and \
                r["weights_in_steps_max_bytes"] > row.cap * GIB:
            failures.append(f"row {number}: ComfyUI held {r['weights_in_steps_max_bytes'] / GIB:.2f} GiB resident, "
                            f"above the {row.cap:g} GiB cap: the cap did not bite")
        if row.offload is None:
            continue
        node = r["node"]
        if not r["diff"].startswith("0 "):
            failures.append(f"row {number}: max abs diff {r['diff']}, expected 0")
        if row.takeover:
            if not node["active"] or node["bytes_moved"] == 0:
                failures.append(f"row {number}: on the non-dynamic delegate the node offloaded nothing "
                                f"({node['unchanged_reason']})")
        elif row.mode == "dynamic":
            if node["active"] or node["host_streaming"] is None:
                failures.append(f"row {number}: under dynamic VRAM the node should stand aside and show ComfyUI's "
                                f"streaming ({node['unchanged_reason']})")
        elif not node["active"] or node["bytes_moved"] == 0:
            failures.append(f"row {number}: the node offloaded nothing ({node['unchanged_reason']})")
        if node["bytes_moved_on_skipped_calls"] != 0:
            failures.append(f"row {number}: {node['bytes_moved_on_skipped_calls']} bytes moved on skipped calls")
        if row.teacache and node["calls_skipped"] == 0:
            failures.append(f"row {number}: TeaCache skipped no call")
    return failures


def header_for(bench: Bench, opts: argparse.Namespace) -> dict[str, Any]:
    shape, latent, cuda, device = bench.shape, bench.inputs.latent, bench.cuda, device_line(bench.device)
    unit, unit_name = (GIB, "GiB") if cuda else (MIB, "MiB")
    caps = ", ".join(f"{cap:g}" for cap in bench.caps)
    cap_text = (f"VRAM caps {caps} GiB of {bench.total / GIB:.2f} ("
                + ("a ballast takes all free VRAM but the cap" if opts.cap_mode == "ballast" else "--reserve-vram")
                + ")" if cuda else
                f"cap {bench.caps[0] * GIB / MIB:.2f} MiB, given to the node as vram_budget_gb (CPU mode: the node's "
                f"target forced to the CPU)")
    text = (f"{device}. Model: Wan 2.1 T2V shape '{opts.shape}' (dim {shape.dim}, ffn {shape.ffn}, "
            f"{shape.blocks} blocks, heads {shape.heads}), random weights, {bench.dtype}, {bench.weights_source}, "
            f"built and loaded in {bench.build_seconds:.1f} s: {bench.weight_bytes / unit:.2f} {unit_name} of weights, "
            f"one block {bench.block_bytes / MIB:.1f} MiB, outside the blocks {bench.other_bytes / MIB:.1f} MiB. "
            f"Latent {'x'.join(map(str, latent.shape[1:]))} ({opts.frames} frames {opts.height}x{opts.width}): "
            f"{tokens(latent)} tokens; text {CONTEXT_TOKENS} x {TEXT_DIM}; euler/simple, {opts.steps} steps, cfg "
            f"{opts.cfg:g}, seed 0; ComfyUI's activation estimate {bench.activation_estimate / unit:.2f} {unit_name}; "
            f"{cap_text}. TeaCache: identity calibration, threshold {TEACACHE_THRESHOLD:g}.")
    if not cuda:
        text += " Times on the CPU say nothing about a GPU."
    return {"text": text, "device": device, "shape": dataclasses.asdict(shape),
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(opts).items()},
            "tokens": tokens(latent), "weight_bytes": bench.weight_bytes, "block_bytes": bench.block_bytes,
            "caps_gib": bench.caps, "total_bytes": bench.total, "activation_estimate_bytes": bench.activation_estimate}


def run_rows(bench: Bench, report: Report) -> None:
    """Every row in turn, each reported as it ends, with ComfyUI's user directory pointed at a temporary one (the
    TeaCache calibration) and, on the CPU, the node's target forced to the CPU; both put back after."""
    import folder_paths
    from omnitest.cache_nodes import save_identity_calibrations

    saved_user_dir, saved_target = folder_paths.get_user_directory(), bench.host.offload_target
    with tempfile.TemporaryDirectory() as user_dir:
        folder_paths.set_user_directory(user_dir)
        save_identity_calibrations(TEACACHE_CALIBRATION, bench.opts.steps)
        if not bench.cuda:  # the node's real path on the CPU, as tests/host/offload does
            bench.host.offload_target = lambda patcher: torch.device("cpu")
        try:
            warm_up = Row(RESIDENT[bench.opts.host_mode], bench.opts.host_mode)
            warm_latent = None
            if bench.cuda:  # the first sampling call of a process can end a few bits away from every later one
                log.info("warm-up: %s, not reported", warm_up.label)
                _, warm_latent = bench.run(warm_up)
            latents: dict[str, torch.Tensor | None] = {}
            numbers = {row.label: number for number, row in enumerate(bench.rows, report.first_number)}
            for index, row in enumerate(bench.rows):
                number = report.first_number + index
                log.info("row %d (%d of %d): %s", number, index + 1, len(bench.rows), row.label)
                try:
                    result, latents[row.label] = bench.run(row)
                except Exception as e:  # one failing row (e.g. out of memory) must not lose the others
                    log.exception("row %d (%s) failed", number, row.label)
                    free_everything(bench.cuda)
                    result = {"label": row.label, "mode": row.mode, "error": f"{type(e).__name__}: {e}"}
                    latents[row.label] = None
                if latents[row.label] is not None:
                    reference = row.reference or row.label
                    result["diff"] = diff_text(latents[row.label], latents.get(reference), numbers[reference])
                if warm_latent is not None and row.label == warm_up.label and latents[row.label] is not None:
                    report.header["warm_up"] = diff_text(warm_latent, latents[row.label], number)
                    log.info("warm-up (%s, the process's first sampling call, untimed): max abs diff to the same "
                             "configuration later %s", warm_up.label, report.header["warm_up"])
                report.add(number, result)
        finally:
            bench.host.offload_target = saved_target
            folder_paths.set_user_directory(saved_user_dir)


def set_host_mode(mode: str):
    """What ComfyUI's ``main.py`` does before choosing its device for ``mode`` (``use_comfyui_in_process``'s
    ``before_device``): dynamic VRAM initialises comfy-aimdo's allocator; legacy disables dynamic VRAM as
    ``--disable-dynamic-vram`` does."""
    def before_device(args) -> None:
        if mode == "legacy":
            if hasattr(args, "disable_dynamic_vram"):
                args.disable_dynamic_vram = True
            return
        import comfy_aimdo.control

        headroom = None if getattr(args, "reserve_vram", None) is None else int(args.reserve_vram * GIB)
        try:
            comfy_aimdo.control.init(simple_vram_headroom=headroom,
                                     nvml_pressure=not getattr(args, "disable_nvml_pressure", False))
        except TypeError:  # older comfy-aimdo protocols, as main.py falls back
            try:
                comfy_aimdo.control.init(simple_vram_headroom=headroom)
            except TypeError:
                comfy_aimdo.control.init()
    return before_device


def enable_dynamic_vram() -> None:
    """The rest of ComfyUI's ``main.py`` dynamic VRAM start, once ComfyUI picked its devices: comfy-aimdo on each
    device, ``ModelPatcherDynamic`` as the patcher every loader makes. SystemExit where comfy-aimdo does not start."""
    import comfy.memory_management
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy_aimdo.control
    from comfy.cli_args import args

    devices = mm.get_all_torch_devices()
    try:
        started = comfy_aimdo.control.init_devices((d.index, int(getattr(args, "vram_headroom", 0) * GIB))
                                                   for d in devices)
    except TypeError:
        started = comfy_aimdo.control.init_devices(d.index for d in devices)
    if not started:
        raise SystemExit("comfy-aimdo did not start on this machine: no dynamic VRAM to measure (--host-mode legacy)")
    comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
    comfy.memory_management.aimdo_enabled = True


def run_modes(argv: list[str], opts: argparse.Namespace) -> dict[str, Any]:
    """``--host-mode both``: one process per mode, legacy then dynamic, their rows numbered on; their rows, checks and
    tables merged."""
    merged: dict[str, Any] = {"header": None, "rows": [], "failures": []}
    with tempfile.TemporaryDirectory() as folder:
        for mode in ("legacy", "dynamic"):
            out = Path(folder) / f"{mode}.json"
            command = [sys.executable, str(Path(__file__).resolve()), *argv, "--host-mode", mode, "--out", str(out),
                       "--first-row", str(len(merged["rows"]) + 1)]
            log.info("host mode %s, in its own process", mode)
            done = subprocess.run(command, check=False)
            if not out.exists():
                merged["failures"].append(f"host mode {mode}: the process ended with status {done.returncode} "
                                          "before any row")
                continue
            part = json.loads(out.read_text())
            merged["header"] = merged["header"] or part["header"]
            merged["rows"] += part["rows"]
            merged["failures"] += [f"{mode}: {f}" for f in part.get("failures", [])]
            if done.returncode not in (0, 1):
                merged["failures"].append(f"host mode {mode}: the process ended with status {done.returncode}")
    if merged["header"] is not None:
        report = Report(merged["header"], None, opts.device == "cuda")
        report.results = merged["rows"]
        report.finish()
    print_checks(merged["failures"])
    if opts.out is not None:
        opts.out.write_text(json.dumps(merged, indent=1))
    return merged


def print_checks(failures: list[str]) -> None:
    print("\nChecks (offload rows bit-identical to their reference, the node active (standing aside under dynamic "
          "VRAM), 0 bytes on skipped calls, finite latents, dynamic VRAM within the cap): "
          + ("all hold" if not failures else "FAILED:\n- " + "\n- ".join(failures)))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs every row; returns ``{"header", "rows", "failures"}`` (``check``'s failures)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = parse_args(argv)
    if opts.host_mode == "both":
        return run_modes(_without(_without(argv, "--out"), "--host-mode"), opts)
    from omnitest.comfy_path import use_comfyui_in_process

    cuda = opts.device == "cuda"
    if use_comfyui_in_process(cpu=not cuda, before_device=set_host_mode(opts.host_mode)) is None:
        raise SystemExit("no ComfyUI checkout (COMFYUI_PATH or ~/ComfyUI): nothing to measure")
    import comfy.model_management as mm

    device = mm.get_torch_device()
    if cuda != (device.type == "cuda"):
        raise SystemExit(f"--device {opts.device}, but ComfyUI picked {device}")
    if opts.host_mode == "dynamic":
        enable_dynamic_vram()
    threads = torch.get_num_threads()
    if not cuda:  # the tiny model gains nothing from more, and on a busy machine spinning threads slow it 100x
        torch.set_num_threads(1)
    try:
        log.info("building Wan shape %s (random weights) on %s and loading it through ComfyUI", opts.shape, device)
        bench = Bench(opts, device)
        header = header_for(bench, opts)
        report = Report(header, opts.out, cuda, first_number=opts.first_row)
        report.start()
        run_rows(bench, report)
    finally:
        torch.set_num_threads(threads)
    report.finish()
    failures = check(bench.rows, report.results, opts.first_row)
    print_checks(failures)
    summary = {"header": header, "rows": report.results, "failures": failures}
    if opts.out is not None:
        opts.out.write_text(json.dumps(summary, indent=1))
    return summary


def _without(argv: list[str], option: str) -> list[str]:
    """``argv`` without ``option`` and its value (both as ``--x v`` and ``--x=v``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            out.append(arg)
    return out


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="  log: %(message)s", stream=sys.stdout)
    sys.exit(1 if main()["failures"] else 0)
