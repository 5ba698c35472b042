"""docs/model-support.md against ComfyUI and the registry: every class ComfyUI loads is in the table, supported by a
registered family or refused with the reason detection gives; the supported-families list there (which the README's
list of supported models repeats) is the registry's; each tiny model's ComfyUI class is in the table under its family.
"""
from __future__ import annotations

import re

import pytest

from omnitest.comfy_path import PACK_ROOT
from omnitest.tiny_models import CASES

pytestmark = pytest.mark.host

DOC = PACK_ROOT / "docs" / "model-support.md"


def _section(title: str) -> str:
    text = DOC.read_text(encoding="utf-8")
    return text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def _row_list(title: str) -> list[tuple[str, list[str]]]:
    rows = []
    for line in _section(title).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        match = re.fullmatch(r"`(\w+)`", cells[0]) if line.startswith("|") else None
        if match:
            rows.append((match.group(1), cells[1:]))
    return rows


def _rows(title: str) -> dict[str, list[str]]:
    return dict(_row_list(title))


@pytest.fixture(scope="module")
def families():
    from omnitest.pack import pack_module

    return pack_module("nodes.families")


def test_every_class_comfyui_loads_is_in_the_table_once():
    import comfy.supported_models

    loaded = {cls.__name__ for cls in comfy.supported_models.models}
    named = [name for title in ("Supported", "Refused") for name, _cells in _row_list(title)]
    assert sorted(name for name in set(named) if named.count(name) > 1) == []
    # the table is written for the newest ComfyUI of the matrix; an older ComfyUI loads a subset of it
    assert sorted(loaded - set(named)) == []


def test_supported_rows_name_registered_families_and_their_sequence_plans(families):
    registered = {f.name: f for f in families.FAMILIES}
    rows = _rows("Supported")
    named = set()
    for name, (_model, family, teacache, magcache, parallel) in rows.items():
        family = family.strip("`")
        assert family in registered, (name, family)
        assert {teacache, magcache} <= {"published", "calibrate"}, name
        assert parallel == ("yes" if registered[family].sequence_plan is not None else "no"), name
        named.add(family)
    assert named == registered.keys()


def test_refused_rows_give_the_reason_detection_gives(families):
    from omnitest.pack import pack_module

    refused = pack_module("nodes.families._refused").REFUSED
    rows = _rows("Refused")
    assert rows.keys() == refused.keys()
    for name, (why,) in rows.items():
        assert refused[name].startswith(why), (name, refused[name])


def test_a_refused_model_is_refused_with_its_reason(families):
    from omnitest.meta_models import build_on_meta
    from omnitest.pack import pack_module

    refused = pack_module("nodes.families._refused").REFUSED
    chroma_radiance = {
        "image_model": "chroma_radiance", "in_channels": 3, "out_channels": 3, "patch_size": 16, "context_in_dim": 64,
        "hidden_size": 64, "mlp_ratio": 4.0, "num_heads": 2, "depth": 1, "depth_single_blocks": 1,
        "axes_dim": [8, 12, 12], "theta": 10000, "qkv_bias": True, "in_dim": 64, "out_dim": 64, "hidden_dim": 32,
        "n_layers": 1, "nerf_hidden_size": 64, "nerf_mlp_ratio": 4, "nerf_depth": 2, "nerf_max_freqs": 8,
        "nerf_tile_size": 32, "nerf_final_head_type": "linear", "nerf_embedder_dtype": None}
    with pytest.raises(families.UnsupportedModelError) as error:
        families.detect(build_on_meta(chroma_radiance))
    assert refused["ChromaRadiance"] in str(error.value)
    assert all(f.display_name in str(error.value) for f in families.FAMILIES)


@pytest.mark.parametrize("name", CASES)
def test_each_tiny_models_class_is_supported_by_its_family(name):
    from omnitest import tiny_models

    case = tiny_models.build_case(name)
    rows = _rows("Supported")
    config_name = type(case.patcher.model.model_config).__name__
    assert rows[config_name][1] == f"`{case.family}`" or (name == "z_image" and rows["ZImage"][1] == "`z_image`")


def test_the_supported_families_list_is_the_registry_and_the_readme_repeats_it(families):
    listed = [line[2:].strip() for line in _section("The supported families").splitlines() if line.startswith("- ")]
    assert listed == [f.display_name for f in families.FAMILIES]
    readme = (PACK_ROOT / "README.md").read_text(encoding="utf-8")
    assert [name for name in listed if name not in readme] == [], "README.md's list of supported models"
