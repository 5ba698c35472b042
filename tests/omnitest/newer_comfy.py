"""Stand-ins for mechanisms of ComfyUI releases newer than any tree the tests can run (0.35-0.39), built from their
source as read one file at a time (the files and commits are listed in docs/compatibility.md), installed into the
ComfyUI 0.33 under test for one test and removed after. Each is named after the first release it imitates.

* ``model_compiler_035``: ComfyUI's model compiler (``comfy/model_prefetch.py``, ``comfy/cli_args.py``): the flag
  ``args.disable_comfy_compiler``; ``malloc_graph_enabled(device)``, asked at every model call; a recorded region
  opened before the DIFFUSION_MODEL wrappers run (where MiniMax-H3's forward opens it), one block scope per block
  call, the allocations of each scope recorded (here: the tensor ops that ran in it, each allocating its output),
  and, with ``assert_graph_breaks`` (``--assert-graph-breaks``), the native recorder's error when a region's pattern
  differs from the first region's. The stand-in leaves out what the CPU has not: dynamic VRAM and CUDA.
* ``block_sparse_attention_035``: the core node BlockSparseAttention (``comfy_extras/nodes_sparse_attention.py``):
  its override put into the clone's ``transformer_options["optimized_attention_override"]`` at patch time and again
  at every step (``ON_PREPARE_STATE``), on top of whatever override was there, which it calls for the calls it
  declines (here: all of them, computing dense attention, and counting them).
* ``fast_pins_037``: per-model fast disk and fast pin subsets (``comfy/model_patcher.py``,
  ``comfy/model_management.py``): ``ModelPatcher.fast_disk``, ``model_management.FAST_PIN_SUBSETS`` and the static
  ``pin_memory(tensor, evict_active=True)`` with its new keyword.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

_MISSING = object()


@contextlib.contextmanager
def _attributes(*changes: tuple[Any, str, Any]) -> Iterator[None]:
    """Set each ``(object, name, value)`` while inside; put back (or delete) what was there after."""
    before = [(obj, name, getattr(obj, name, _MISSING)) for obj, name, _ in changes]
    try:
        for obj, name, value in changes:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(before):
            if value is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


@dataclass
class CompilerRecord:
    """What the stand-in compiler saw: per recorded region, its allocation pattern (the tensors allocated in each block
    scope: the ops that ran there, each allocating its output), and the graph breaks."""

    regions: list[tuple[int, ...]] = field(default_factory=list)
    breaks: int = 0


@contextlib.contextmanager
def model_compiler_035(base_model, blocks: torch.nn.ModuleList,
                       assert_graph_breaks: bool = False) -> Iterator[CompilerRecord]:
    """ComfyUI 0.35's model compiler on ``base_model`` (a ``comfy.model_base.BaseModel``) whose block stack is
    ``blocks``. Yields the record of what it compiled."""
    import comfy.cli_args
    import comfy.model_prefetch
    from torch.utils._python_dispatch import TorchDispatchMode

    record = CompilerRecord()
    args = comfy.cli_args.args
    scopes: list[int] = []

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kw=None):
            scopes[-1] += 1
            return func(*a, **(kw or {}))

    recorder = Allocations()

    def malloc_graph_enabled(device) -> bool:
        return not args.disable_comfy_compiler

    def malloc_graph_begin(device) -> None:
        scopes[:] = [0]
        recorder.__enter__()

    def malloc_graph_end() -> None:
        recorder.__exit__(None, None, None)
        record.regions.append(tuple(scopes))
        if record.regions[-1] != record.regions[0]:
            record.breaks += 1
            if assert_graph_breaks:
                raise RuntimeError("aimdo memory compile error")

    def block_scope(module, inputs) -> None:
        if scopes:
            scopes.append(0)

    original = base_model._apply_model

    def apply_model(*a, **kw):  # a model whose forward opens the region before its DIFFUSION_MODEL wrappers run
        if not comfy.model_prefetch.malloc_graph_enabled(None):
            return original(*a, **kw)
        comfy.model_prefetch.malloc_graph_begin(None)
        try:
            out = original(*a, **kw)
        except BaseException:
            recorder.__exit__(None, None, None)
            scopes.clear()
            raise
        comfy.model_prefetch.malloc_graph_end()
        scopes.clear()
        return out

    handles = [block.register_forward_pre_hook(block_scope) for block in blocks]
    try:
        with _attributes((args, "disable_comfy_compiler", False),
                         (comfy.model_prefetch, "malloc_graph_enabled", malloc_graph_enabled),
                         (comfy.model_prefetch, "malloc_graph_begin", malloc_graph_begin),
                         (comfy.model_prefetch, "malloc_graph_end", malloc_graph_end),
                         (base_model, "_apply_model", apply_model)):
            yield record
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class SparseAttentionRecord:
    """What the stand-in BlockSparseAttention saw: its calls, and the override it found under it (None: none)."""

    calls: int = 0
    previous: list[Any] = field(default_factory=list)


def block_sparse_attention_035(model) -> tuple[Any, SparseAttentionRecord]:
    """ComfyUI 0.35's BlockSparseAttention node applied to ``model`` (a ModelPatcher): a clone whose attention goes
    through its override, installed at patch time and at every step, chaining the override it finds. Returns the clone
    and its record."""
    import comfy.patcher_extension

    record = SparseAttentionRecord()
    installed: set = set()

    def install(transformer_options: dict) -> None:
        current = transformer_options.get("optimized_attention_override")
        if current in installed:
            return

        def override(func, q, k, v, heads, mask=None, **kwargs):
            record.calls += 1  # every call declined: dense, through the previous override or the host's function
            if current is None:
                return func(q, k, v, heads, mask=mask, **kwargs)
            return current(func, q, k, v, heads, mask=mask, **kwargs)

        override.__module__ = "comfy_extras.nodes_sparse_attention"
        override.__qualname__ = "make_attention_override.<locals>.override"
        installed.add(override)
        record.previous.append(current)
        transformer_options["optimized_attention_override"] = override

    clone = model.clone()
    install(clone.model_options.setdefault("transformer_options", {}))
    def each_step(patcher, timestep, model_options=None) -> None:  # ComfyUI before 0.33 passes no model_options
        if model_options is not None:
            install(model_options["transformer_options"])

    clone.add_callback_with_key(comfy.patcher_extension.CallbacksMP.ON_PREPARE_STATE, "block_sparse_attention",
                                each_step)
    return clone, record


@contextlib.contextmanager
def fast_pins_037(patcher, fast_disk: bool = True) -> Iterator[list[bool]]:
    """ComfyUI 0.37's per-model fast disk on ``patcher``, its fast pin subsets, and the static ``pin_memory`` with its
    ``evict_active`` keyword. Yields the ``evict_active`` of each pin made through it."""
    import comfy.model_management
    import comfy.model_patcher

    pins: list[bool] = []
    pin_memory = comfy.model_management.pin_memory

    def pin_memory_037(tensor, evict_active=True):
        pins.append(evict_active)
        return pin_memory(tensor)

    with _attributes((comfy.model_patcher.ModelPatcher, "fast_disk", False), (patcher, "fast_disk", fast_disk),
                     (comfy.model_management, "FAST_PIN_SUBSETS", ["weights-fast", "patches-fast"]),
                     (comfy.model_management, "pin_memory", pin_memory_037)):
        yield pins
