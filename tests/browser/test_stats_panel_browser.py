"""The statistics panel in the real ComfyUI frontend (1.27.10, served by the real server), driven by Playwright in
headless Chromium (Debian's /usr/bin/chromium; Playwright's own browser download does not work here).

Workflows are loaded into the page and queued the way the Run button does (the page's client id, the workflow in
extra_pnginfo), so the panel sees what a user sees. Screenshots of every state go to test-artifacts/ (set
OMNIHOOKS_UPDATE_DOCS=1 to also refresh docs/stats-panel.png and docs/stats-panel-offload.png).
"""
from __future__ import annotations

import math
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from omnitest.calibrations import IDENTITY_TEACACHE, OVERFLOWING_TEACACHE, write_calibration
from omnitest.comfy_path import PACK_ROOT
from omnitest.browser import open_comfy
from omnitest.strict import strict_json

pytestmark = [pytest.mark.server, pytest.mark.browser]

ARTIFACTS = PACK_ROOT / "test-artifacts"
IDENTITY = "browser-identity"
OVERFLOW = "browser-overflow"
STEPS = 40
APPLY_ID = 10
APPLY_TITLE = "TeaCache on the tiny Wan"
# the tests that watch a run live make each model call this much longer: 40 steps then last over a second, many times
# the panel's redraw interval, however fast the machine is
LIVE_STEP_SECONDS = 0.03


@pytest.fixture(scope="module", autouse=True)
def calibrations(comfy_server):
    write_calibration(comfy_server.base_dir, "teacache", IDENTITY, IDENTITY_TEACACHE)
    write_calibration(comfy_server.base_dir, "teacache", OVERFLOW, OVERFLOWING_TEACACHE)


def open_panel(page) -> None:
    page.keyboard.press("Escape")  # any dialog that may still be open
    if not page.locator(".omni-hooks-panel").count():
        page.locator(".omni-hooks-stats-tab-button").first.click()
    page.wait_for_selector(".omni-hooks-panel", timeout=10000)


def teacache_graph(threshold: float, calibration: str = IDENTITY, steps: int = STEPS, step_seconds: float = 0.0):
    """The tiny Wan workflow with Apply TeaCache (node ``APPLY_ID``); ``step_seconds`` > 0 makes every model call
    that much longer (``OmniTest.SlowSteps`` after it), so that a test watching the live panel sees many steps."""
    from omnitest.graphs import tiny_wan_graph
    patches = [("OmniHooks.ApplyTeaCache", {
        "rel_l1_thresh": threshold, "start_percent": 0.0, "end_percent": 1.0, "cache_device": "compute device",
        "model_variant": f"calibration: {calibration}"})]
    if step_seconds:
        patches.append(("OmniTest.SlowSteps", {"seconds": step_seconds}))
    graph = tiny_wan_graph(patches, steps=steps, cfg=3.0, width=128, height=128, length=9)
    graph.patches[0].title = APPLY_TITLE
    graph.set_nonce(time.monotonic_ns())
    return graph


def load_workflow(page, graph, name: str) -> str:
    """Open ``graph`` as a new workflow tab named ``name``, as a saved workflow file (with its own id) opens; returns
    its workflow id."""
    return page.evaluate("""async ([g, name]) => {
        await window.app.loadApiJson(g, `${name} (API format)`);  // -> a UI graph, which then has no id of its own
        const workflow = window.app.graph.serialize();
        workflow.id = crypto.randomUUID();
        await window.app.loadGraphData(workflow, true, true, name);
        return window.app.graph.id;
    }""", [graph.prompt(), name])


def queue_in_page(page) -> str:
    """Queue the workflow on the canvas as the Run button does (workflow + the page's client id); its prompt id."""
    return page.evaluate("""async () => {
        const p = await window.app.graphToPrompt();
        return (await window.comfyAPI.api.api.queuePrompt(0, p)).prompt_id;
    }""")


def run_in_page(page, comfy, graph, name: str, timeout: float = 180) -> tuple[str, dict]:
    load_workflow(page, graph, name)
    prompt_id = queue_in_page(page)
    comfy.history(prompt_id, timeout=timeout)
    return prompt_id, route_run(comfy, prompt_id)


def route_run(comfy, prompt_id: str) -> dict:
    runs = strict_json(comfy.get("/api/omni_hooks/runs", {"prompt_id": prompt_id}).text)["runs"]
    assert len(runs) == 1
    return runs[0]


def wait_for_run(page, run_id: str, timeout: float = 30000) -> None:
    page.wait_for_selector(f".omni-run-view[data-run='{run_id}'] .omni-status:not(.omni-status-running)",
                           timeout=timeout)


def set_sidebar_width(page, width: int) -> int:
    """Drag-free resize of the sidebar (as the splitter does), then wait for the panel to redraw at that width; the
    width it got: never under the sidebar's own minimum (newer frontends keep it at least ~19.5rem wide), as a user
    dragging the splitter gets."""
    width = page.evaluate("""(w) => {
        const p = document.querySelector('.side-bar-panel');
        const w2 = Math.max(w, parseFloat(getComputedStyle(p).minWidth) || 0);
        p.style.flex = `0 0 ${w2}px`; p.style.width = w2 + 'px';
        return w2;
    }""", width)
    page.wait_for_function("""(w) => {
        const panel = document.querySelector('.omni-hooks-panel'), plot = document.querySelector('.omni-plot');
        return Math.abs(panel.getBoundingClientRect().width - w) < 2 && (!plot
            || Math.abs(plot.getBoundingClientRect().width
                        - (document.querySelector('.omni-body').clientWidth - 16)) < 2);
    }""", arg=width, timeout=5000)
    return width


def screenshot(page, name: str) -> Path:
    """The panel down to the end of its content (the sidebar below it is empty)."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    box = page.evaluate("""() => {
        document.querySelector('.omni-body').scrollTop = 0;
        const panel = document.querySelector('.omni-hooks-panel').getBoundingClientRect();
        const last = document.querySelector('.omni-body').lastElementChild.getBoundingClientRect();
        return {x: panel.x, y: panel.y, width: panel.width, height: Math.min(panel.height, last.bottom - panel.y + 8)};
    }""")
    page.screenshot(path=str(path), clip=box)
    return path


def panel_text(page) -> str:
    return page.locator(".omni-hooks-panel").inner_text()


def speedup_text(x) -> str:
    return f"{x:.2f}×"


def expected_lanes(run: dict) -> dict[tuple[str, ...], list[str]]:
    """The lanes the panel must draw for a stored run: branches with identical reasons share one."""
    per_branch: dict[str, list[str]] = {}
    for e in run["evaluations"]:
        for b in e["branches"]:
            per_branch.setdefault(b["branch"], []).append(b["reason"])
    lanes: dict[tuple, list[str]] = {}
    for name in sorted(per_branch, key=lambda n: (not n.startswith("cond"), n)):
        key = next((k for k, v in lanes.items() if v == per_branch[name]), None)
        if key is None:
            lanes[(name,)] = per_branch[name]
        else:
            lanes[key + (name,)] = lanes.pop(key)
    return lanes


def test_a_live_run_step_by_step_then_every_number_and_reason_and_after_reload(page, comfy, comfy_server):
    open_panel(page)
    page.evaluate("""() => {
        window.__omniSeen = [];
        const observer = new MutationObserver(() => {
            const view = document.querySelector('.omni-run-view');
            const v = view?.querySelector('.omni-stat-reused .omni-stat-value');
            const s = view?.querySelector('.omni-status');
            if (v) window.__omniSeen.push([view.dataset.run, v.textContent, s ? s.textContent : '']);
        });
        observer.observe(document.body, {subtree: true, childList: true, characterData: true});
    }""")
    graph = teacache_graph(threshold=1.0, step_seconds=LIVE_STEP_SECONDS)
    workflow_id = load_workflow(page, graph, "cache stats demo")
    prompt_id = queue_in_page(page)
    comfy.history(prompt_id, timeout=180)
    run = route_run(comfy, prompt_id)
    summary = run["summary"]
    assert summary["reused"] > 0 and summary["computed"] > 0
    assert run["node_title"] == APPLY_TITLE and run["workflow_id"] == workflow_id and run["detail"] == "evaluations"
    wait_for_run(page, run["run_id"])

    # it updated while the run was going, counting 1-based steps like ComfyUI's progress bar
    seen = [(v, s) for run_id, v, s in page.evaluate("() => window.__omniSeen") if run_id == run["run_id"]]
    totals = [int(v.split("/")[1]) for v, _ in seen]
    assert len(set(totals)) >= 3 and totals == sorted(totals)
    running = [int(m.group(1)) for _, s in seen if (m := re.match(r"running step (\d+)/40$", s))]
    assert running and min(running) >= 1 and max(running) <= STEPS

    view = page.locator(f".omni-run-view[data-run='{run['run_id']}']")
    # header: the node's own title and id, workflow, kind, model, threshold, time
    assert view.locator(".omni-node-title").inner_text().replace("\n", " ") == f"{APPLY_TITLE} #{APPLY_ID}"
    assert view.locator(".omni-meta-what").inner_text() == f"cache stats demo · teacache · {run['model']}"
    when = view.locator(".omni-meta-when").inner_text()
    assert re.match(r"threshold 1 · \d\d:\d\d:\d\d, \d+(\.\d+)? s success$", when), when
    # headline numbers, as the route has them
    reused = view.locator(".omni-stat-reused .omni-stat-value").inner_text()
    assert reused == f"{summary['reused']}/{summary['evaluations']}"
    speedup = view.locator(".omni-stat-speedup .omni-stat-value").inner_text()
    assert speedup == speedup_text(summary["estimated_speedup"])
    assert view.locator(".omni-stat-saved .omni-stat-value").inner_text().startswith("~")
    assert "each reused evaluation counted at the mean computed one" in view.locator(".omni-basis").inner_text()
    # per step: one lane per distinct strip, each cell coloured by its reason, a legend for exactly those reasons
    lanes = expected_lanes(run)
    strips = view.locator(".omni-strip")
    assert strips.count() == len(lanes)
    for names, reasons in lanes.items():
        strip = view.locator(f".omni-strip[data-branch='{' + '.join(names)}']")
        drawn = strip.locator(".omni-cell").evaluate_all("cells => cells.map(c => c.dataset.reason)")
        assert drawn == reasons
    legend = view.locator(".omni-legend-item").evaluate_all("items => items.map(i => i.dataset.reason)")
    assert sorted(legend) == sorted({r for rs in lanes.values() for r in rs})
    steps_axis = view.locator(".omni-steps span").all_inner_texts()
    assert steps_axis[0] == "step 1" and steps_axis[-1] == str(STEPS)
    note = view.locator(".omni-branch-note").inner_text()
    assert "uncond the negative prompt" in note
    assert ("share one row" in note) == (len(lanes) == 1)
    # the plot: axes, step numbers and the threshold with its value
    plot = view.locator("svg.omni-plot")
    assert plot.locator(".omni-threshold").count() == 1
    assert view.locator(".omni-threshold-label").inner_text() == "threshold 1"
    assert plot.locator(".omni-threshold-value").text_content() == "1"  # on the y axis, where the line starts
    assert plot.locator(".omni-y-tick").count() >= 3
    assert plot.locator(".omni-x-tick").all_text_contents()[-1] == str(STEPS)
    # recent runs: time and workflow
    item = page.locator(f".omni-run[data-run='{run['run_id']}']")
    assert re.search(r"cache stats demo · teacache · \d\d:\d\d:\d\d", item.inner_text())
    screenshot(page, "stats_panel_dark.png")
    set_sidebar_width(page, 360)  # the README's picture: a comfortably wide sidebar
    shot = screenshot(page, "stats_panel_readme.png")
    if os.environ.get("OMNIHOOKS_UPDATE_DOCS"):
        shutil.copy(shot, PACK_ROOT / "docs" / "stats-panel.png")

    page.reload()
    open_comfy(page, comfy_server.url)
    open_panel(page)
    wait_for_run(page, run["run_id"])
    page.wait_for_selector(f".omni-run-view[data-run='{run['run_id']}'] .omni-strip", timeout=10000)
    view = page.locator(f".omni-run-view[data-run='{run['run_id']}']")
    reused = view.locator(".omni-stat-reused .omni-stat-value").inner_text()
    assert reused == f"{summary['reused']}/{summary['evaluations']}"
    assert view.locator(".omni-cell").count() == sum(len(r) for r in lanes.values())


def test_the_panel_fits_narrow_and_wide_sidebars(page, comfy):
    open_panel(page)
    run_in_page(page, comfy, teacache_graph(threshold=1.0), "fit check")
    page.wait_for_selector(".omni-run-view svg.omni-plot", timeout=30000)
    for width in (224, 320, 480):  # 224: the narrowest the sidebar allows, where that is wider
        set_sidebar_width(page, width)
        geometry = page.evaluate("""() => {
            const body = document.querySelector('.omni-body'), b = body.getBoundingClientRect();
            const inside = (sel) => [...document.querySelectorAll(sel)].every(e => {
                const r = e.getBoundingClientRect(); return r.left >= b.left - 0.5 && r.right <= b.right + 0.5; });
            return {overflowX: body.scrollWidth - body.clientWidth, plot: inside('.omni-plot'),
                    strips: inside('.omni-strip'), labels: inside('.omni-plot text'),
                    panel: document.querySelector('.omni-hooks-panel').getBoundingClientRect().width};
        }""")
        assert geometry["overflowX"] <= 0 and geometry["plot"] and geometry["strips"] and geometry["labels"], geometry
        screenshot(page, f"stats_panel_width_{width}.png")


def test_badges_are_keyed_by_workflow_and_node_and_say_running_while_running(page, comfy):
    open_panel(page)
    graph = teacache_graph(threshold=1.0, step_seconds=LIVE_STEP_SECONDS)
    load_workflow(page, graph, "badge workflow")
    page.evaluate("""() => {
        window.__omniBadges = [];
        const node = window.app.graph.getNodeById(10);
        const read = () => {
            for (const b of node.badges) {
                const x = typeof b === 'function' ? b() : b;
                if (x.text) window.__omniBadges.push(x.text);
            }
        };
        window.__omniBadgeTimer = setInterval(read, 20);
    }""")
    prompt_id = queue_in_page(page)
    comfy.history(prompt_id, timeout=180)
    rate = route_run(comfy, prompt_id)["summary"]["hit_rate"]
    expected = f"hit {math.floor(rate * 100 + 0.5)}%"  # JavaScript's Math.round, not Python's banker's rounding
    badge_of = """(id) => {
        const node = window.app.graph.getNodeById(id);
        return node ? node.badges.map(b => (typeof b === 'function' ? b() : b).text).filter(Boolean) : null;
    }"""
    page.wait_for_function(f"() => ({badge_of})({APPLY_ID}).includes('{expected}')", timeout=15000)
    seen = page.evaluate("() => { clearInterval(window.__omniBadgeTimer); return window.__omniBadges; }")
    assert any(re.match(r"running step \d+/40$", t) for t in seen), set(seen)
    # another workflow with an Apply node of the same id that never ran: no badge (it used to show the other's rate)
    load_workflow(page, teacache_graph(threshold=0.5), "never ran")
    page.wait_for_function(f"() => ({badge_of})({APPLY_ID}) !== null", timeout=5000)
    badges = page.evaluate(f"() => ({badge_of})({APPLY_ID})")
    assert not [t for t in badges if t.startswith(("hit ", "running"))], badges  # (core's own badges may be there)


def test_recent_runs_open_their_run_and_select_its_node(page, comfy):
    open_panel(page)
    _, first = run_in_page(page, comfy, teacache_graph(threshold=1.0), "first workflow")
    _, second = run_in_page(page, comfy, teacache_graph(threshold=0.0), "second workflow")
    wait_for_run(page, second["run_id"])
    page.locator(".omni-titlebar").click()  # no node selected
    page.evaluate("() => window.app.canvas.deselectAll?.()")
    # the second workflow is on the canvas: clicking its run selects its node
    page.locator(f".omni-run[data-run='{second['run_id']}']").click()
    page.wait_for_function(
        f"() => Object.keys(window.app.canvas.selected_nodes || {{}}).map(String).includes('{APPLY_ID}')", timeout=5000)
    # an older run of another workflow: shown, named, and "show latest" goes back
    older = page.locator(f".omni-run[data-run='{first['run_id']}']")
    assert "first workflow" in older.inner_text()
    older.click()
    page.wait_for_selector(f".omni-run-view[data-run='{first['run_id']}'] .omni-strip", timeout=10000)
    assert "omni-selected" in older.get_attribute("class")
    assert page.locator(".omni-run-view .omni-meta-what").inner_text().startswith("first workflow")
    screenshot(page, "stats_panel_older_run.png")
    page.locator(".omni-follow-latest").click()
    page.wait_for_selector(f".omni-run-view[data-run='{second['run_id']}']", timeout=5000)
    assert page.locator(".omni-follow-latest").count() == 0


def test_a_run_that_reused_nothing_warns_at_the_top(page, comfy):
    open_panel(page)
    _, run = run_in_page(page, comfy, teacache_graph(threshold=0.0), "warning check")
    assert run["summary"]["reused"] == 0
    wait_for_run(page, run["run_id"])
    view = page.locator(f".omni-run-view[data-run='{run['run_id']}']")
    first = view.evaluate("v => v.firstElementChild.className")
    assert first == "omni-warnings"
    assert "nothing was reused" in view.locator(".omni-warning").first.inner_text()
    screenshot(page, "stats_panel_warning.png")


OFFLOAD_INPUTS = {"blocks_to_offload": -1, "prefetch_blocks": 1, "pin_memory": "auto", "vram_budget_gb": 0.0}
SP_INPUTS = {"world_size": 2, "ulysses_degree": "auto", "ring_degree": "auto", "devices": "auto", "backend": "auto",
             "master_address": "127.0.0.1", "master_port": 0, "cfg_parallel": False}


def feature_graph(patches, steps: int):
    from omnitest.graphs import tiny_wan_graph

    graph = tiny_wan_graph(patches, steps=steps)
    graph.set_nonce(time.monotonic_ns())
    return graph


def card_of(page, run_id: str, kind: str):
    return page.locator(f".omni-run-view[data-run='{run_id}'] .omni-feature[data-kind='{kind}']")


def card_after_reload(page, comfy_server, run_id: str, kind: str):
    """The card of ``kind`` in run ``run_id`` after a page reload (the history the panel loads on start)."""
    page.reload()
    open_comfy(page, comfy_server.url)
    open_panel(page)
    wait_for_run(page, run_id)
    return card_of(page, run_id, kind)


def assert_fields_folded(card, expected: dict[str, str]) -> None:
    """Every field is in the card, folded away until its summary is clicked."""
    fields = card.locator("details.omni-fields")
    assert fields.get_attribute("open") is None and not card.locator("dl.omni-kv").is_visible()
    fields.locator("summary").click()
    card.locator("dl.omni-kv").wait_for(state="visible", timeout=5000)
    rows = dict(zip(card.locator("dt").all_inner_texts(), card.locator("dd").all_inner_texts()))
    assert {k: rows.get(k) for k in expected} == expected, rows
    fields.locator("summary").click()


def assert_card_fits_and_follows_the_theme(page, kind: str, name: str) -> None:
    """The card at the narrowest and a wide sidebar, in the dark and the light palette: nothing wider than the panel,
    its text in the theme's colour; a screenshot of each."""
    for theme in ("dark", "light"):
        page.evaluate("(t) => window.app.extensionManager.setting.set('Comfy.ColorPalette', t)", theme)
        page.wait_for_function(DARK_THEME_IS, arg=theme, timeout=5000)
        page.wait_for_timeout(300)
        for width in (224, 480):
            got = set_sidebar_width(page, width)
            look = page.evaluate("""(kind) => {
                const body = document.querySelector('.omni-body'), b = body.getBoundingClientRect();
                const card = document.querySelector(`.omni-feature[data-kind='${kind}']`);
                card.scrollIntoView();
                const inside = [...card.querySelectorAll('*')].filter(e => e.getClientRects().length).every(e => {
                    const r = e.getBoundingClientRect(); return r.left >= b.left - 0.5 && r.right <= b.right + 0.5; });
                const css = (v) => getComputedStyle(document.documentElement).getPropertyValue(v).trim();
                const probe = document.createElement('div'); document.body.append(probe);
                probe.style.color = css('--p-text-color');
                const expected = getComputedStyle(probe).color; probe.remove();
                return {overflowX: body.scrollWidth - body.clientWidth, inside,
                        text: getComputedStyle(card.querySelector('.omni-card-headline')).color, expected};
            }""", kind)
            assert look["overflowX"] <= 0 and look["inside"], (theme, got, look)
            assert look["text"] == look["expected"], (theme, look)
            screenshot(page, f"{name}_{theme}_{got}.png")
    page.evaluate("() => window.app.extensionManager.setting.set('Comfy.ColorPalette', 'dark')")


def test_a_run_with_cpu_offload_alone_shows_its_card_live_and_after_reload(page, comfy, comfy_server):
    """No cache: no reuse numbers, strips or threshold; the offload's card says why it changed nothing (the server
    runs on the CPU, so there is nothing to offload to): no tiles or strip to show, the fields folded away."""
    open_panel(page)
    _, run = run_in_page(page, comfy, feature_graph([("OmniHooks.CPUOffload", OFFLOAD_INPUTS)], steps=4),
                         "offload only")
    assert run["kind"] == "offload" and run["summary"] is None
    (offload,) = [f["summary"] for f in run["features"]]
    reason = offload["unchanged_reason"]
    assert reason.startswith("nothing to offload to: ComfyUI runs this model on the CPU")
    assert "changes nothing" in reason
    wait_for_run(page, run["run_id"])
    view = page.locator(f".omni-run-view[data-run='{run['run_id']}']")
    for absent in (".omni-headline", ".omni-strips", ".omni-plot", ".omni-threshold", ".omni-warnings"):
        assert view.locator(absent).count() == 0, absent
    assert view.locator(".omni-node-title").inner_text().startswith("CPU Offload")
    assert view.locator(".omni-features .omni-section-title").text_content() == "What this run did"
    card = card_of(page, run["run_id"], "offload")
    assert card.locator(".omni-card-title").inner_text() == "offload · CPU Offload · #10"
    assert card.locator(".omni-card-headline").inner_text() == reason
    assert card.locator(".omni-tile").count() == 0 and card.locator(".omni-bars").count() == 0
    assert_fields_folded(card, {"status": "success", "bytes moved": "0 B", "active": "no"})
    listed = page.locator(f".omni-run[data-run='{run['run_id']}'] .omni-run-numbers")
    assert listed.inner_text() == "nothing offloaded"
    screenshot(page, "stats_panel_offload_only.png")
    assert_card_fits_and_follows_the_theme(page, "offload", "offload_card")

    card = card_after_reload(page, comfy_server, run["run_id"], "offload")
    assert card.locator(".omni-card-headline").inner_text() == reason


def test_a_cache_with_cpu_offload_reads_as_one_run(page, comfy):
    """TeaCache and CPU Offload on one MODEL: one entry, the cache's numbers and strip, the offload's card beneath
    with its step strip over the same steps (the README's picture)."""
    open_panel(page)
    patches = [("OmniHooks.CPUOffload", OFFLOAD_INPUTS), ("OmniHooks.ApplyTeaCache", {
        "rel_l1_thresh": 1.0, "start_percent": 0.0, "end_percent": 1.0, "cache_device": "compute device",
        "model_variant": f"calibration: {IDENTITY}"})]
    _, run = run_in_page(page, comfy, feature_graph(patches, steps=12), "cache and offload")
    assert run["summary"]["reused"] > 0 and [f["kind"] for f in run["features"]] == ["offload"]
    assert sum(s["skipped"] for s in run["features"][0]["summary"]["steps"]) == run["summary"]["reused"]
    wait_for_run(page, run["run_id"])
    view = page.locator(f".omni-run-view[data-run='{run['run_id']}']")
    assert " · teacache + offload · " in f" {view.locator('.omni-meta-what').inner_text()} "
    assert view.locator(".omni-features .omni-section-title").text_content() == "Other features in this run"
    headline = card_of(page, run["run_id"], "offload").locator(".omni-card-headline").inner_text()
    assert headline.startswith("nothing to offload to")
    set_sidebar_width(page, 360)
    shot = screenshot(page, "stats_panel_cache_and_offload.png")
    if os.environ.get("OMNIHOOKS_UPDATE_DOCS"):
        shutil.copy(shot, PACK_ROOT / "docs" / "stats-panel-offload.png")


def test_a_sequence_parallel_run_shows_its_card_live_and_after_reload(page, comfy, comfy_server):
    """Two ranks (rank 0 in the server, one local worker) with TeaCache: the card's headline, tiles (ranks, time and
    bytes per step, the agreed skips) and one strip cell per step, as the route has them; the fields folded."""
    open_panel(page)
    patches = [("OmniHooks.SequenceParallel", SP_INPUTS), ("OmniHooks.ApplyTeaCache", {
        "rel_l1_thresh": 1.0, "start_percent": 0.0, "end_percent": 1.0, "cache_device": "compute device",
        "model_variant": f"calibration: {IDENTITY}"})]
    _, run = run_in_page(page, comfy, feature_graph(patches, steps=8), "two ranks", timeout=240)
    (sp,) = [f["summary"] for f in run["features"] if f["kind"] == "sequence_parallel"]
    assert run["world_size"] == 2 and len(sp["steps"]) == 8 and run["summary"]["reused"] > 0
    wait_for_run(page, run["run_id"])
    card = card_of(page, run["run_id"], "sequence_parallel")
    headline = card.locator(".omni-card-headline").inner_text()
    devices = f" ({', '.join(sp['local_devices'])})" if sp["local_devices"] else ""
    degrees = f"ulysses {sp['ulysses_degree']} × ring {sp['ring_degree']}"
    assert headline.startswith(f"2 ranks{devices}, {degrees}; "), headline
    decided = sum(s["decided"] for s in sp["steps"])
    assert f"every rank agreed on {decided} cache decisions, {run['summary']['reused']} skipped" in headline
    tiles = dict(zip(card.locator(".omni-tile .omni-stat-label").all_inner_texts(),
                     card.locator(".omni-tile .omni-stat-value").all_inner_texts()))
    assert tiles["ranks"] == "2" and tiles["agreed skips"] == f"{run['summary']['reused']}/{decided}", tiles
    assert tiles["per step"].endswith(" s") or tiles["per step"].endswith(" ms"), tiles
    bars = card.locator(".omni-bar")
    assert bars.count() == 8 and card.locator(".omni-bar-skipped").count() == sum(
        1 for s in sp["steps"] if s["skipped"] == s["calls"])
    assert_fields_folded(card, {"world size": "2", "calls": str(sp["calls"])})
    screenshot(page, "stats_panel_sequence_parallel.png")
    assert_card_fits_and_follows_the_theme(page, "sequence_parallel", "sequence_parallel_card")

    card = card_after_reload(page, comfy_server, run["run_id"], "sequence_parallel")
    assert card.locator(".omni-card-headline").inner_text() == headline and card.locator(".omni-bar").count() == 8


def test_an_overflowing_metric_keeps_the_panel_live_and_the_history_valid_json(page, comfy, comfy_server):
    open_panel(page)
    prompt_id, run = run_in_page(page, comfy, teacache_graph(threshold=1.0, calibration=OVERFLOW, steps=12), "overflow")
    metrics = [b["metric"] for e in run["evaluations"] for b in e["branches"]]
    assert "Infinity" in metrics  # the probe did overflow; sent as text, not as the non-JSON Infinity
    wait_for_run(page, run["run_id"])  # the live panel followed the run to its end
    view = page.locator(f".omni-run-view[data-run='{run['run_id']}']")
    assert view.locator(".omni-stat-reused .omni-stat-value").inner_text() == f"0/{run['summary']['evaluations']}"
    titles = view.locator(".omni-cell").evaluate_all("cells => cells.map(c => c.title)")
    assert any(t.endswith("change Infinity") for t in titles)
    assert "not a finite number" in view.locator(".omni-warnings").inner_text()
    assert "not a finite number (NaN or Infinity); not plotted" in view.locator(".omni-non-finite-note").inner_text()
    page.reload()
    open_comfy(page, comfy_server.url)
    open_panel(page)
    page.wait_for_selector(f".omni-run[data-run='{run['run_id']}']", timeout=10000)  # history loads with that run
    screenshot(page, "stats_panel_overflow.png")


def test_a_10000_evaluation_run_is_drawn_binned_with_its_features(page):
    """A long live run (steps streamed as the store sends them), then its bounded entry: the panel stays fast, bins
    the strip to the sidebar's width, and shows other features' summaries as cards."""
    from omnitest.pack import pack_module  # the store's own code builds the entry (no ComfyUI needed for it)

    store = pack_module("nodes.stats_store")
    stats_mod = pack_module("omni_hooks.caching.stats")
    config = pack_module("omni_hooks.magcache").MagCacheConfig(mag_ratios=[1.0], model_label="Wan 2.1 T2V 1.3B")
    stats = stats_mod.CacheRunStats("magcache", config)
    for i in range(10_000):
        reason = "retention" if i < 2000 else ("reuse" if i % 3 else "max-skips" if i % 2 else "threshold")
        computed = reason != "reuse"
        stats.record(stats_mod.EvaluationRecord(step=i, total_steps=10_000, computed=computed, seconds=0.001,
                     branches=[stats_mod.BranchDecision(b, computed, reason, (i % 7) / 100, 0.06)
                               for b in ("cond", "uncond")]))
    header = {"run_id": "run-long", "prompt_id": "p-long", "node_id": "21", "node_title": "MagCache long",
              "workflow_id": None, "sampler_node_id": "4", "kind": "magcache", "model": stats.model, "threshold": 0.06,
              "started_at": time.time(), "status": "success", "finished_at": time.time() + 60}
    features = [{"kind": "offload", "node_id": "30", "node_title": "CPU Offload",
                 "summary": {"moved_bytes": 123456789, "prefetch_hits": 0.97}}]
    entry = store.bounded_entry(header, stats, {"features": features, "world_size": 2})
    assert entry["detail"] == "timeline"
    fields = ("run_id", "prompt_id", "node_id", "node_title", "workflow_id", "kind", "model", "threshold", "started_at")
    steps = [{**{k: header[k] for k in fields},
              **stats_mod.json_safe({"step": e.step, "total_steps": 10_000, "computed": e.computed,
                                     "seconds": e.seconds,
                                     "branches": [vars(b) for b in e.branches]})} for e in stats.evaluations]
    open_panel(page)
    elapsed = page.evaluate("""async ([steps, entry]) => {
        const api = window.comfyAPI.api.api, t0 = performance.now();
        for (let i = 0; i < steps.length; i += 100) {
            for (const s of steps.slice(i, i + 100)) api.dispatchCustomEvent('omni_hooks.step', s);
            await new Promise(r => setTimeout(r, 0));
        }
        api.dispatchCustomEvent('omni_hooks.run', entry);
        await new Promise(r => setTimeout(r, 200));
        return performance.now() - t0;
    }""", [steps, entry])
    view = page.locator(".omni-run-view[data-run='run-long']")
    view.locator(".omni-status-success").wait_for(timeout=10000)
    assert elapsed < 20000
    cells = view.locator(".omni-strip").first.locator(".omni-cell")
    width = page.evaluate("() => document.querySelector('.omni-strip').clientWidth")
    assert 8 <= cells.count() <= width / 3 + 1
    assert "Long run: each cell sums several evaluations" in view.inner_text()
    assert view.locator(".omni-strip").count() == 1  # cond and uncond decided alike: one lane
    assert view.locator(".omni-stat-reused .omni-stat-value").inner_text() == f"{stats.reused}/10000"
    card = view.locator(".omni-feature")
    assert card.locator(".omni-card-title").inner_text() == "offload · CPU Offload · #30"
    card.locator("details.omni-fields summary").click()
    assert card.locator("dt").all_inner_texts() == ["moved bytes", "prefetch hits"]
    assert card.locator("dd").all_inner_texts() == ["117.7 MB", "0.97"]
    assert "2 devices" in view.locator(".omni-meta-when").inner_text()
    screenshot(page, "stats_panel_long_run.png")


def test_the_panel_follows_comfyuis_dark_and_light_themes(page, comfy):
    open_panel(page)
    run_in_page(page, comfy, teacache_graph(threshold=1.0), "theme check")
    page.wait_for_selector(".omni-run-view .omni-status-success", timeout=30000)
    looks = {}
    for theme in ("dark", "light"):
        page.evaluate("(t) => window.app.extensionManager.setting.set('Comfy.ColorPalette', t)", theme)
        page.wait_for_function(DARK_THEME_IS, arg=theme, timeout=5000)
        page.wait_for_timeout(300)  # the palette's variables are applied after the class changes
        looks[theme] = page.evaluate("""() => {
            const css = (v) => getComputedStyle(document.documentElement).getPropertyValue(v).trim();
            const probe = document.createElement('div'); document.body.append(probe);
            const rgb = (c) => { probe.style.color = c; return getComputedStyle(probe).color; };
            const panel = document.querySelector('.omni-hooks-panel');
            const bar = document.querySelector('.omni-titlebar');
            const value = document.querySelector('.omni-stat-value');
            const out = {
                text: getComputedStyle(value).color, expectedText: rgb(css('--p-text-color')),
                bar: getComputedStyle(bar).backgroundColor, expectedBar: rgb(css('--p-content-background')),
                barTitle: bar.innerText, barHeight: bar.getBoundingClientRect().height,
                sidebar: getComputedStyle(document.querySelector('.side-bar-panel')).backgroundColor,
            };
            probe.remove();
            return out;
        }""")
        screenshot(page, f"stats_panel_{theme}_theme.png")
    for theme, look in looks.items():
        assert look["text"] == look["expectedText"] and look["bar"] == look["expectedBar"], (theme, look)
        assert look["barTitle"] == "CACHE STATS" and 28 <= look["barHeight"] <= 40, look
        assert contrast(look["text"], look["sidebar"]) >= 4.5, (theme, look)
    assert looks["dark"]["text"] != looks["light"]["text"] and looks["dark"]["bar"] != looks["light"]["bar"]


# the palette's class: on <body> in older frontends, on <html> in newer ones
DARK_THEME_IS = """(t) => [document.documentElement, document.body].some(e => e.classList.contains('dark-theme'))
    === (t === 'dark')"""


def contrast(fg: str, bg: str) -> float:
    """WCAG contrast ratio of two CSS rgb()/rgba() colours."""
    def luminance(color: str) -> float:
        r, g, b = (int(x) / 255 for x in re.findall(r"[\d.]+", color)[:3])
        lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in (r, g, b)]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]
    hi, lo = sorted((luminance(fg), luminance(bg)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def test_an_offloading_runs_card_keeps_its_tiles_and_strip_inside_narrow_and_wide_sidebars(page):
    """This server runs on the CPU, where CPU Offload has nothing to offload to; the card of a run that did offload
    (the shape a GPU run publishes: the library's OffloadStats, per-step totals, the store's bounded entry) still has
    to fit: four tiles, one bar per step with the cache's skipped steps marked, the copy waits in the legend."""
    from omnitest.pack import pack_module

    store = pack_module("nodes.stats_store")
    config = pack_module("omni_hooks.offload").OffloadConfig(prefetch_blocks=1)
    stats = pack_module("omni_hooks.offload.stats").OffloadStats(
        device="cuda:0", blocks=24, config=config, slots=2, slot_bytes=470 << 20, device_bytes=940 << 20,
        offloaded_bytes=24 * (470 << 20), pinned_bytes=24 * (470 << 20), pinned_blocks=24, kept_resident_bytes=0,
        uses_streams=True, block_calls=24 * 18, hits=24 * 18 - 1, sync_loads=1, prefetches=24 * 18 - 1,
        copies=24 * 18, bytes_moved=18 * 24 * (470 << 20), copy_wait_seconds=0.31)
    steps = store.StepTotals()
    for step in range(30):
        skipped = step in range(4, 28, 2)  # 12 of the 30 steps, as a cache skips them
        steps.add(step, skipped=int(skipped), bytes_moved=0 if skipped else 24 * (470 << 20),
                  copy_wait_seconds=0 if skipped else (0.2 if step == 0 else 0.005))
    summary = {**stats.summary(), "active": True, "status": "success", "blocks_total": 40, "blocks_offloaded": 24,
               "blocks_promoted": 0, "calls_computed": 18, "calls_skipped": 12, "bytes_moved_on_skipped_calls": 0,
               "device_weight_bytes": 9 << 30, "unchanged_reason": None, "steps": steps.to_list()}
    header = {"run_id": "run-offloading", "prompt_id": "p-off", "node_id": "11", "node_title": "CPU Offload",
              "workflow_id": None, "sampler_node_id": "3", "kind": "offload", "model": "",
              "threshold": None, "started_at": time.time(), "status": "success", "finished_at": time.time() + 90}
    entry = store.bounded_entry(header, None, {"features": [
        {"kind": "offload", "node_id": "11", "node_title": "CPU Offload", "summary": summary}]})
    open_panel(page)
    page.evaluate("(entry) => window.comfyAPI.api.api.dispatchCustomEvent('omni_hooks.run', entry)", entry)
    card = card_of(page, "run-offloading", "offload")
    card.wait_for(timeout=10000)
    assert card.locator(".omni-card-headline").inner_text() == (
        "24 of 40 blocks in RAM (11.0 GB); sampling waited 0.31 s for copies; nothing moved on the 12 skipped steps")
    assert card.locator(".omni-tile").count() == 4 and card.locator(".omni-bar").count() == 30
    assert card.locator(".omni-bar-skipped").count() == 12
    assert "waited for copies" in card.locator(".omni-legend").inner_text()
    assert_card_fits_and_follows_the_theme(page, "offload", "offloading_card")
