"""MagCache strategies: how one model family maps to a ``BlockStack``, with its published curve and defaults.

vllm-omni keys its strategies (``FluxMagCacheStrategy``, ...) by transformer class; so does this registry, by class
name (``register_strategy("FluxTransformer2DModel", strategy)``), so that ``apply_mag_cache_hook(module, config)``
finds the strategy of a registered model class. omni_hooks itself knows no model: hosts register theirs. (The
ComfyUI node layer passes its strategy explicitly instead, because there the class alone cannot tell variants apart,
e.g. Wan 2.1 and Wan 2.2 TI2V share ``WanModel``.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from ..blockstack import BlockStack
from .config import MagCacheConfig


@dataclass
class MagCacheStrategy:
    """One model family for MagCache.

    ``build_stack(module)`` returns the module's ``BlockStack``. ``mag_ratios`` (flat, CFG-interleaved with
    ``interleaved=True``, or per branch) is the published curve, None when there is none; ``defaults`` are
    recommended ``MagCacheConfig`` fields (e.g. ``{"threshold": 0.24, "max_skip_steps": 5}``) and ``source`` says where
    curve and defaults come from.
    """

    name: str
    build_stack: Callable[[torch.nn.Module], BlockStack]
    mag_ratios: Sequence[float] | Mapping[str, Sequence[float]] | None = None
    interleaved: bool = False
    defaults: Mapping[str, Any] | None = None
    source: str = ""

    def config(self, **overrides: Any) -> MagCacheConfig:
        """A ``MagCacheConfig`` with this strategy's curve and defaults, ``overrides`` taking precedence."""
        fields: dict[str, Any] = dict(self.defaults or {})
        if self.mag_ratios is not None:
            fields.setdefault("mag_ratios", self.mag_ratios)
            fields.setdefault("interleaved", self.interleaved)
        fields.update(overrides)
        return MagCacheConfig(**fields)


_REGISTRY: dict[str, MagCacheStrategy] = {}


def register_strategy(model_class: type | str, strategy: MagCacheStrategy, replace: bool = False) -> None:
    """Make ``strategy`` the one for modules of ``model_class`` (a class or its name)."""
    name = model_class if isinstance(model_class, str) else model_class.__name__
    if name in _REGISTRY and not replace and _REGISTRY[name] is not strategy:
        raise ValueError(f"a MagCache strategy is already registered for {name!r} ({_REGISTRY[name].name}); "
                         f"pass replace=True to replace it")
    _REGISTRY[name] = strategy


def unregister_strategy(model_class: type | str) -> None:
    _REGISTRY.pop(model_class if isinstance(model_class, str) else model_class.__name__, None)


def registered_strategies() -> list[str]:
    """The registered model class names, sorted."""
    return sorted(_REGISTRY)


def get_strategy(module: torch.nn.Module) -> MagCacheStrategy:
    """The strategy registered for ``module``'s class or its nearest registered base class."""
    for cls in type(module).__mro__:
        found = _REGISTRY.get(cls.__name__)
        if found is not None:
            return found
    registered = ", ".join(registered_strategies()) or "none"
    raise ValueError(f"no MagCache strategy is registered for {type(module).__name__}; registered model classes: "
                     f"{registered}. Pass strategy= to apply_mag_cache_hook, or register_strategy() one.")
