"""Another custom node pack, as far as the drift check can tell: it replaces ``WanAttentionBlock.forward`` on the
shared ``comfy.ldm.wan.model`` module, the way packs and profilers do, with a plain ``(self, *args, **kwargs)``
function. ``installed(kind)`` puts one wrapper there and always puts the previous ``forward`` back. Import only after
ComfyUI's root is on ``sys.path``.

Pass-through kinds (same results as the original): ``plain`` (a closure), ``wraps`` (``functools.wraps``),
``profiler`` (the original kept in a module global, timed with a helper function), ``stacked`` (``plain`` around
``wraps``, as two packs would). Kinds that change the call: ``drops_argument`` (``transformer_options`` not passed
on), ``alters_argument`` (``x`` replaced by a copy), ``changes_output`` (returns a copy), ``calls_twice``.
"""
from __future__ import annotations

import contextlib
import functools
import time
from typing import Iterator

import comfy.ldm.wan.model as wan_model

CALLS = {"count": 0}    # how often any wrapper of this module ran
TIMES: list[float] = []
_ORIGINAL = None        # the profiler's copy of the forward it wraps


def _record(seconds: float) -> None:
    TIMES.append(seconds)


def _plain(original):
    def forward(self, *args, **kwargs):
        CALLS["count"] += 1
        return original(self, *args, **kwargs)
    return forward


def _wraps(original):
    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        CALLS["count"] += 1
        return original(self, *args, **kwargs)
    return forward


def _profiled(self, *args, **kwargs):
    CALLS["count"] += 1
    started = time.perf_counter()
    out = _ORIGINAL(self, *args, **kwargs)
    _record(time.perf_counter() - started)
    return out


def _profiler(original):
    global _ORIGINAL
    _ORIGINAL = original
    return _profiled


def _drops_argument(original):
    def forward(self, *args, **kwargs):
        CALLS["count"] += 1
        kwargs.pop("transformer_options", None)
        return original(self, *args, **kwargs)
    return forward


def _alters_argument(original):
    def forward(self, x, *args, **kwargs):
        CALLS["count"] += 1
        return original(self, x.clone(), *args, **kwargs)
    return forward


def _changes_output(original):
    def forward(self, *args, **kwargs):
        CALLS["count"] += 1
        return original(self, *args, **kwargs).clone()
    return forward


def _calls_twice(original):
    def forward(self, *args, **kwargs):
        CALLS["count"] += 1
        original(self, *args, **kwargs)
        return original(self, *args, **kwargs)
    return forward


PASS_THROUGH = {"plain": _plain, "wraps": _wraps, "profiler": _profiler,
                "stacked": lambda original: _plain(_wraps(original))}
CHANGING = {"drops_argument": _drops_argument, "alters_argument": _alters_argument,
            "changes_output": _changes_output, "calls_twice": _calls_twice}


@contextlib.contextmanager
def installed(kind: str) -> Iterator[None]:
    """``WanAttentionBlock.forward`` wrapped by the ``kind`` wrapper while inside; the previous one put back after."""
    cls = wan_model.WanAttentionBlock
    previous = cls.__dict__["forward"]
    cls.forward = {**PASS_THROUGH, **CHANGING}[kind](previous)
    CALLS["count"] = 0
    try:
        yield
    finally:
        cls.forward = previous
