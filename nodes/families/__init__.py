"""The registered model families and detection: from the diffusion model's class and config, never a file name.

Every module of this package other than ``base`` (the shape families share), ``drift`` and ``pass_through`` (the
check, when a run starts, of what the families expect of the loaded model) is a family file defining ``FAMILY`` (a
``ModelFamily``); they are all registered, so adding a family is adding its file (and its tiny test model, see
docs/adding-a-model-family.md). Detection tries the families in ``FAMILIES`` order: by module name, except that a
family's ``detect_before`` puts it ahead of the families it names.
"""
from __future__ import annotations

import graphlib
import importlib
import pkgutil
from typing import Iterable

import torch
from comfy_api.latest import io

from ._refused import refusal
from .base import DEFAULT_SIGNAL, AutoChoice, DetectedModel, ModelFamily, UnsupportedModelError, Variant

NOT_FAMILIES = frozenset({"base", "drift", "pass_through"})  # the modules here that are not family files


def detection_order(families: Iterable[ModelFamily]) -> tuple[ModelFamily, ...]:
    """``families`` in their given order, except that each comes before every family its ``detect_before`` names.

    Deterministic: of the families whose predecessors are placed, the earliest given goes next, so a given order
    that already respects every ``detect_before`` is kept as it is. ValueError for a duplicate name, a
    ``detect_before`` naming no given family, or a precedence cycle (naming the families in it).
    """
    given = list(families)
    position: dict[str, int] = {}
    for index, family in enumerate(given):
        if family.name in position:
            raise ValueError(f"two model families are named {family.name!r}")
        position[family.name] = index
    sorter: graphlib.TopologicalSorter[str] = graphlib.TopologicalSorter()
    for family in given:
        sorter.add(family.name)
        for later in family.detect_before:
            if later not in position:
                raise ValueError(f"model family {family.name!r}: detect_before names {later!r}, which is not a "
                                 f"registered family ({', '.join(position)})")
            sorter.add(later, family.name)
    try:
        sorter.prepare()
    except graphlib.CycleError as e:
        raise ValueError(f"model families {' -> '.join(e.args[1])} have a detect_before cycle") from None
    ordered: list[ModelFamily] = []
    ready: list[str] = []
    while sorter.is_active():
        ready.extend(sorter.get_ready())
        ready.sort(key=position.__getitem__)
        name = ready.pop(0)
        ordered.append(given[position[name]])
        sorter.done(name)
    return tuple(ordered)


def _discover() -> tuple[ModelFamily, ...]:
    families = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name in NOT_FAMILIES or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        family = getattr(module, "FAMILY", None)
        if not isinstance(family, ModelFamily):
            raise TypeError(f"nodes/families/{info.name}.py must define FAMILY = ModelFamily(...)")
        families.append(family)
    return detection_order(families)


#: Every registered family, in detection order.
FAMILIES: tuple[ModelFamily, ...] = _discover()


def supported_families() -> str:
    """The registered families as users read them, e.g. for errors and tooltips: "Chroma, Flux (dev, ...), ..."."""
    return ", ".join(family.display_name for family in FAMILIES)


def family_named(name: str) -> ModelFamily:
    """The registered family called ``name``; KeyError otherwise."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise KeyError(f"no registered model family {name!r} (registered: {', '.join(f.name for f in FAMILIES)})")


def detect(patcher) -> DetectedModel:
    """The detected family, variant and auto choices of a ComfyUI MODEL (ModelPatcher).

    UnsupportedModelError naming the model's class and the supported families when no family matches.
    """
    base_model = patcher.model
    dm = getattr(base_model, "diffusion_model", None)
    if isinstance(dm, torch.nn.Module):
        for family in FAMILIES:
            if family.matches(base_model, dm):
                return _detected(family, family.resolve_variant(base_model, dm))
    name = type(dm).__name__ if dm is not None else type(base_model).__name__
    why = refusal(base_model)
    raise UnsupportedModelError(
        f"{name} ({type(base_model).__name__}) is not a diffusion transformer this pack supports"
        f"{f': {why}' if why else ''}. Supported families: {supported_families()}.")


def detect_for_node(node_title: str, model) -> DetectedModel:
    """``detect(model)`` for a node's execute: an unsupported model is a ValueError whose message starts with the
    node's title."""
    try:
        return detect(model)
    except UnsupportedModelError as e:
        raise ValueError(f"{node_title}: {e}") from None


def model_input(extra: str = "") -> io.Model.Input:
    """The ``model`` input of a node that patches a diffusion-transformer MODEL, with the supported families."""
    return io.Model.Input("model", tooltip=f"A diffusion-transformer MODEL ({supported_families()}).{extra}")


def _detected(family: ModelFamily, variant: Variant) -> DetectedModel:
    for kind, choice in variant.auto_choices.items():
        declared = family.auto_keys.get(kind, frozenset())
        if choice.key is not None and choice.key not in declared:
            raise RuntimeError(f"model family {family.name!r}: variant {variant.name!r} recommends the {kind} key "
                               f"{choice.key!r}, which the family's auto_keys[{kind!r}] does not "
                               "list")
    if variant.otherwise.key is not None:
        raise RuntimeError(f"model family {family.name!r}: variant {variant.name!r} recommends the key "
                           f"{variant.otherwise.key!r} for every cache; a key belongs to one cache's table")
    return DetectedModel(family=family, variant=variant.name, auto_choices=variant.auto_choices,
                         otherwise=variant.otherwise)


__all__ = ["DEFAULT_SIGNAL", "FAMILIES", "AutoChoice", "DetectedModel", "ModelFamily", "UnsupportedModelError",
           "Variant", "detect", "detect_for_node", "detection_order", "family_named", "model_input",
           "supported_families"]
