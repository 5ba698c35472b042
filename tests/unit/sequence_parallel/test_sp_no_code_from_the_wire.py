"""Sequence Parallel's code reads what other processes send as data only: no unpickling, no ``torch.load`` that may
unpickle, no ``eval``/``exec``, and no call that does not exist on Windows or macOS (``socket.sendmsg``,
``select.poll``) or signals a process id (``os.kill`` on Windows ends the process)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
FOLDERS = [ROOT / "nodes" / "sequence_parallel", ROOT / "omni_hooks" / "sequence_parallel"]
SOURCES = sorted(p for folder in FOLDERS for p in folder.glob("*.py"))


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _findings(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
            found += [f"import {n}" for n in names if n and n.split(".")[0] in ("pickle", "marshal", "dill", "shelve")]
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name in ("eval", "exec", "compile", "os.kill", "select.poll") or name.endswith(
                    (".sendmsg", ".recvmsg", "pickle.loads", "pickle.load", "Unpickler", "broadcast_object_list",
                     "recv_object_list", "all_gather_object", "gather_object", "scatter_object_list")):
                found.append(name)
            if name.endswith("torch.load"):
                safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                           for k in node.keywords)
                if not safe:
                    found.append(name + " without weights_only=True")
    return found


def test_the_scan_finds_what_it_looks_for():
    source = ("import pickle\nfrom pickle import loads\nx = pickle.loads(b'')\neval('1')\ntorch.load(f)\n"
              "torch.load(f, weights_only=True)\nsock.sendmsg([b''])\nselect.poll()\nos.kill(1, 0)\n"
              "dist.broadcast_object_list([None])\n")
    assert _findings(source) == ["import pickle", "import pickle", "pickle.loads", "eval", "torch.load without "
                                 "weights_only=True", "sock.sendmsg", "select.poll", "os.kill",
                                 "dist.broadcast_object_list"]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: f"{p.parent.parent.name}/{p.parent.name}/{p.name}")
def test_no_sequence_parallel_module_unpickles_evaluates_or_calls_what_windows_lacks(path):
    assert _findings(path.read_text(encoding="utf-8")) == []


def test_the_scan_covers_the_modules_that_read_the_wire():
    names = {p.name for p in SOURCES}
    assert {"protocol.py", "control.py", "worker.py", "rank.py", "group.py", "plain.py", "trust.py", "comm.py"} <= names
    assert not (ROOT / "omni_hooks" / "sequence_parallel" / "links.py").exists()
