"""The README and the package metadata state only what exists, in the repository's own files."""
from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
GENERATED = ("test-artifacts/", ".venv", ".hosts")  # made by ./run, never committed

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



@pytest.mark.parametrize("where", ["description", "DisplayName"])
def test_the_package_metadata_names_every_feature_the_nodes_offer(where):
    text = PYPROJECT["project"]["description"] if where == "description" else PYPROJECT["tool"]["comfy"]["DisplayName"]
    offered = {"TeaCache": "ApplyTeaCache", "MagCache": "ApplyMagCache", "CPU Offload": "CPUOffload",
               "Sequence Parallel": "SequenceParallel"}
    ids = node_ids()
    assert all(f"OmniHooks.{node}" in ids for node in offered.values())  # each feature is a node of this pack
    assert [feature for feature in offered if feature not in text] == []

# What the repository's own text may cite. It is read without our tracker and without the machine it was written on,
# so it never points at either:
#   * no file outside the repository (a relative path climbing out of it, the development machine's folders, the
#     reference notes the work started from);
#   * no issue of our own: the words "issue"/"issues" do not occur (outside a URL), and no "§" section sign points at a
#     document that is not here. What the code cites as its design is in docs/design.md.
# Another project's issue or pull request is a fact with its source and stays: it is written "<project> #N" or
# "<project> PR #N" (vllm-omni #6180, WanVideoWrapper #1375, ali-vilab/TeaCache#72, ComfyUI PR #10783), so a "#N"
# after a whitespace or "(" must follow a project's name -- a token with a capital letter, "-", "/" or "." that is not
# this pack's name -- or be a ComfyUI node id ("node #7" or "· #30"). Colours, HTML entities and ids inside strings
# ("#232", "&#39;") do not follow a space or "(" and are not citations.
REFERENCE_SUFFIXES = {".py", ".md", ".js", ".mjs", ".json", ".toml", ".txt", ".sh", ".yml", ".yaml", ".cfg", ".ini"}
REFERENCE_SKIP = (".venv/", ".hosts/", ".git/", "test-artifacts/")
# The one path outside the repository that is no citation: the folder where CI finds its copies of the newest and the
# oldest tested ComfyUI, beside the checkout (.ci/run; OMNIHOOKS_NEWEST_COMFYUI / OMNIHOOKS_OLDEST_COMFYUI override it).
CI_HOST_PATH = (".ci/run", "../shared/hosts")
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()  # states the rules, so it spells what it forbids
FORBIDDEN_REFERENCES = {
    r"\.\./shared|\bshared/(reference|seeds)\b|(?<![\w~.])/(work|root|home)/": "a file outside the repository",
    r"hook-library-spec|sp-offload-anchors|\banchors\.md|\bcoefficients\.json|host-integration\.md":
        "a reference note that is not in the repository",
    r"(?<![/\w])issues?\b": "an issue of our tracker (cite another project's as '<project> #N')",
    r"§": "a section of a document that is not in the repository",
}
CITATION = re.compile(r"(?:(?<=\s)|(?<=\()|^)#\d+\b", re.M)
OUR_NAME = re.compile(r"omni-?hooks", re.I)


def repository_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    names = [n for n in out.splitlines() if not n.startswith(REFERENCE_SKIP) and n != THIS_FILE]
    return [ROOT / n for n in names
            if (Path(n).suffix in REFERENCE_SUFFIXES or n in ("run", ".ci/run")) and (ROOT / n).is_file()]


def uncited_numbers(text: str) -> list[str]:
    """Each ``#N`` that follows a space or "(" but no project's name, with what precedes it."""
    found = []
    for match in CITATION.finditer(text):
        before = text[:match.start()].split()
        if before and not re.search(r"[\w(]", before[-1]):
            continue  # after a separator ("· #30"): a node's number in a title, not a citation
        words = [w for token in before[-2:] for w in re.findall(r"[\w./-]+", token)]  # without quotes, parens, escapes
        if words[-1:] == ["PR"]:
            words.pop()
        word = words[-1] if words else ""
        names_a_project = bool(re.search(r"[A-Z/.-]", word)) and not OUR_NAME.search(word)
        if word != "node" and not names_a_project:
            found.append(f"{word} {match.group()}".strip())
    return found


def test_the_rule_on_citations_tells_another_projects_numbers_from_ours():
    allowed = ("vllm-omni #6180", "(vllm-omni PR #1223)", "(WanVideoWrapper #1375)", "ali-vilab/TeaCache#72",
               "ComfyUI-TeaCache #189", "(node #7)", '"color": "#232"', "&#39;", "· #30")
    assert [t for t in allowed if uncited_numbers(t)] == []
    ours = ("fixed in #6228", "(#12)", "#9 covers it", "post PR #2689", "ComfyUI-OmniHooks #3", "MAX, #7905")
    assert [t for t in ours if not uncited_numbers(t)] == ["MAX, #7905"]  # a capitalised word passes for a name
    for pattern in ("issue 9", "(issue 9)", "Issues 10 and 11", "the issue's", "spec §7.3", "../shared/x.json"):
        assert any(re.search(p, pattern, re.I) for p in FORBIDDEN_REFERENCES), pattern
    assert not any(re.search(p, "https://github.com/x/y/issues or copies issued", re.I) for p in FORBIDDEN_REFERENCES)


def test_no_text_in_the_repository_cites_our_issues_or_files_outside_it():
    files = repository_text_files()
    assert any(f.name == "README.md" for f in files) and any(f.suffix == ".json" for f in files)
    problems = []
    for path in files:
        text = path.read_text(errors="replace")
        name = path.relative_to(ROOT).as_posix()
        if name == CI_HOST_PATH[0]:
            text = text.replace(CI_HOST_PATH[1], "")
        for pattern, what in FORBIDDEN_REFERENCES.items():
            for match in re.finditer(pattern, text, re.I):
                line = text.count("\n", 0, match.start()) + 1
                problems.append(f"{name}:{line}: {match.group()!r} cites {what}")
        problems += [f"{name}: {n!r} cites a number without its project" for n in uncited_numbers(text)]
    assert problems == [], "\n".join(problems)


def test_every_link_of_the_docs_folder_is_a_file_of_this_repository():
    files = tracked_files()
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert pages
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            assert not target.startswith(("http://", "https://")), f"{page.name} links outside the repository: {target}"
            path = target.split("#")[0]
            if not path:
                continue
            resolved = os.path.normpath((page.parent / path).relative_to(ROOT).as_posix())
            assert not resolved.startswith(".."), f"{page.name} points outside the repository: {target}"
            assert resolved in files or resolved + "/" in files, f"{page.name} links {target}, which is not here"


def test_every_pointer_into_docs_names_a_section_that_exists():
    pointers = [(path, page, section) for path in repository_text_files()
                for page, section in re.findall(r'(docs/[\w-]+\.md), "([^"]+)"', path.read_text(errors="replace"))]
    assert pointers, "expected the code to point into docs/design.md"
    for path, page, section in pointers:
        assert (ROOT / page).is_file(), f"{path.relative_to(ROOT)} points to {page}, which does not exist"
        headings = {h.strip() for h in re.findall(r"^#+ (.+)$", (ROOT / page).read_text(), re.M)}
        assert section in headings, f"{path.relative_to(ROOT)} points to {page}, {section!r}, which is not a heading"


def test_the_readme_stays_a_users_page_under_2500_words():
    # what a user needs on one page; the rest lives in docs/ (nodes, testing, design, benchmarks)
    assert len(README.split()) < 2500


def test_the_docs_name_machines_and_hosts_not_who_had_what():
    texts = {p.name: p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]}
    assert not [name for name, text in texts.items() if re.search(r"this task|was lent", text)]


def test_nodes_keeps_only_what_every_feature_shares_at_its_top_level():
    # the run lifecycle (features, and what its sampler does: samplers), the statistics store and the registration;
    # everything else lives in a feature's folder (caches, offload, sequence_parallel) or with the families
    top = sorted(p.name for p in (ROOT / "nodes").glob("*.py") if p.name != "__init__.py")
    assert top == ["extension.py", "features.py", "samplers.py", "stats_store.py"], top


def design_task(title: str) -> str:
    """The text of docs/design.md's section ``## <title>`` (up to the next section)."""
    text = (ROOT / "docs" / "design.md").read_text()
    found = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", text, re.M | re.S)
    assert found, f"docs/design.md has no section '{title}'"
    return found.group(1)


@pytest.mark.parametrize("task", ["Adding a cache", "Adding a forecast", "Adding a step rule",
                                  "Adding a model family"])
def test_each_tasks_list_of_files_names_files_of_this_repository(task):
    files = tracked_files()
    paths = [t for t in re.findall(r"`([^`\s]+)`", design_task(task))
             if re.fullmatch(r"[\w.-]+(/[\w.<>-]*)+", t) and "<" not in t]
    assert paths, task
    missing = [p for p in paths if p not in files]
    assert not missing, f"design.md, '{task}', names what is not in the repository: {missing}"


def test_a_new_caches_list_holds_every_module_that_names_each_cache():
    # a module outside the caches' own that imports every cache's node module, or holds every cache's Apply node id,
    # gets a line for a new cache too
    listed = set(re.findall(r"`([\w./-]+)`", design_task("Adding a cache")))
    caches = sorted(p.stem for p in (ROOT / "nodes" / "caches").glob("*.py") if re.search(
        r'^NODE_ID = "', p.read_text(), re.M))
    ids = [re.search(r'^NODE_ID = "(.*?)"$', (ROOT / "nodes" / "caches" / f"{c}.py").read_text(), re.M).group(1)
           for c in caches]
    naming = set()
    for path in [*(ROOT / "nodes").rglob("*.py"), *(ROOT / "web").glob("*.js")]:
        where = path.relative_to(ROOT).as_posix()
        if where.startswith("nodes/caches/"):
            continue
        text = path.read_text()
        imports = [m for line in re.findall(r"^from \.+caches(?:\.\w+)? import .*$", text, re.M)
                   for m in re.findall(r"\w+", line.split("import", 1)[1])]
        if all(c in imports or f"caches.{c}" in text for c in caches) or all(i in text for i in ids):
            naming.add(where)
    assert len(caches) >= 2 and {"nodes/extension.py", "web/omni_hooks_stats.js"} <= naming
    assert naming <= listed, f"name every cache but are not in design.md's 'Adding a cache': {naming - listed}"
