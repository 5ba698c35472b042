"""Import this pack the way ComfyUI does (a package loaded from its folder, relative imports), for in-process tests.

Import only after ComfyUI's root is on ``sys.path`` (tests/host/conftest.py does that).
"""
from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from .comfy_path import PACK_ROOT

PACKAGE = "comfyui_omnihooks_under_test"


def load_pack() -> ModuleType:
    if PACKAGE in sys.modules:
        return sys.modules[PACKAGE]
    spec = importlib.util.spec_from_file_location(PACKAGE, PACK_ROOT / "__init__.py",
                                                  submodule_search_locations=[str(PACK_ROOT)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = module
    spec.loader.exec_module(module)
    return module


def pack_module(name: str) -> ModuleType:
    """A submodule of the pack, e.g. ``pack_module("nodes.caches.teacache")``."""
    load_pack()
    return importlib.import_module(f"{PACKAGE}.{name}")


def run_node(node_cls, node_id: str = "7", **inputs):
    """Execute a V3 node the way ComfyUI's executor does (class clone with hidden inputs); returns its outputs."""
    clone = node_cls.PREPARE_CLASS_CLONE({"UNIQUE_ID": node_id})
    return clone.EXECUTE_NORMALIZED(**inputs).args
