"""Workflows saved before the caches' speed-up input existed keep what they did when opened in the real frontend
(web/saved_workflows.js), while a node the user adds shows the fresh speed-up: a saved UI workflow (two example
workflows as an earlier release shipped them, their widget values ending before the input: ``data/``), an API-format
workflow without the input, and one saved by this release (its value kept), each queued as the Run button queues
it; this release's example workflows open at the fresh speed-up. The Calibrate nodes' trial of the speed-up
(``try_speedups``) alike."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from omnitest.comfy_path import PACK_ROOT

SAVED_BEFORE = Path(__file__).parent / "data"  # example workflows as the release before the speed-up shipped them

pytestmark = [pytest.mark.server, pytest.mark.browser]

APPLY = {"OmniHooks.ApplyTeaCache": "rel_l1_thresh", "OmniHooks.ApplyMagCache": "threshold"}


def widgets_of(page, node_type: str) -> list[dict]:
    """Each node of ``node_type`` on the canvas: its widgets' values by name."""
    return page.evaluate("""(type) => window.app.graph._nodes.filter(n => n.type === type)
        .map(n => Object.fromEntries(n.widgets.map(w => [w.name, w.value])))""", node_type)


def queued_inputs(page, node_type: str) -> list[dict]:
    """The inputs of each node of ``node_type`` in the prompt the Run button would queue."""
    return page.evaluate("""async (type) => Object.values((await window.app.graphToPrompt()).output)
        .filter(n => n.class_type === type).map(n => n.inputs)""", node_type)


@pytest.mark.parametrize("example, node_type", [("teacache_wan21_t2v", "OmniHooks.ApplyTeaCache"),
                                                ("magcache_wan22_t2v_14B", "OmniHooks.ApplyMagCache")])
def test_a_workflow_saved_before_the_speedup_opens_with_it_off(page, example, node_type):
    workflow = json.loads((SAVED_BEFORE / f"{example}_saved_before_speedup.json").read_text())
    saved = [n["widgets_values"] for n in workflow["nodes"] if n["type"] == node_type]
    assert saved and all(len(values) < 9 for values in saved)  # saved without the optional inputs
    page.evaluate("async (w) => { await window.app.loadGraphData(w, true, true, 'saved before'); }", workflow)
    for widgets, values in zip(widgets_of(page, node_type), saved):
        assert widgets["speedup"] == 0, widgets
        assert widgets[APPLY[node_type]] == values[0]  # what was saved stays
    assert [inputs["speedup"] for inputs in queued_inputs(page, node_type)] == [0] * len(saved)


@pytest.mark.parametrize("example, node_type", [("teacache_wan21_t2v", "OmniHooks.ApplyTeaCache"),
                                                ("magcache_wan22_t2v_14B", "OmniHooks.ApplyMagCache")])
def test_this_releases_example_workflows_open_and_queue_at_the_fresh_speedup(page, example, node_type):
    workflow = json.loads((PACK_ROOT / "example_workflows" / f"{example}.json").read_text())
    page.evaluate("async (w) => { await window.app.loadGraphData(w, true, true, 'example'); }", workflow)
    speedups = [w["speedup"] for w in widgets_of(page, node_type)]
    assert speedups and speedups == [2.0] * len(speedups)
    assert [inputs["speedup"] for inputs in queued_inputs(page, node_type)] == speedups


def test_a_node_the_user_adds_offers_the_fresh_speedup_and_a_saved_one_keeps_its_value(page):
    page.evaluate("""() => {
        window.app.graph.clear();
        for (const type of ['OmniHooks.ApplyTeaCache', 'OmniHooks.ApplyMagCache']) {
            window.app.graph.add(window.LiteGraph.createNode(type));
        }
    }""")
    for node_type in APPLY:
        assert [w["speedup"] for w in widgets_of(page, node_type)] == [2.0]
    saved = page.evaluate("""() => {
        const tea = window.app.graph._nodes.find(n => n.type === 'OmniHooks.ApplyTeaCache');
        tea.widgets.find(w => w.name === 'speedup').value = 3.75;
        return window.app.graph.serialize();
    }""")
    page.evaluate("async (w) => { await window.app.loadGraphData(w, true, true, 'saved now'); }", saved)
    assert [w["speedup"] for w in widgets_of(page, "OmniHooks.ApplyTeaCache")] == [3.75]
    assert [w["speedup"] for w in widgets_of(page, "OmniHooks.ApplyMagCache")] == [2.0]


def test_an_api_format_workflow_without_the_speedup_opens_with_it_off(page):
    inputs = {"rel_l1_thresh": 0.2, "start_percent": 0.0, "end_percent": 1.0, "cache_device": "compute device",
              "model_variant": "auto"}
    prompt = {"5": {"class_type": "OmniHooks.ApplyTeaCache", "inputs": inputs},
              "6": {"class_type": "OmniHooks.ApplyTeaCache", "inputs": {**inputs, "speedup": 3.0}}}
    page.evaluate("async (p) => { await window.app.loadApiJson(p, 'api format'); }", prompt)
    by_id = page.evaluate("""() => Object.fromEntries(window.app.graph._nodes.map(n => [String(n.id),
        n.widgets.find(w => w.name === 'speedup').value]))""")
    assert by_id == {"5": 0, "6": 3.0}


def test_a_calibrate_workflow_saved_before_the_trial_opens_without_it_and_this_releases_example_with_it(page):
    """The Calibrate nodes' ``try_speedups`` (the speed-up's trial) the same way: a calibration workflow saved before
    the input (the example as the release before it shipped it) opens and queues with it off, so it saves the file it
    did; this release's example and a node the user adds have it on."""
    node_type = "OmniHooks.MagCacheCalibrate"
    before = json.loads((SAVED_BEFORE / "magcache_calibrate_wan21_saved_before_trial.json").read_text())
    now = json.loads((PACK_ROOT / "example_workflows" / "magcache_calibrate_wan21.json").read_text())
    for workflow, expected in ((before, False), (now, True)):
        page.evaluate("async (w) => { await window.app.loadGraphData(w, true, true, 'calibrate'); }", workflow)
        assert [w["try_speedups"] for w in widgets_of(page, node_type)] == [expected]
        assert [inputs["try_speedups"] for inputs in queued_inputs(page, node_type)] == [expected]
    page.evaluate("""() => {
        window.app.graph.clear();
        window.app.graph.add(window.LiteGraph.createNode('OmniHooks.TeaCacheCalibrate'));
    }""")
    assert [w["try_speedups"] for w in widgets_of(page, "OmniHooks.TeaCacheCalibrate")] == [True]
