"""Server and browser tests: one real ComfyUI process for the whole session (startup ~10-15 s on 2 CPU cores).

Fixtures:
* ``comfy_server`` (session): a started ``omnitest.server.ComfyServer`` (pack + omni_test_nodes linked into its
  custom_nodes, tiny Wan in models/diffusion_models); always stopped at the end of the session.
* ``comfy`` (function): a connected ``ComfyClient`` with its own client_id; afterwards the queue is cleared and a
  still-running prompt interrupted, so one failed test does not leave work behind for the next.

Test modules in tests/server and tests/browser set ``pytestmark = pytest.mark.server`` and never import comfy (the
server runs out of process). When no ComfyUI checkout is found, the root conftest skips ``server`` tests before these
fixtures run; the fixtures skip as well, so nothing is ever started without a checkout.
"""
from __future__ import annotations

import pytest

from omnitest.comfy_path import comfyui_path, skip_reason


@pytest.fixture(scope="session")
def comfy_server(tmp_path_factory: pytest.TempPathFactory):
    root = comfyui_path()
    if root is None:
        pytest.skip(skip_reason())
    from omnitest.server import ComfyServer
    server = ComfyServer(tmp_path_factory.mktemp("comfy_base"), comfy_root=root)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def comfy(comfy_server):
    comfy_server.ensure_running()  # a crash in an earlier test must not fail every later one
    client = comfy_server.client()
    client.connect()
    try:
        yield client
    finally:
        try:
            if comfy_server.is_running():
                client.clear_queue()
                for item in client.queue_state().get("queue_running", []):
                    client.interrupt(item[1])  # item: [number, prompt_id, prompt, extra_data, outputs]
                client.wait_idle(timeout=60)
        finally:
            client.close()
