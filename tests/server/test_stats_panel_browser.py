"""The statistics panel in the real ComfyUI frontend (1.27.10, served by the real server), driven by Playwright in
headless Chromium (Debian's /usr/bin/chromium; Playwright's own browser download does not work here).

A TeaCache workflow is queued through the HTTP API with the page's websocket client id; the panel must update step by
step, end with the numbers the /omni_hooks/runs route reports, survive a page reload, badge the Apply node, and warn
when a run reused nothing. Screenshots go to test-artifacts/.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

import pytest

from omnitest.comfy_path import PACK_ROOT

pytestmark = [pytest.mark.server, pytest.mark.browser]

CHROMIUM = os.environ.get("OMNIHOOKS_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = PACK_ROOT / "test-artifacts"
CALIBRATION = "browser-identity"
STEPS = 40


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
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    open_comfy(page, comfy_server.url)
    yield page
    context.close()
    assert not [e for e in errors if "OmniHooks" in e or "omni_hooks" in e], errors


def open_comfy(page, url: str) -> None:
    page.goto(url)
    page.wait_for_function("() => window.app && window.app.graph && window.comfyAPI && window.comfyAPI.api", timeout=60000)
    page.wait_for_function(
        "() => window.app.extensionManager && window.app.extensions.some(e => e.name === 'OmniHooks.CacheStats')",
        timeout=60000)


def open_panel(page) -> None:
    page.keyboard.press("Escape")  # any dialog that may still be open
    page.locator(".side-bar-button .pi-bolt, button .pi-bolt").first.click()
    page.wait_for_selector(".omni-hooks-panel", timeout=10000)


def client_id(page) -> str:
    return page.evaluate("() => window.comfyAPI.api.api.clientId")


def write_identity_calibration(server) -> None:
    folder = Path(server.base_dir) / "user" / "omni_hooks" / "teacache"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{CALIBRATION}.json").write_text(json.dumps(
        {"kind": "teacache", "family": "wan", "signal": "default", "coefficients": [0, 0, 0, 1, 0]}))


def teacache_graph(threshold: float):
    from omnitest.graphs import tiny_wan_graph
    graph = tiny_wan_graph([("OmniHooks.ApplyTeaCache", {
        "rel_l1_thresh": threshold, "start_percent": 0.0, "end_percent": 1.0, "cache_device": "compute device",
        "model_variant": f"calibration: {CALIBRATION}"})], steps=STEPS, cfg=3.0, width=128, height=128, length=9)
    graph.set_nonce(time.monotonic_ns())
    return graph


def queue_for_page(comfy, page, graph) -> str:
    prompt_id = comfy.queue(graph.prompt(), client_id=client_id(page))
    comfy.history(prompt_id, timeout=180)
    return prompt_id


def route_run(comfy, prompt_id: str) -> dict:
    runs = comfy.get_json("/api/omni_hooks/runs", {"prompt_id": prompt_id})["runs"]
    assert len(runs) == 1
    return runs[0]


def screenshot(page, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    page.locator(".omni-hooks-panel").screenshot(path=str(path))
    return path


def test_panel_shows_a_live_run_step_by_step_with_the_route_numbers_and_after_reload(page, comfy, comfy_server):
    write_identity_calibration(comfy_server)
    open_panel(page)
    assert "No cache runs yet" in page.locator(".omni-hooks-panel").inner_text() or page.locator(".omni-run").count()
    page.evaluate("""() => {
        window.__omniSeen = [];
        const observer = new MutationObserver(() => {
            const el = document.querySelector('.omni-live .omni-count-evaluations');
            if (el) window.__omniSeen.push(el.textContent);
        });
        observer.observe(document.body, {subtree: true, childList: true, characterData: true});
    }""")
    graph = teacache_graph(threshold=1.0)
    prompt_id = queue_for_page(comfy, page, graph)
    run = route_run(comfy, prompt_id)
    summary = run["summary"]
    assert summary["reused"] > 0 and summary["computed"] > 0
    page.wait_for_function(
        f"() => document.querySelector('.omni-live .omni-count-evaluations')?.textContent === '{summary['evaluations']} evaluations'",
        timeout=30000)
    seen = [int(text.split()[0]) for text in page.evaluate("() => window.__omniSeen")]
    assert len(set(seen)) >= 3 and seen == sorted(seen)  # it updated while the run was going
    panel = page.locator(".omni-hooks-panel")
    assert panel.locator(".omni-live .omni-count-reused").inner_text() == f"reused {summary['reused']}"
    for branch, counts in summary["branches"].items():
        strip = panel.locator(f".omni-strip[data-branch='{branch}']")
        assert strip.locator(".omni-cell").count() == counts["computed"] + counts["reused"]
        assert strip.locator(".omni-reused").count() == counts["reused"]
    assert panel.locator(".omni-plot").count() >= 1
    assert panel.locator(f".omni-run[data-run='{run['run_id']}']").count() == 1
    shot = screenshot(page, "stats_panel.png")
    shutil.copy(shot, PACK_ROOT / "docs" / "stats-panel.png") if os.environ.get("OMNIHOOKS_UPDATE_DOCS") else None

    page.reload()
    open_comfy(page, comfy_server.url)
    open_panel(page)
    page.wait_for_selector(f".omni-run[data-run='{run['run_id']}']", timeout=10000)
    text = page.locator(".omni-hooks-panel").inner_text()
    assert f"reused {summary['reused']}/{summary['evaluations']}" in text


def test_apply_node_gets_a_hit_rate_badge(page, comfy, comfy_server):
    write_identity_calibration(comfy_server)
    graph = teacache_graph(threshold=1.0)
    page.evaluate("(g) => window.app.loadApiJson(g, 'omni-test')", graph.prompt())
    prompt_id = queue_for_page(comfy, page, graph)
    rate = route_run(comfy, prompt_id)["summary"]["hit_rate"]
    expected = f"hit {math.floor(rate * 100 + 0.5)}%"  # JavaScript's Math.round, not Python's banker's rounding
    page.wait_for_function(
        """(expected) => {
            const node = window.app.graph.getNodeById(10);
            return node && node.badges.some(b => (typeof b === 'function' ? b() : b).text === expected);
        }""", arg=expected, timeout=15000)


def test_a_run_that_reused_nothing_shows_the_warning(page, comfy, comfy_server):
    write_identity_calibration(comfy_server)
    open_panel(page)
    prompt_id = queue_for_page(comfy, page, teacache_graph(threshold=0.0))
    assert route_run(comfy, prompt_id)["summary"]["reused"] == 0
    page.wait_for_selector(".omni-live .omni-warning", timeout=15000)
    assert "nothing was reused" in page.locator(".omni-live .omni-warning").first.inner_text()
    screenshot(page, "stats_panel_warning.png")
