"""The real ComfyUI frontend, served by the real server, in headless Chromium driven by Playwright (Debian's
/usr/bin/chromium; Playwright's own browser download does not work here): the fixtures every browser test shares.
The fixtures ``browser`` and ``page`` reach every test (``tests/conftest.py`` loads this module as a plugin); ``page``
fails its test on any error or warning the page logs about this pack."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("OMNIHOOKS_CHROMIUM", "/usr/bin/chromium")
# newer frontends look each custom node up in the Comfy registry; the server's Content-Security-Policy blocks that
# request (the frontend's own, naming the node type), which is no error of the pack
REGISTRY_LOOKUP = "Connecting to 'https://api.comfy.org/"


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium, or set OMNIHOOKS_CHROMIUM)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser, comfy_server):
    # a first visit opens the template browser over the page; a user who has seen it does not get it again
    import requests
    requests.post(f"{comfy_server.url}/settings/Comfy.TutorialCompleted", json=True, timeout=10).raise_for_status()
    requests.post(f"{comfy_server.url}/settings/Comfy.ColorPalette", json="dark", timeout=10).raise_for_status()
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type in ("error", "warning") and "OmniHooks" in m.text
            and not m.text.startswith(REGISTRY_LOOKUP) else None)
    open_comfy(page, comfy_server.url)
    yield page
    context.close()
    assert not [e for e in errors if "OmniHooks" in e or "omni_hooks" in e or "omni-" in e], errors


def open_comfy(page, url: str) -> None:
    page.goto(url)
    page.wait_for_function("() => window.app && window.app.graph && window.comfyAPI && window.comfyAPI.api",
                           timeout=60000)
    page.wait_for_function(
        "() => window.app.extensionManager && window.app.extensions.some(e => e.name === 'OmniHooks.CacheStats')",
        timeout=60000)
