"""Values as plain data: what a sequence-parallel command carries, with nothing a receiver could be made to run.

``to_plain`` turns a value into JSON-able data, every tensor replaced by what the caller's ``slot`` makes of it (its
place among the raw bytes that follow, its dtype and shape); ``from_plain`` rebuilds it. What travels: None, bool,
int, float, str, bytes, lists, tuples, dicts (any of these as keys), tensors, ``torch.dtype``, ``torch.device``,
``uuid.UUID``, and this pack's own dataclasses and enums (a feature's config) as their class's name inside the pack
and their fields. A receiver rebuilds only dataclasses and enums of this pack's own modules; anything else is a
``PlainDataError`` naming it. Nothing here unpickles.
"""
from __future__ import annotations

import dataclasses
import enum
import importlib
import json
import re
import sys
import uuid
from typing import Any, Callable

import torch

#: this pack's import name in this process (ComfyUI imports it under its folder's name, a worker under another one):
#: classes travel by their module's name inside the pack, so each side maps it to its own
PACKAGE = __name__.rsplit(".nodes.", 1)[0]
#: dtypes a tensor may have in a command
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.complex64, torch.complex128)}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        DTYPES[_name] = getattr(torch, _name)
#: the pack's top-level packages whose dataclasses and enums may travel
PACK_MODULES = ("nodes", "omni_hooks")
_TAG = "$"


class PlainDataError(ValueError):
    """A value that cannot travel as plain data, or data that does not describe one."""


#: a JSON string (skipped whole: brackets inside it do not nest), a quote that opens no string (malformed: the scan
#: stops), or a bracket; the alternatives exclude each other, so a scan is linear in the text
_JSON_STRUCTURE = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|"|[\[\]{}]', re.S)


def json_depth(text: str, limit: int) -> int:
    """How deeply ``text`` (JSON) nests arrays and objects, counted up to ``limit + 1`` (the scan stops there, and
    at a string that does not end)."""
    depth = deepest = 0
    for match in _JSON_STRUCTURE.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > limit:
                break
        elif token in "]}":
            depth -= 1
        elif token == '"':
            break
    return deepest


def bounded_json(data: bytes | bytearray | memoryview, max_bytes: int, max_depth: int, what: str) -> Any:
    """``data`` (UTF-8 JSON) as Python values, read only when it holds at most ``max_bytes`` bytes nested at most
    ``max_depth`` deep (so no decoder recurses without bound). PlainDataError naming ``what`` otherwise, or when it is
    not JSON."""
    if len(data) > max_bytes:
        raise PlainDataError(f"{what}: {len(data)} bytes, more than {max_bytes}")
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError:
        raise PlainDataError(f"{what}: not UTF-8 text") from None
    if json_depth(text, max_depth) > max_depth:
        raise PlainDataError(f"{what}: nested more than {max_depth} deep")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise PlainDataError(f"{what}: not JSON ({exc})") from None


def dtype_named(name: Any) -> torch.dtype:
    if not isinstance(name, str) or name not in DTYPES:
        raise PlainDataError(f"not a tensor dtype a command may carry: {name!r}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    dtype_named(name)
    return name


def to_plain(value: Any, slot: Callable[[torch.Tensor], dict]) -> Any:
    """``value`` as JSON-able data; each tensor becomes ``slot(tensor)`` (a dict of JSON-able fields). PlainDataError
    naming the first value of another type."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)) and type(value) in (int, float):
        return value
    if isinstance(value, torch.Tensor):
        return {_TAG: "tensor", **slot(value)}
    if isinstance(value, list):
        return [to_plain(v, slot) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return {_TAG: "tuple", "items": [to_plain(v, slot) for v in value]}
    if isinstance(value, dict) and type(value) is dict:
        return {_TAG: "dict", "items": [[to_plain(k, slot), to_plain(v, slot)] for k, v in value.items()]}
    if isinstance(value, bytes):
        return {_TAG: "bytes", "hex": value.hex()}
    if isinstance(value, torch.dtype):
        return {_TAG: "dtype", "name": dtype_name(value)}
    if isinstance(value, torch.device):
        return {_TAG: "device", "name": str(value)}
    if isinstance(value, uuid.UUID):
        return {_TAG: "uuid", "hex": value.hex}
    if isinstance(value, enum.Enum) and _pack_class(type(value)):
        return {_TAG: "enum", "class": _pack_class(type(value)), "value": to_plain(value.value, slot)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and _pack_class(type(value)):
        fields = {f.name: to_plain(getattr(value, f.name), slot) for f in dataclasses.fields(value) if f.init}
        return {_TAG: "dataclass", "class": _pack_class(type(value)), "fields": fields}
    raise PlainDataError(f"a {type(value).__module__}.{type(value).__qualname__} cannot be sent to the other ranks "
                         "(plain data, tensors and this pack's configs only)")


def from_plain(data: Any, tensor: Callable[[dict], torch.Tensor]) -> Any:
    """``to_plain``'s value; each tensor is ``tensor(its slot)``. PlainDataError when ``data`` is not what
    ``to_plain`` makes."""
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [from_plain(v, tensor) for v in data]
    if not isinstance(data, dict):
        raise PlainDataError(f"malformed plain data: a {type(data).__name__}")
    tag = data.get(_TAG)
    try:
        if tag == "tensor":
            return tensor(data)
        if tag == "tuple":
            return tuple(from_plain(v, tensor) for v in _list(data["items"]))
        if tag == "dict":
            pairs = (_pair(i) for i in _list(data["items"]))
            return {_key(from_plain(k, tensor)): from_plain(v, tensor) for k, v in pairs}
        if tag == "bytes":
            return bytes.fromhex(data["hex"])
        if tag == "dtype":
            return dtype_named(data["name"])
        if tag == "device":
            return torch.device(data["name"])
        if tag == "uuid":
            return uuid.UUID(hex=data["hex"])
        if tag == "enum":
            return _class(data["class"], enum.Enum)(from_plain(data["value"], tensor))
        if tag == "dataclass":
            cls = _class(data["class"], None)
            fields = data["fields"]
            if not isinstance(fields, dict):
                raise PlainDataError("malformed dataclass fields")
            known = {f.name for f in dataclasses.fields(cls) if f.init}
            if set(fields) - known:
                raise PlainDataError(f"{cls.__qualname__} has no field(s) {sorted(set(fields) - known)}")
            return cls(**{name: from_plain(v, tensor) for name, v in fields.items()})
    except PlainDataError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise PlainDataError(f"malformed plain data ({tag!r}: {exc})") from None
    raise PlainDataError(f"malformed plain data: unknown tag {tag!r}")


def _list(value: Any) -> list:
    if not isinstance(value, list):
        raise PlainDataError("malformed plain data: expected a list")
    return value


def _pair(value: Any) -> list:
    if not isinstance(value, list) or len(value) != 2:
        raise PlainDataError("malformed plain data: expected a [key, value] pair")
    return value


def _key(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        raise PlainDataError(f"malformed plain data: a {type(value).__name__} as a dict key") from None
    return value


def _pack_class(cls: type) -> str | None:
    """``cls``'s name inside this pack ("omni_hooks.teacache.config:TeaCacheConfig"), None for a class of elsewhere."""
    if not cls.__module__.startswith(PACKAGE + ".") or "<" in cls.__qualname__:
        return None
    return f"{cls.__module__[len(PACKAGE) + 1:]}:{cls.__qualname__}"


def _class(name: Any, base: type | None) -> type:
    """The class of this pack named ``name``: an enum (``base``) or a dataclass (``base`` None) of one of this pack's
    own modules (imported if it was not yet; no module from elsewhere)."""
    if not isinstance(name, str) or name.count(":") != 1:
        raise PlainDataError(f"malformed class name {name!r}")
    module_name, qualname = name.split(":")
    parts = module_name.split(".")
    if parts[0] not in PACK_MODULES or not all(part.isidentifier() for part in parts):
        raise PlainDataError(f"{name!r} is not a class of this pack")
    module = sys.modules.get(f"{PACKAGE}.{module_name}")
    if module is None:
        try:
            module = importlib.import_module(f"{PACKAGE}.{module_name}")
        except ImportError:
            module = None
    found: Any = module
    for part in qualname.split("."):
        if found is None or "<" in part:
            found = None
            break
        found = getattr(found, part, None)
    if module is None or not isinstance(found, type) or _pack_class(found) != name:
        raise PlainDataError(f"{name!r} is not a class of this pack loaded here")
    if base is None and not dataclasses.is_dataclass(found) or base is not None and not issubclass(found, base):
        raise PlainDataError(f"{name!r} is not a {'dataclass' if base is None else base.__name__} of this pack")
    return found
