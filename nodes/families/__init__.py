"""The registered model families and detection: from the diffusion model's class and config, never a file name.

Every module of this package other than ``base`` (the shape families share), ``drift`` and ``pass_through`` (the
check, when a run starts, of what the families expect of the loaded model) is a family file defining ``FAMILY`` (a
``ModelFamily``); they are all registered, so adding a family is adding its file (and its tiny test model, see
docs/adding-a-model-family.md). Detection tries the families in ``FAMILIES`` order: by module name, except that a
family's ``detect_before`` puts it ahead of the families it names.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Iterable

import torch
from comfy_api.latest import io

from ._refused import refusal
from .base import AutoChoice, DetectedModel, ModelFamily, UnsupportedModelError, Variant

NOT_FAMILIES = frozenset({"base", "drift", "pass_through"})  # the modules here that are not family files


def order_by_precedence(families: Iterable[ModelFamily]) -> tuple[ModelFamily, ...]:
    """``families`` in their given order, except that each comes before every family its ``detect_before`` names.

    ValueError for a duplicate name, a ``detect_before`` naming no given family, or a precedence cycle.
    """
    given = list(families)
    by_name: dict[str, ModelFamily] = {}
    for family in given:
        if family.name in by_name:
            raise ValueError(f"two model families are named {family.name!r}")
        by_name[family.name] = family
    must_follow: dict[str, set[str]] = {name: set() for name in by_name}  # name -> families that go before it
    for family in given:
        for later in family.detect_before:
            if later not in by_name:
                raise ValueError(f"model family {family.name!r}: detect_before names {later!r}, which is not a "
                                 f"registered family ({', '.join(by_name)})")
            must_follow[later].add(family.name)
    ordered: list[ModelFamily] = []
    placed: set[str] = set()
    while len(ordered) < len(given):
        ready = next((f for f in given if f.name not in placed and must_follow[f.name] <= placed), None)
        if ready is None:
            cycle = sorted(name for name in by_name if name not in placed)
            raise ValueError(f"model families {cycle} have a detect_before cycle")
        ordered.append(ready)
        placed.add(ready.name)
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
    return order_by_precedence(families)


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
    """The detected family, variant and recommendations of a ComfyUI MODEL (ModelPatcher).

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
    for kind, recommendation in variant.recommendations.items():
        declared = family.recommendation_keys.get(kind, frozenset())
        if recommendation.key is not None and recommendation.key not in declared:
            raise RuntimeError(f"model family {family.name!r}: variant {variant.name!r} recommends the {kind} key "
                               f"{recommendation.key!r}, which the family's recommendation_keys[{kind!r}] does not "
                               "list")
    return DetectedModel(model_family=family, variant=variant.name, recommendations=variant.recommendations)


__all__ = ["FAMILIES", "AutoChoice", "DetectedModel", "ModelFamily", "UnsupportedModelError", "Variant", "detect",
           "detect_for_node", "family_named", "model_input", "order_by_precedence", "supported_families"]
