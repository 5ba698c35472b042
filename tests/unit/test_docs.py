"""The README and the package metadata state only what exists, in the repository's own files."""
from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
GENERATED = ("test-artifacts/", ".venv")  # made by ./run, never committed

# feature words a text may use only once a node with this word in its id exists
FEATURES = {"offload": "Offload", "sequence parallel": "SequenceParallel"}


def tracked_files() -> set[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    files = set(out.split())
    return files | {str(Path(f).parent) + "/" for f in files} | {str(p) + "/" for f in files for p in Path(f).parents}


def node_ids() -> set[str]:
    return {m for path in (ROOT / "nodes").rglob("*.py") for m in re.findall(r'NODE_ID = "([^"]+)"', path.read_text())}


def test_readme_links_and_paths_are_files_of_this_repository():
    files = tracked_files()
    links = re.findall(r"\]\(([^)\s]+)\)", README)
    paths = [t for t in re.findall(r"`([^`\s]+)`", README)
             if re.fullmatch(r"[\w.-]+(/[\w.-]*)+|[\w-]+\.(py|md|txt|json|png|js|toml)|LICENSE", t)]
    assert links and paths
    for target in links + paths:
        if target.startswith(("http://", "https://", "#")) or target.startswith(GENERATED):
            continue
        assert ".." not in Path(target).parts, f"README points outside the repository: {target}"
        # a bare name ("stack_cache.py", "adapters/") is one inside the folder the sentence is about
        found = {target, target.rstrip("/"), target + "/"} & files or any(
            f.endswith("/" + target) or f.endswith("/" + target.rstrip("/")) for f in files)
        assert found, f"README names {target}, which is not in the repository"


def test_every_pointer_to_a_readme_section_names_one_that_exists():
    headings = {h.strip() for h in re.findall(r"^#+ (.+)$", README, re.M)}
    sources = [*(ROOT / "tools").glob("*.py"), *(ROOT / "nodes").rglob("*.py"), ROOT / "run", ROOT / ".ci" / "run"]
    pointers = [(p.name, s) for p in sources for s in re.findall(r"README, '([^']+)'", p.read_text())]
    assert pointers, "expected the demo to point to a README section"
    for where, section in pointers:
        assert section in headings, f"{where} points to README section {section!r}, which does not exist"


def test_the_declared_licence_has_its_text_in_the_repository():
    assert PYPROJECT["project"]["license"] == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


@pytest.mark.parametrize("where, text", [
    ("pyproject description", PYPROJECT["project"]["description"]),
    ("pyproject DisplayName", PYPROJECT["tool"]["comfy"]["DisplayName"]),
    ("README", README),
])
def test_features_are_advertised_only_once_their_node_exists(where, text):
    ids = node_ids()
    assert "OmniHooks.ApplyTeaCache" in ids  # the scan finds the nodes
    for word, node_word in FEATURES.items():
        if re.search(word, text, re.I):
            assert any(node_word in i for i in ids), f"{where} advertises {word!r}, but no node does it yet"
