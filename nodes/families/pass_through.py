"""Wrappers around a model's ``forward`` that pass their call through, told apart from drift by what they do.

Other custom nodes and profilers replace a block class's ``forward`` with a function taking ``(self, *args,
**kwargs)`` that calls the original (with or without ``functools.wraps``). Its signature hides which arguments reach
the original, so the drift check cannot read it; what it does can be checked. ``follow`` runs the wrapper's own code
once, on sample arguments, with every Python function it refers to (its closure and the globals its code names)
replaced by a recorder, and accepts it as a pass-through when exactly this holds: one of those functions received
``(self, *the call's arguments)`` unchanged, objects identical, once, and the wrapper returned what that function
returned, unchanged. That function is then checked in its place (it may be a wrapper itself, or the original).

Nothing shared is changed while probing: the wrapper runs as a copy of its function over a copy of its globals, and
no model code runs (the recorders stand in for it). The wrapper's own statements do run, once: a counter or profiler
in it sees one call that computed nothing. So a wrapper is probed once per process: the answer is kept for as long as
the wrapper and the functions it refers to are the same objects (a pack that wraps again, or rebinds what its wrapper
calls, is probed anew), and every later sampling run reads it without running the wrapper. ``__wrapped__`` is not
trusted on its own: only the call is. What a probe cannot tell: a wrapper that changes only some calls, depending on
their values.
"""
from __future__ import annotations

import inspect
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

MAX_WRAPPERS = 8  # wrappers followed around one forward before giving up (a cycle, or wrappers without end)


@dataclass(frozen=True)
class Followed:
    """Where ``follow`` stopped: ``function``, the first function that is not an opaque wrapper (its signature is
    then checked), ``wrappers``, the pass-through wrappers passed on the way (qualified names, outermost first), and
    ``problem``, why the wrapper at ``function`` could not be passed (None when none is left to pass)."""

    function: Callable
    wrappers: tuple[str, ...] = ()
    problem: str | None = None


def qualified_name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', None) or '?'}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def follow(fn: Callable, instance: torch.nn.Module, opaque: Callable[[Callable], bool],
           call: tuple[tuple, dict]) -> Followed:
    """Follow ``fn`` (an unbound ``forward``) through the pass-through wrappers around it.

    ``opaque(f)``: whether ``f``'s own signature hides its arguments (the caller's rule); ``call``: the sample
    ``(args, kwargs)`` of one call, ``self`` not included, as the model makes it (fresh objects, compared by
    identity). ``instance`` is passed as ``self``.
    """
    wrappers: list[str] = []
    for _ in range(MAX_WRAPPERS):
        if not opaque(fn):
            return Followed(fn, tuple(wrappers))
        inner, problem = _passed_to(fn, instance, call)
        if inner is None:
            return Followed(fn, tuple(wrappers), problem)
        wrappers.append(qualified_name(fn))
        fn = inner
    return Followed(fn, tuple(wrappers), f"more than {MAX_WRAPPERS} wrappers around it could not all be followed")


class _Recorder:
    """Stands in for one function the wrapper refers to: records its calls, returns a tensor of its own (so a
    wrapper that changes what it returns can do so, and be seen doing it)."""

    def __init__(self, replaces: Callable):
        self.replaces = replaces
        self.calls: list[tuple[tuple, dict]] = []
        self.result = torch.zeros(1)

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.result


def _code_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_names(const)


# per wrapper: (the functions it refers to, the instance's class, the call's shape) -> what its probe found
_PROBED: weakref.WeakKeyDictionary[Callable, dict[tuple, tuple[Callable | None, str | None]]] = \
    weakref.WeakKeyDictionary()


def _passed_to(fn: Callable, instance: Any, call: tuple[tuple, dict]) -> tuple[Callable | None, str | None]:
    """The function ``fn`` passes its call through to, or None and why not; probed once per wrapper (see above)."""
    if not isinstance(fn, types.FunctionType):
        return None, f"it is a {type(fn).__name__}, not a Python function whose calls could be followed"
    recorders: dict[int, _Recorder] = {}

    def recorder_for(value: Any) -> Any:
        if not isinstance(value, types.FunctionType) or value is fn:
            return value
        return recorders.setdefault(id(value), _Recorder(value))

    closure = tuple(types.CellType(recorder_for(cell.cell_contents)) if _filled(cell) else cell
                    for cell in fn.__closure__ or ())
    namespace = dict(fn.__globals__)
    for name in set(_code_names(fn.__code__)):
        if name in namespace:
            namespace[name] = recorder_for(namespace[name])
    if not recorders:
        return None, "it calls no function that could be followed"
    args, kwargs = call
    key = (tuple(r.replaces for r in recorders.values()), type(instance), len(args), tuple(kwargs))
    probed = _PROBED.setdefault(fn, {})
    if key not in probed:
        probed[key] = _probe(fn, instance, call, namespace, closure, recorders)
    return probed[key]


def _probe(fn: types.FunctionType, instance: Any, call: tuple[tuple, dict], namespace: dict, closure: tuple,
           recorders: dict[int, _Recorder]) -> tuple[Callable | None, str | None]:
    """Run a copy of ``fn`` over ``namespace`` and ``closure`` (its functions replaced by ``recorders``) once."""
    probe = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, closure or None)
    probe.__kwdefaults__ = fn.__kwdefaults__
    args, kwargs = call
    try:
        returned = probe(instance, *args, **kwargs)
    except Exception as e:
        return None, f"calling it with sample arguments failed ({type(e).__name__}: {e})"
    (inner,) = [r for r in recorders.values() if r.result is returned] or [None]
    if inner is None:
        return None, ("it returns something other than what the function it wraps returned"
                      if any(r.calls for r in recorders.values()) else "it calls no function that could be followed")
    if len(inner.calls) != 1:
        return None, f"it calls {qualified_name(inner.replaces)} {len(inner.calls)} times for one call"
    difference = _call_difference((instance, *args), kwargs, *inner.calls[0])
    if difference is not None:
        return None, f"it changes the call to {qualified_name(inner.replaces)}: {difference}"
    return inner.replaces, None


def _filled(cell: types.CellType) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # an empty cell (a name bound later)
        return False
    return True


def _call_difference(args: tuple, kwargs: dict, got_args: tuple, got_kwargs: dict) -> str | None:
    """How the call ``(got_args, got_kwargs)`` differs from ``(args, kwargs)`` by identity, or None."""
    if len(got_args) != len(args):
        return f"{len(args) - 1} positional arguments in, {len(got_args) - 1} out"
    for index, (sent, got) in enumerate(zip(args, got_args)):
        if got is not sent:
            return "self is not passed on" if index == 0 else f"positional argument {index - 1} is not passed on as is"
    for name, sent in kwargs.items():
        if name not in got_kwargs:
            return f"{name!r} is not passed on"
        if got_kwargs[name] is not sent:
            return f"{name!r} is not passed on as is"
    added = [name for name in got_kwargs if name not in kwargs]
    if added:
        return f"{', '.join(map(repr, added))} added"
    return None


def sample_call(params: tuple[str, ...], positions: dict[str, int]) -> tuple[tuple, dict]:
    """A probe call with a fresh object per parameter: the parameters read at a position (``positions``, from 0
    without gaps) positionally, the others by keyword; ``*args`` / ``**kwargs`` entries are left out. Tensors of one
    element, except a dict for a parameter named ``*options`` (``transformer_options``)."""
    named = [p for p in params if not p.startswith("*")]
    by_index = {i: n for n, i in positions.items() if n in named}
    positional = []
    while len(positional) in by_index:
        positional.append(by_index[len(positional)])

    def value(name: str) -> Any:
        return {} if name.endswith("options") else torch.zeros(1)

    return tuple(value(n) for n in positional), {n: value(n) for n in named if n not in positional}


def own_signature(fn: Callable) -> inspect.Signature:
    """``fn``'s own signature, not the one ``functools.wraps`` copied onto it."""
    return inspect.signature(fn, follow_wrapped=False)
