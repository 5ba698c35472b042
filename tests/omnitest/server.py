"""Drive a real ComfyUI server on loopback, out of process (this module never imports comfy).

``ComfyServer`` prepares a base directory::

    <base>/custom_nodes/ComfyUI-OmniHooks -> the pack (symlink to the repository root)
    <base>/custom_nodes/omni_test_nodes   -> tests/server/omni_test_nodes (test-only nodes, symlink)
    <base>/models/diffusion_models/tiny_wan.safetensors   (omnitest.tiny_wan)
    <base>/user/comfyui.db, <base>/output/..., <base>/logs/server-<n>.log

and runs ``<sys.executable> main.py --cpu --listen 127.0.0.1 --port <free port> --base-directory <base>
--disable-api-nodes`` (+ ``--database-url`` in the base dir, so nothing is written into the checkout's user/, and
``OMP_NUM_THREADS=1`` unless ``threads=None``) from the ComfyUI checkout. Startup waits for
``GET /system_stats``; every failure message carries the tail of the server log. The process is always stopped:
``stop()``/``close()``/``with``, an ``atexit`` hook, and on Linux ``PR_SET_PDEATHSIG`` (the server gets SIGTERM if the
test process dies).

``ComfyClient`` is a small HTTP + websocket client: ``queue(prompt) -> prompt_id`` (``PromptRejected`` on HTTP 400),
``wait(prompt_id) -> RunResult`` (every websocket message of the run + ``/history``), ``run(prompt)`` (both),
``interrupt()``, ``object_info()``, ``get()/post()``, ``free()``, ``read_latent()``.
"""
from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import requests
import websocket

from omnitest.comfy_path import PACK_ROOT, comfyui_path

HOST = "127.0.0.1"
PACK_DIR_NAME = "ComfyUI-OmniHooks"
TEST_PACK_DIR_NAME = "omni_test_nodes"
TINY_WAN_NAME = "tiny_wan.safetensors"
TERMINAL_EVENTS = ("execution_success", "execution_error", "execution_interrupted")


def _find_pack_root() -> Path:
    """The repository root (the folder holding the pack's __init__.py and pyproject.toml), at or above PACK_ROOT."""
    for candidate in (PACK_ROOT, *PACK_ROOT.parents):
        if (candidate / "__init__.py").is_file() and (candidate / "pyproject.toml").is_file():
            return candidate
    raise RuntimeError(f"cannot find the pack root (a folder with __init__.py and pyproject.toml) at or above "
                       f"{PACK_ROOT}")


REPO_ROOT = _find_pack_root()
TEST_PACK_SOURCE = REPO_ROOT / "tests" / "server" / TEST_PACK_DIR_NAME


# --------------------------------------------------------------------------------------------------- errors

class ServerError(RuntimeError):
    """The server did not start, died, or did not answer; the message ends with the tail of its log."""


class PromptRejected(RuntimeError):
    """``POST /prompt`` answered 400: ``error`` is the server's ``error`` dict, ``node_errors`` its ``node_errors``."""

    def __init__(self, status: int, body: Any):
        self.status = status
        self.body = body
        self.error = body.get("error", {}) if isinstance(body, dict) else {}
        self.node_errors = body.get("node_errors", {}) if isinstance(body, dict) else {}
        super().__init__(f"prompt rejected (HTTP {status}): {json.dumps(body, indent=1)[:4000]}")


@dataclass
class NodeError:
    """How the server refused a prompt for one node's input. ``rejected``: at ``/prompt``, by validation (newer
    ComfyUI checks a combo value against its options there; ``message`` is the details, one line per error,
    ``validation`` the (error type, input name, received value) of each); else an ``execution_error`` while running
    the node (``message`` is its exception message, ``result`` the run)."""
    node_id: str | None
    node_type: str | None
    message: str
    rejected: bool
    validation: list[tuple] = field(default_factory=list)
    result: "RunResult | None" = None

    def assert_nothing_ran_after(self, node_id: str) -> None:
        """A rejected prompt runs nothing; an execution error stops before ``node_id`` and saves no file."""
        if self.result is not None:
            assert node_id not in self.result.executed_nodes and not self.result.output_files(), \
                f"node {node_id} ran after the error"


def assert_clear_node_error(error: NodeError, node_id: str, node_type: str, title: str, changed: Mapping[str, Any],
                            fragments: Iterable[str], why_not_offered: str | None = None) -> None:
    """``error`` names the node and the fix. An execution error: its message starts with the node's ``title`` and
    holds every fragment. Rejected at /prompt: only the ``changed`` inputs, each a value not in the node's options,
    named with its value; where that value is a file the pack did not offer, ``why_not_offered`` (the pack's log
    line saying why) holds every fragment."""
    assert (error.node_id, error.node_type) == (node_id, node_type), error
    fragments = list(fragments)
    if error.rejected:
        assert error.validation, error
        for kind, name, value in error.validation:
            assert kind == "value_not_in_list" and name in changed and value == changed[name], error
            assert f"{name}: " in error.message and str(value) in error.message, error.message
        text = why_not_offered
        if text is None:
            return
    else:
        assert error.message.startswith(title), error.message
        text = error.message
    missing = [f for f in fragments if f not in text]
    assert not missing, f"{missing} not in {text!r}"


class PromptFailed(RuntimeError):
    """A queued prompt ended with ``execution_error`` or ``execution_interrupted`` (raised by ``run(check=True)``)."""

    def __init__(self, result: "RunResult", log_tail: str = ""):
        self.result = result
        detail = result.error or {}
        msg = (f"prompt {result.prompt_id} ended with status {result.status!r}: "
               f"{detail.get('node_type', '')} #{detail.get('node_id', '')}: {detail.get('exception_type', '')}: "
               f"{detail.get('exception_message', '')}\n{''.join(detail.get('traceback', []) or [])}")
        if log_tail:
            msg += f"\n--- server log tail ---\n{log_tail}"
        super().__init__(msg)


# --------------------------------------------------------------------------------------------------- helpers

def free_port(host: str = HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def read_latent(path: str | os.PathLike) -> "torch.Tensor":  # noqa: F821
    """The ``latent_tensor`` of a ``.latent`` file written by core ``SaveLatent`` (a safetensors file)."""
    from safetensors.torch import load_file
    return load_file(str(path))["latent_tensor"]


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


_LIVE_SERVERS: "set[ComfyServer]" = set()


@atexit.register
def _stop_all_servers() -> None:
    for server in list(_LIVE_SERVERS):
        try:
            server.stop()
        except Exception:
            pass


# --------------------------------------------------------------------------------------------------- server

class ComfyServer:
    """A real ComfyUI server process on loopback with a prepared base directory.

    ``with ComfyServer() as server: client = server.client(); client.run(prompt)``.
    ``restart()`` stops and starts the process on the same base directory and port (clients keep working; their
    websocket reconnects on the next ``queue``).
    """

    def __init__(self, base_dir: str | os.PathLike | None = None, *, comfy_root: str | os.PathLike | None = None,
                 port: int | None = None, extra_args: Iterable[str] = (),
                 custom_nodes: Mapping[str, str | os.PathLike] | None = None,
                 tiny_wan_blocks: int = 2, startup_timeout: float = 120.0, threads: int | None = 1,
                 python: str = sys.executable, env: Mapping[str, str] | None = None):
        root = Path(comfy_root) if comfy_root is not None else comfyui_path()
        if root is None or not (Path(root) / "main.py").is_file():
            raise ServerError(f"no ComfyUI checkout (main.py) at {root}")
        self.comfy_root = Path(root)
        self._owns_base_dir = base_dir is None
        self.base_dir = Path(base_dir) if base_dir is not None else Path(tempfile.mkdtemp(prefix="omni-comfy-"))
        self.port = port or free_port()
        self.extra_args = list(extra_args)
        self.custom_nodes = dict(custom_nodes) if custom_nodes is not None else {
            PACK_DIR_NAME: REPO_ROOT, TEST_PACK_DIR_NAME: TEST_PACK_SOURCE}
        self.tiny_wan_blocks = tiny_wan_blocks
        self.startup_timeout = startup_timeout
        self.threads = threads
        self.python = python
        self.env = dict(env) if env is not None else None
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self.starts = 0
        self.startup_seconds: float | None = None
        self._log_file = None
        self._prepared = False

    # -- paths
    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://{HOST}:{self.port}/ws"

    @property
    def output_dir(self) -> Path:
        return self.base_dir / "output"

    @property
    def models_dir(self) -> Path:
        return self.base_dir / "models"

    @property
    def custom_nodes_dir(self) -> Path:
        return self.base_dir / "custom_nodes"

    @property
    def tiny_wan_path(self) -> Path:
        return self.models_dir / "diffusion_models" / TINY_WAN_NAME

    # -- lifecycle
    def prepare(self) -> None:
        """Create the base directory layout (idempotent)."""
        from omnitest.tiny_wan import write_tiny_wan
        for sub in ("custom_nodes", "models/diffusion_models", "input", "output", "temp", "user", "logs"):
            (self.base_dir / sub).mkdir(parents=True, exist_ok=True)
        for name, source in self.custom_nodes.items():
            link = self.custom_nodes_dir / name
            source = Path(source).resolve()
            if link.is_symlink() or link.exists():
                if link.is_symlink() and link.resolve() == source:
                    continue
                raise ServerError(f"{link} exists and is not a link to {source}")
            link.symlink_to(source, target_is_directory=source.is_dir())
        if not self.tiny_wan_path.is_file():
            write_tiny_wan(self.tiny_wan_path, num_blocks=self.tiny_wan_blocks)
        self._prepared = True

    def command(self) -> list[str]:
        return [self.python, "main.py", "--cpu", "--listen", HOST, "--port", str(self.port),
                "--base-directory", str(self.base_dir), "--disable-api-nodes",
                "--database-url", f"sqlite:///{self.base_dir / 'user' / 'comfyui.db'}",
                *self._frontend_args(), *self.extra_args]

    def _frontend_args(self) -> list[str]:
        """``--front-end-root`` at the frontend this host's requirements.txt pins, when the installed one is another
        version (tools.comfy_host installs it into .hosts/); nothing when it fits or cannot be had (ComfyUI then
        serves the installed one, warning in its log)."""
        from tools.comfy_host import HostFetchError, frontend_root
        try:
            static = frontend_root(self.comfy_root)
        except HostFetchError as error:
            warnings.warn(f"the installed ComfyUI frontend is used: {error}")
            return []
        return [] if static is None else ["--front-end-root", str(static)]

    def _templates_path(self) -> Path | None:
        """The workflow templates this host's requirements.txt pins, when the installed ones are another version
        (tools.comfy_host installs them into .hosts/), to go first on the server's ``PYTHONPATH``; None when they fit
        or cannot be had (ComfyUI then serves the installed ones)."""
        from tools.comfy_host import HostFetchError, templates_path
        try:
            return templates_path(self.comfy_root)
        except HostFetchError as error:
            warnings.warn(f"the installed workflow templates are served: {error}")
            return None

    def start(self) -> "ComfyServer":
        if self.is_running():
            return self
        if not self._prepared:
            self.prepare()
        self.starts += 1
        self.log_path = self.base_dir / "logs" / f"server-{self.starts}.log"
        self._log_file = open(self.log_path, "wb")
        env = dict(os.environ if self.env is None else self.env)
        env["PYTHONUNBUFFERED"] = "1"
        templates = self._templates_path()
        if templates is not None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(templates), env.get("PYTHONPATH")]))
        if self.threads is not None:
            # One intra-op thread: as fast for the tiny models, and immune to the ~40x slowdown that 2 OpenMP
            # threads on 2 cores suffer as soon as another process (a parallel pytest run) takes a core.
            for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
                env[var] = str(self.threads)
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.command(), cwd=self.comfy_root, stdin=subprocess.DEVNULL,
                                     stdout=self._log_file, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=_set_pdeathsig if sys.platform.startswith("linux") else None)
        _LIVE_SERVERS.add(self)
        try:
            self._wait_ready(t0)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def _wait_ready(self, t0: float) -> None:
        session = requests.Session()
        session.trust_env = False
        while True:
            if self.proc.poll() is not None:
                raise ServerError(f"ComfyUI exited with code {self.proc.returncode} during startup "
                                  f"({' '.join(self.command())})\n--- server log tail ---\n{self.log_tail()}")
            try:
                if session.get(self.url + "/system_stats", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() - t0 > self.startup_timeout:
                raise ServerError(f"ComfyUI did not answer /system_stats within {self.startup_timeout:.0f} s"
                                  f"\n--- server log tail ---\n{self.log_tail()}")
            time.sleep(0.1)

    def stop(self, timeout: float = 15.0) -> int | None:
        """Terminate (then kill) the process; returns its exit code (None if it was not started)."""
        proc, self.proc = self.proc, None
        rc = None
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=timeout)
            rc = proc.returncode
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        _LIVE_SERVERS.discard(self)
        return rc

    def restart(self) -> "ComfyServer":
        """Stop and start again on the same base directory and port (files in output/ and user/ survive)."""
        self.stop()
        return self.start()

    def ensure_running(self) -> "ComfyServer":
        """Start again (same base dir and port) if the process has died, e.g. after a crash in an earlier test."""
        if not self.is_running():
            self.stop()
            self.start()
        return self

    def close(self) -> None:
        """Stop, and delete the base directory if this object created it."""
        self.stop()
        if self._owns_base_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> "ComfyServer":
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()

    # -- log
    def log_text(self) -> str:
        """The log of the current (or last) run of the process."""
        if self.log_path is None or not self.log_path.is_file():
            return ""
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 80) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def import_times(self) -> dict[str, tuple[float, bool]]:
        """The "Import times for custom nodes" list of the current log: path -> (seconds, import_failed)."""
        result: dict[str, tuple[float, bool]] = {}
        text = re.sub(r"\x1b\[[0-9;]*m", "", self.log_text())  # newer ComfyUI logs '[INFO] ' in colour first
        for m in re.finditer(r"^(?:\[\w+\])?\s*([\d.]+) seconds( \(IMPORT FAILED\))?: (.+?)\s*$", text, re.M):
            result[m.group(3)] = (float(m.group(1)), bool(m.group(2)))
        return result

    # -- clients
    def client(self, client_id: str | None = None) -> "ComfyClient":
        return ComfyClient(server=self, client_id=client_id)


# --------------------------------------------------------------------------------------------------- results

@dataclass
class RunResult:
    """One finished prompt: every websocket message from its queueing up to its final ``executing`` (node None),
    and its ``/history`` entry."""
    prompt_id: str
    client_id: str
    messages: list[dict]
    history: dict
    output_dir: Path | None = None
    client: "ComfyClient | None" = field(default=None, repr=False)

    @property
    def status(self) -> str:
        """"success", "error" or "interrupted" (from the websocket; falls back on the history status)."""
        for m in self.messages:
            if m.get("type") in TERMINAL_EVENTS and self._mine(m):
                return m["type"].removeprefix("execution_")
        return "success" if self.history.get("status", {}).get("status_str") == "success" else "error"

    @property
    def ok(self) -> bool:
        return self.status == "success"

    def _mine(self, m: dict) -> bool:
        data = m.get("data")
        return not isinstance(data, dict) or data.get("prompt_id") in (None, self.prompt_id)

    def events(self, event_type: str | None = None) -> list[Any]:
        """The ``data`` of the JSON messages of this run (of one type, if given); messages carrying another
        prompt's ``prompt_id`` are left out, messages without ``prompt_id`` (custom events, ``status``) kept."""
        return [m.get("data") for m in self.messages
                if m.get("type") != "binary" and (event_type is None or m.get("type") == event_type) and self._mine(m)]

    @property
    def types(self) -> list[str]:
        return [m.get("type") for m in self.messages if self._mine(m)]

    @property
    def executed_nodes(self) -> list[str]:
        """Node ids in the order ``executing`` reported them (nodes served from ComfyUI's cache are not listed)."""
        return [d["node"] for d in self.events("executing") if d.get("node") is not None]

    @property
    def cached_nodes(self) -> list[str]:
        return [n for d in self.events("execution_cached") for n in d.get("nodes", [])]

    @property
    def error(self) -> dict | None:
        """``execution_error`` data (node_id, node_type, exception_message, exception_type, traceback, ...)."""
        errors = self.events("execution_error")
        return errors[0] if errors else None

    @property
    def outputs(self) -> dict:
        return self.history.get("outputs", {})

    def output_files(self, node_id: str | None = None, kind: str = "latents") -> list[dict]:
        """File locators ({filename, subfolder, type}) of ``kind`` from the UI outputs (of one node, if given)."""
        nodes = [node_id] if node_id is not None else sorted(self.outputs, key=str)
        return [loc for n in nodes for loc in self.outputs.get(str(n), {}).get(kind, [])]

    def latent(self, node_id: str | None = None, index: int = 0) -> "torch.Tensor":  # noqa: F821
        """The tensor saved by a ``SaveLatent`` node of this run (the only one if node_id is None)."""
        files = self.output_files(node_id, "latents")
        if node_id is None and len({str(n) for n in self.outputs if self.outputs[n].get("latents")}) > 1:
            raise ValueError(f"several SaveLatent outputs {list(self.outputs)}; pass node_id")
        if not files:
            raise ValueError(f"no latent output (node {node_id}) in {self.outputs}")
        if self.client is None:
            raise ValueError("RunResult has no client to read files with")
        return self.client.read_latent(files[index])


# --------------------------------------------------------------------------------------------------- client

class ComfyClient:
    """HTTP + websocket client for one ``client_id``; the websocket is read by a background thread that keeps
    every message (``messages``), so nothing of a fast prompt is lost."""

    def __init__(self, base_url: str | None = None, *, server: ComfyServer | None = None,
                 client_id: str | None = None, output_dir: str | os.PathLike | None = None):
        if base_url is None and server is None:
            raise ValueError("give base_url or server")
        self._base_url = base_url
        self.server = server
        self.client_id = client_id or f"omnitest-{uuid.uuid4().hex[:12]}"
        self._output_dir = Path(output_dir) if output_dir is not None else None
        self.http = requests.Session()
        self.http.trust_env = False  # loopback only: never go through a proxy from the environment
        self.messages: list[dict] = []
        self._cond = threading.Condition()
        self._ws: websocket.WebSocket | None = None
        self._reader: threading.Thread | None = None
        self._starts: dict[str, int] = {}

    # -- plumbing
    @property
    def base_url(self) -> str:
        return self.server.url if self.server is not None else self._base_url.rstrip("/")

    @property
    def output_dir(self) -> Path | None:
        if self._output_dir is not None:
            return self._output_dir
        return self.server.output_dir if self.server is not None else None

    def _log_tail(self) -> str:
        return self.server.log_tail() if self.server is not None else ""

    def url(self, path: str) -> str:
        return self.base_url + ("" if path.startswith("/") else "/") + path

    def get(self, path: str, params: Mapping[str, Any] | None = None, timeout: float = 30) -> requests.Response:
        return self.http.get(self.url(path), params=params, timeout=timeout)

    def post(self, path: str, json_body: Any = None, timeout: float = 30) -> requests.Response:
        return self.http.post(self.url(path), json=json_body, timeout=timeout)

    def get_json(self, path: str, params: Mapping[str, Any] | None = None) -> Any:
        r = self.get(path, params)
        r.raise_for_status()
        return r.json()

    # -- websocket
    def connect(self, timeout: float = 10.0) -> "ComfyClient":
        """Open ``/ws?clientId=<client_id>`` (if not open) and wait for the server's first ``status`` message."""
        if self._reader is not None and self._reader.is_alive():
            return self
        ws_url = self.base_url.replace("http://", "ws://", 1) + f"/ws?clientId={self.client_id}"
        ws = websocket.WebSocket()
        ws.connect(ws_url, timeout=timeout)
        ws.settimeout(None)
        with self._cond:
            mark = len(self.messages)
        self._ws = ws
        self._reader = threading.Thread(target=self._read_loop, args=(ws,), name=f"ws-{self.client_id}", daemon=True)
        self._reader.start()
        self.wait_for_message(lambda m: m.get("type") == "status", timeout=timeout, since=mark)
        return self

    def _read_loop(self, ws: websocket.WebSocket) -> None:
        try:
            while True:
                opcode, data = ws.recv_data()
                if opcode == websocket.ABNF.OPCODE_TEXT:
                    try:
                        msg = json.loads(data.decode("utf-8"))
                    except ValueError:
                        msg = {"type": "invalid_json", "data": data.decode("utf-8", "replace")}
                elif opcode == websocket.ABNF.OPCODE_BINARY:
                    event = int.from_bytes(data[:4], "big") if len(data) >= 4 else None
                    msg = {"type": "binary", "event": event, "data": data[4:]}
                elif opcode == websocket.ABNF.OPCODE_CLOSE:
                    break
                else:
                    continue
                msg["_t"] = time.monotonic()
                with self._cond:
                    self.messages.append(msg)
                    self._cond.notify_all()
        except Exception:
            pass
        finally:
            with self._cond:
                self._cond.notify_all()

    def close(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            try:
                ws.abort()  # unblocks the reader thread's recv
                ws.close(timeout=1)
            except Exception:
                pass
        if self._reader is not None:
            self._reader.join(timeout=5)
            self._reader = None
        self.http.close()

    def __enter__(self) -> "ComfyClient":
        return self.connect()

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_for_message(self, predicate: Callable[[dict], bool], timeout: float = 30.0, since: int = 0) -> dict:
        """The first message at index >= ``since`` satisfying ``predicate`` (blocks until it arrives)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            i = since
            while True:
                while i < len(self.messages):
                    if predicate(self.messages[i]):
                        return self.messages[i]
                    i += 1
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no matching websocket message within {timeout} s; last messages: "
                                       f"{self._summary(self.messages[since:][-15:])}\n--- server log tail ---\n"
                                       f"{self._log_tail()}")
                if self.server is not None and not self.server.is_running():
                    raise ServerError(f"ComfyUI is not running\n--- server log tail ---\n{self._log_tail()}")
                if self._reader is None or not self._reader.is_alive():
                    raise ServerError("the websocket is closed (server restarted or died?); last messages: "
                                      f"{self._summary(self.messages[since:][-15:])}\n--- server log tail ---\n"
                                      f"{self._log_tail()}")
                self._cond.wait(timeout=min(left, 0.5))

    @staticmethod
    def _summary(messages: list[dict]) -> str:
        return json.dumps([{k: v for k, v in m.items() if k != "_t"} if m.get("type") != "binary"
                           else {"type": "binary", "event": m.get("event")} for m in messages], default=str)[:3000]

    # -- API
    def queue(self, prompt: Mapping[str, Any], *, client_id: str | None = None, prompt_id: str | None = None,
              extra_data: Mapping[str, Any] | None = None, front: bool = False,
              partial_execution_targets: list[str] | None = None) -> str:
        """POST /prompt; returns the prompt_id. Raises ``PromptRejected`` (with the server's JSON) on HTTP 400."""
        if client_id is None or client_id == self.client_id:
            client_id = self.client_id
            self.connect()
        body: dict[str, Any] = {"prompt": prompt, "client_id": client_id}
        if prompt_id is not None:
            body["prompt_id"] = prompt_id
        if extra_data:
            body["extra_data"] = dict(extra_data)
        if front:
            body["front"] = True
        if partial_execution_targets is not None:
            body["partial_execution_targets"] = list(partial_execution_targets)
        with self._cond:
            mark = len(self.messages)
        r = self.post("/prompt", body)
        if r.status_code == 400:
            try:
                payload = r.json()
            except ValueError:
                payload = {"error": {"message": r.text}}
            raise PromptRejected(r.status_code, payload)
        r.raise_for_status()
        pid = r.json()["prompt_id"]
        self._starts[pid] = mark
        return pid

    def wait(self, prompt_id: str, timeout: float = 120.0) -> RunResult:
        """Wait for the end of a prompt queued by this client (its final ``executing`` with node None) and return
        every message since it was queued plus its ``/history`` entry."""
        start = self._starts.get(prompt_id, 0)
        end_msg = self.wait_for_message(
            lambda m: m.get("type") == "executing" and isinstance(m.get("data"), dict)
            and m["data"].get("node") is None and m["data"].get("prompt_id") == prompt_id,
            timeout=timeout, since=start)
        with self._cond:
            end = next(i for i in range(start, len(self.messages)) if self.messages[i] is end_msg)
            messages = self.messages[start:end + 1]
        history = self.history(prompt_id, timeout=10.0)
        return RunResult(prompt_id, self.client_id, messages, history, self.output_dir, client=self)

    def run(self, prompt: Mapping[str, Any], *, timeout: float = 120.0, check: bool = True,
            **queue_kwargs) -> RunResult:
        """queue + wait; with ``check`` raises ``PromptFailed`` unless the prompt succeeded."""
        result = self.wait(self.queue(prompt, **queue_kwargs), timeout=timeout)
        if check and not result.ok:
            raise PromptFailed(result, self._log_tail())
        return result

    def node_error(self, prompt: Mapping[str, Any], *, timeout: float = 120.0) -> "NodeError":
        """Queue a prompt that must fail on one node's bad input; how the server refused it, at /prompt or while
        executing (``AssertionError`` if it succeeded)."""
        try:
            result = self.run(prompt, timeout=timeout, check=False)
        except PromptRejected as rejected:
            assert len(rejected.node_errors) == 1, rejected
            ((node_id, entry),) = rejected.node_errors.items()
            errors = entry.get("errors", [])
            return NodeError(node_id, entry.get("class_type"), "\n".join(e.get("details", "") for e in errors),
                             rejected=True,
                             validation=[(e.get("type"), e.get("extra_info", {}).get("input_name"),
                                          e.get("extra_info", {}).get("received_value")) for e in errors])
        assert result.status == "error", (result.status, result.types)
        err = result.error
        return NodeError(err["node_id"], err["node_type"], err["exception_message"], rejected=False, result=result)

    def history(self, prompt_id: str | None = None, timeout: float = 10.0) -> dict:
        """``/history/{id}`` entry (polls briefly until it exists), or the whole ``/history`` without an id."""
        if prompt_id is None:
            return self.get_json("/history")
        deadline = time.monotonic() + timeout
        while True:
            entry = self.get_json(f"/history/{prompt_id}").get(prompt_id)
            if entry is not None:
                return entry
            if time.monotonic() > deadline:
                raise TimeoutError(f"no /history entry for {prompt_id}\n--- server log tail ---\n{self._log_tail()}")
            time.sleep(0.05)

    def interrupt(self, prompt_id: str | None = None) -> None:
        """POST /interrupt (only the given prompt if prompt_id, else whatever is running)."""
        self.post("/interrupt", {"prompt_id": prompt_id} if prompt_id else {}).raise_for_status()

    def object_info(self, node_class: str | None = None) -> dict:
        """GET /object_info (all nodes) or the entry of one node class (KeyError if unknown)."""
        if node_class is None:
            return self.get_json("/object_info")
        return self.get_json(f"/object_info/{node_class}")[node_class]

    def queue_state(self) -> dict:
        return self.get_json("/queue")

    def clear_queue(self) -> None:
        self.post("/queue", {"clear": True}).raise_for_status()

    def free(self, unload_models: bool = True, free_memory: bool = True) -> None:
        """POST /free. Applied by the prompt worker asynchronously (before its next prompt only if it is idle)."""
        self.post("/free", {"unload_models": unload_models, "free_memory": free_memory}).raise_for_status()

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Wait until nothing is running or pending."""
        deadline = time.monotonic() + timeout
        while True:
            q = self.queue_state()
            if not q.get("queue_running") and not q.get("queue_pending"):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"server still busy after {timeout} s: {json.dumps(q)[:2000]}")
            time.sleep(0.1)

    def read_latent(self, locator: Mapping[str, str] | str | os.PathLike) -> "torch.Tensor":  # noqa: F821
        """Tensor of a SaveLatent output: a file locator {filename, subfolder, type} or a path."""
        if not isinstance(locator, Mapping):
            return read_latent(locator)
        kind = locator.get("type", "output")
        if kind == "output" and self.output_dir is not None:
            return read_latent(self.output_dir / locator.get("subfolder", "") / locator["filename"])
        r = self.get("/view", {"filename": locator["filename"], "subfolder": locator.get("subfolder", ""),
                               "type": kind})
        r.raise_for_status()
        from safetensors.torch import load
        return load(r.content)["latent_tensor"]
