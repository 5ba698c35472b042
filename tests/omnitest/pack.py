"""Import this pack the way ComfyUI does (a package loaded from its folder, relative imports), for in-process tests.

Import only after ComfyUI's root is on ``sys.path`` (tests/host/conftest.py does that).
"""
from __future__ import annotations

import importlib.util
import inspect
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


def class_clone(node_cls, hidden_inputs: dict):
    """``node_cls.PREPARE_CLASS_CLONE`` called as the host's executor calls it: ComfyUI 0.3.x passes the hidden inputs,
    newer hosts a ``V3Data`` dict holding them under ``hidden_inputs`` (told apart by the method's parameter name)."""
    parameter = next(iter(inspect.signature(node_cls.PREPARE_CLASS_CLONE).parameters))
    if parameter == "hidden_inputs":
        return node_cls.PREPARE_CLASS_CLONE(hidden_inputs)
    return node_cls.PREPARE_CLASS_CLONE({"hidden_inputs": hidden_inputs})


def run_node(node_cls, node_id: str = "7", **inputs):
    """Execute a V3 node the way ComfyUI's executor does (class clone with hidden inputs); returns its outputs."""
    return class_clone(node_cls, {"UNIQUE_ID": node_id}).EXECUTE_NORMALIZED(**inputs).args


def drift_report(patcher, sequence_parallel: bool = False):
    """``nodes.families.drift.check_model`` for a MODEL: its detected family against its diffusion model."""
    family = pack_module("nodes.families").detect(patcher).family
    return pack_module("nodes.families.drift").check_model(family, patcher.model.diffusion_model, sequence_parallel)
