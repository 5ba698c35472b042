"""Three forecasting node packs other ComfyUI users install, as the quality benchmark runs them (never part of this
repository: they are fetched beside it, loaded the way ComfyUI loads a custom node, and only run).

Each ``ForecastingPack`` names the pack's repository and the commit it was measured at, its licence, the node it is
run through and the sweep of that node's knobs at a step count. ``load_node`` imports a pack from the folder the
user fetched it into (``--packs``); ``apply_node`` runs its node on a MODEL as ComfyUI's executor would, with the
pack's own printing silenced.

Fetch them (the folder names matter, the location is yours)::

    git clone https://github.com/philipy1219/ComfyUI-TaylorSeer PACKS/ComfyUI-TaylorSeer
    git clone https://github.com/judian17/ComfyUI-Spectrum PACKS/ComfyUI-Spectrum
    git clone https://github.com/xmarre/ComfyUI-Spectrum-WAN-Proper PACKS/ComfyUI-Spectrum-WAN-Proper

(``git -C PACKS/<folder> checkout <commit>`` gives the measured version.)
"""
from __future__ import annotations

import contextlib
import importlib.util
import io as text_io
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


@dataclass(frozen=True)
class ForecastingPack:
    """One pack: where it comes from, the node the benchmark runs and the settings it sweeps.

    ``settings(steps)`` lists the knob values swept at ``steps`` sampler steps, each a dict of the node's inputs
    (all but ``model``); ``label(setting)`` says one in a few words. ``leaves_state_on_model``: the pack's node
    changes the shared model so that later runs of other clones still use it, so the benchmark runs it on a model
    of its own.
    """

    name: str
    repository: str
    commit: str
    licence: str
    folder: str
    node: str
    settings: Callable[[int], list[dict[str, Any]]]
    label: Callable[[dict[str, Any]], str]
    leaves_state_on_model: bool = False

    def clone_command(self, packs: Path) -> str:
        return (f"git clone https://github.com/{self.repository} {packs / self.folder} && "
                f"git -C {packs / self.folder} checkout {self.commit}")


def grid(**axes: list) -> list[dict[str, Any]]:
    """Every combination of the axes' values, as dicts."""
    names = list(axes)
    return [dict(zip(names, values)) for values in itertools.product(*axes.values())]


def taylorseer_settings(steps: int) -> list[dict[str, Any]]:
    """TaylorSeerLite: refresh interval, Taylor order, the first steps and (``last_enhance``) the last steps computed.
    ``last_enhance`` L computes every step from L - 1 on: ``steps`` computes the last step, ``steps - 2`` the last
    three, 50 (its default) none at these step counts."""
    if steps <= 10:
        return grid(fresh_threshold=[3, 4, 5], max_order=[1, 2], first_enhance=[1, 2, 3], last_enhance=[steps, 50])
    return grid(fresh_threshold=[3, 4, 5, 6, 7], max_order=[1, 2], first_enhance=[1, 3],
                last_enhance=[steps - 2, steps, 50])


def taylorseer_label(s: dict[str, Any]) -> str:
    return (f"fresh {s['fresh_threshold']}, order {s['max_order']}, first {s['first_enhance']}, "
            f"last_enhance {s['last_enhance']}")


SPECTRUM_FIXED = {"w": 0.5, "M": 4, "lam": 0.1, "max_w": 0.8, "verbose": False}


def spectrum_settings(steps: int) -> list[dict[str, Any]]:
    """Spectrum: the skip interval (``window_size``), how fast it grows (``flex_window``) and the warm-up steps;
    its blend, degree and ridge weight at their defaults."""
    if steps <= 10:
        axes = grid(window_size=[2.0, 3.0], flex_window=[0.0, 0.5], warmup_steps=[1, 2, 3])
    else:
        axes = grid(window_size=[2.0, 3.0, 4.0, 6.0], flex_window=[0.0, 0.25, 0.5, 0.75, 1.5], warmup_steps=[1, 3])
    return [{**SPECTRUM_FIXED, **s} for s in axes]


def spectrum_label(s: dict[str, Any]) -> str:
    return f"window {s['window_size']:g}, flex {s['flex_window']:g}, warmup {s['warmup_steps']}"


SPECTRUM_WAN_FIXED = {"backend": "auto", "transition_mode": "separate_fit", "enabled": True, "blend_weight": 1.0,
                      "degree": 4, "ridge_lambda": 0.1, "history_size": 16, "debug": False,
                      "forecaster_cache_mode": "legacy_dense_coeff"}


def spectrum_wan_settings(steps: int) -> list[dict[str, Any]]:
    """Spectrum Apply WAN: the same three knobs as Spectrum (its warm-up default is 5); the rest at their defaults."""
    if steps <= 10:
        axes = grid(window_size=[2.0, 3.0], flex_window=[0.0, 0.5], warmup_steps=[1, 2, 3])
    else:
        axes = grid(window_size=[2.0, 3.0, 4.0, 6.0], flex_window=[0.0, 0.25, 0.5, 0.75, 1.5], warmup_steps=[3, 5])
    return [{**SPECTRUM_WAN_FIXED, **s} for s in axes]


PACKS = (
    ForecastingPack("TaylorSeerLite", "philipy1219/ComfyUI-TaylorSeer", "62d9faca627314eda6d3ed08a756d08e44643643",
                    "GPL-3.0", "ComfyUI-TaylorSeer", "TaylorSeerLite",
                    lambda steps: [{"model_type": "wanvideo", **s} for s in taylorseer_settings(steps)],
                    taylorseer_label),
    ForecastingPack("Spectrum", "judian17/ComfyUI-Spectrum", "fb1ca5864f6fa0be80a63d076987c4dc5a9c6d78", "MIT",
                    "ComfyUI-Spectrum", "Spectrum", spectrum_settings, spectrum_label),
    ForecastingPack("Spectrum-WAN-Proper", "xmarre/ComfyUI-Spectrum-WAN-Proper",
                    "42de04b16c1aa54abef48e2a447927e152f2a60a", "GPL-3.0", "ComfyUI-Spectrum-WAN-Proper",
                    "SpectrumApplyWAN", spectrum_wan_settings, spectrum_label, leaves_state_on_model=True),
)


class PackMissing(RuntimeError):
    """A pack is not in the packs folder (the message says how to fetch it)."""


def load_node(packs: Path, pack: ForecastingPack) -> type:
    """The node class ``pack.node`` of the pack fetched into ``packs / pack.folder``, imported as ComfyUI imports a
    custom node (a package from its folder). PackMissing with the command that fetches it."""
    folder = packs / pack.folder
    if not (folder / "__init__.py").is_file():
        raise PackMissing(f"{pack.name} is not at {folder}; fetch it with:\n  {pack.clone_command(packs)}")
    module_name = "forecasting_pack_" + pack.folder.replace("-", "_").lower()
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        with contextlib.redirect_stdout(text_io.StringIO()):
            spec.loader.exec_module(module)
    mappings = getattr(module, "NODE_CLASS_MAPPINGS", {})
    if pack.node not in mappings:
        raise PackMissing(f"{pack.name} at {folder} has no node {pack.node!r} (it has {sorted(mappings)}); check out "
                          f"the measured commit: git -C {folder} checkout {pack.commit}")
    return mappings[pack.node]


def apply_node(node_cls: type, model, setting: dict[str, Any]):
    """``node_cls`` run on ``model`` with ``setting`` as ComfyUI's executor runs it (a V3 node through its class
    clone, a V1 node through its FUNCTION); returns its MODEL. What the pack prints is dropped."""
    with contextlib.redirect_stdout(text_io.StringIO()):
        if hasattr(node_cls, "define_schema"):
            from omnitest.pack import run_node
            return run_node(node_cls, model=model, **setting)[0]
        return getattr(node_cls(), node_cls.FUNCTION)(model=model, **setting)[0]


@contextlib.contextmanager
def quiet():
    """Drop what the packs print while they sample (per-step logs)."""
    with contextlib.redirect_stdout(text_io.StringIO()):
        yield
