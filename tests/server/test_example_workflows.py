"""The pack's example workflows, checked against a running ComfyUI server (nothing is executed: the real model files
are not here).

Layout: ``example_workflows/<name>.json`` (UI format; ComfyUI 0.3.64 lists every ``*.json`` directly in that folder in
its template browser, under the custom-node folder's name, and serves it with ``<name>.jpg`` as the thumbnail from
``/api/workflow_templates/<folder>/``) and ``example_workflows/api/<name>.json`` (the same graph in API format; in a
subfolder so the template browser does not offer it as a broken template).

Every node type and widget value is checked against /object_info (see ``omnitest.workflows`` for how widgets_values
map onto inputs, frontend-only control_after_generate widgets included), the UI and API files must describe the
same graph, Apply TeaCache must sit between the model loader and the sampler, and queuing the API graph must fail
only because the model files are missing.
"""
from __future__ import annotations

import json
import tomllib

import pytest

from omnitest.server import PACK_DIR_NAME, REPO_ROOT, PromptRejected
from omnitest.workflows import FRONTEND_ONLY_NODES, ui_to_api, upstream, validate_api, validate_ui, widget_layout

pytestmark = pytest.mark.server

EXAMPLES = REPO_ROOT / "example_workflows"
API_DIR = EXAMPLES / "api"
APPLY = "OmniHooks.ApplyTeaCache"
PACK_ID = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["name"]

# input name -> models/ subfolder, for the loader inputs whose files the test server does not have
MODEL_INPUTS = {"unet_name": "diffusion_models", "ckpt_name": "checkpoints", "clip_name": "text_encoders",
                "clip_name1": "text_encoders", "clip_name2": "text_encoders", "clip_name3": "text_encoders",
                "vae_name": "vae"}
MODEL_SUFFIXES = (".safetensors", ".gguf", ".pt", ".pth", ".ckpt", ".sft")

# the usual ComfyUI file names (those of ComfyUI's own Wan 2.1 and Flux dev templates)
EXPECTED = {
    "teacache_wan21_t2v": {"unet_name": "wan2.1_t2v_1.3B_fp16.safetensors",
                           "clip_name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors",
                           "vae_name": "wan_2.1_vae.safetensors"},
    "teacache_flux_dev_t2i": {"unet_name": "flux1-dev.safetensors", "clip_name1": "clip_l.safetensors",
                              "clip_name2": "t5xxl_fp16.safetensors", "vae_name": "ae.safetensors"},
}

UI_STEMS = sorted(p.stem for p in EXAMPLES.glob("*.json"))
API_STEMS = sorted(p.stem for p in API_DIR.glob("*.json"))


def missing_model_ok(input_name: str, value) -> bool:
    return input_name in MODEL_INPUTS and isinstance(value, str) and value.endswith(MODEL_SUFFIXES)


def load_ui(stem: str) -> dict:
    return json.loads((EXAMPLES / f"{stem}.json").read_text(encoding="utf-8"))


def load_api(stem: str) -> dict:
    return json.loads((API_DIR / f"{stem}.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def object_info(comfy_server) -> dict:
    comfy_server.ensure_running()
    with comfy_server.client() as client:
        return client.object_info()


def test_expected_examples_exist_in_both_formats():
    assert set(EXPECTED) <= set(UI_STEMS), UI_STEMS
    assert UI_STEMS == API_STEMS, f"UI {UI_STEMS} vs API {API_STEMS}: every example needs both formats"
    assert not [p.name for p in EXAMPLES.glob("*.api.json")], "API copies belong in example_workflows/api/"


def test_template_browser_lists_and_serves_the_ui_workflows(comfy):
    listed = comfy.get_json("/workflow_templates").get(PACK_DIR_NAME)
    assert listed is not None, f"{PACK_DIR_NAME} not in /workflow_templates"
    assert sorted(listed) == UI_STEMS, listed  # the API copies in api/ are not listed
    for stem in UI_STEMS:
        r = comfy.get(f"/api/workflow_templates/{PACK_DIR_NAME}/{stem}.json")
        assert r.status_code == 200 and r.json() == load_ui(stem)
        thumb = comfy.get(f"/api/workflow_templates/{PACK_DIR_NAME}/{stem}.jpg")  # what the browser shows
        assert thumb.status_code == 200 and thumb.content[:3] == b"\xff\xd8\xff", f"{stem}.jpg missing or not a JPEG"


@pytest.mark.parametrize("stem", UI_STEMS)
def test_ui_workflow_matches_the_servers_node_definitions(object_info, stem):
    workflow = load_ui(stem)
    assert workflow.get("version") == 0.4 and workflow.get("id"), "not a current frontend workflow"
    problems = validate_ui(workflow, object_info, missing_model_ok)
    assert not problems, "\n".join(problems)
    nodes = [n for n in workflow["nodes"] if n["type"] not in FRONTEND_ONLY_NODES]
    for node in nodes:
        if node["type"].startswith("OmniHooks."):
            assert node["properties"].get("cnr_id") == PACK_ID, node["properties"]
        values = dict(zip([w.name for w in widget_layout(object_info[node["type"]])], node["widgets_values"]))
        for model in node.get("properties", {}).get("models", []):
            inputs = [name for name, value in values.items() if value == model["name"]]
            assert inputs and all(MODEL_INPUTS.get(i) == model["directory"] for i in inputs), (node["type"], model)
            assert model["url"].startswith("https://huggingface.co/") and model["name"] in model["url"], model


@pytest.mark.parametrize("stem", API_STEMS)
def test_api_workflow_matches_the_servers_node_definitions(object_info, stem):
    problems = validate_api(load_api(stem), object_info, missing_model_ok)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("stem", UI_STEMS)
def test_ui_and_api_versions_describe_the_same_graph(object_info, stem):
    assert ui_to_api(load_ui(stem), object_info) == load_api(stem)


@pytest.mark.parametrize("stem", API_STEMS)
def test_apply_teacache_sits_between_the_loader_and_the_sampler(stem):
    prompt = load_api(stem)
    samplers = [nid for nid, n in prompt.items() if n["class_type"] in ("KSampler", "KSamplerAdvanced")]
    assert samplers, "no sampler"
    for sampler in samplers:
        chain = upstream(prompt, sampler, "model")
        classes = [prompt[nid]["class_type"] for nid in chain]
        assert classes.count(APPLY) == 1 and classes[-1] in ("UNETLoader", "CheckpointLoaderSimple"), classes
    teacache = [n for n in prompt.values() if n["class_type"] == APPLY]
    assert len(teacache) == 1
    # the examples show the recommended settings: published threshold and coefficients picked from the model
    assert teacache[0]["inputs"] | {"model": None} == {"model": None, "rel_l1_thresh": -1, "start_percent": 0,
                                                       "end_percent": 1, "cache_device": "compute device",
                                                       "model_variant": "auto"}
    if stem in EXPECTED:
        files = {name: value for n in prompt.values() for name, value in n["inputs"].items() if name in MODEL_INPUTS}
        assert files == EXPECTED[stem]


@pytest.mark.parametrize("stem", API_STEMS)
def test_queuing_the_api_workflow_fails_only_for_the_missing_model_files(comfy, stem):
    prompt = load_api(stem)
    wanted = {(nid, name) for nid, n in prompt.items() for name, value in n["inputs"].items()
              if name in MODEL_INPUTS and not isinstance(value, list)}
    with pytest.raises(PromptRejected) as info:
        comfy.queue(prompt)  # the test server has none of the real models
    errors = info.value.node_errors
    found = set()
    for nid, entry in errors.items():
        for e in entry["errors"]:
            assert e["type"] == "value_not_in_list", (nid, e)
            found.add((nid, e["extra_info"]["input_name"]))
    assert found == wanted, f"errors {sorted(found)} != missing model inputs {sorted(wanted)}"


def _mutations(workflow: dict) -> dict[str, dict]:
    """Broken copies of a UI workflow, each with one mistake the checks must catch."""
    def copy_with(change):
        broken = json.loads(json.dumps(workflow))
        change(broken, {n["type"]: n for n in broken["nodes"]})
        return broken

    return {
        "control widget dropped": copy_with(lambda w, by: by["KSampler"]["widgets_values"].pop(1)),
        "values swapped": copy_with(lambda w, by: by["KSampler"]["widgets_values"].__setitem__(
            slice(2, 5), ["euler", 1.0, 20])),  # steps, cfg, sampler_name -> sampler_name, cfg, steps
        "unknown sampler": copy_with(lambda w, by: by["KSampler"]["widgets_values"].__setitem__(4, "nope")),
        "threshold out of range": copy_with(lambda w, by: by[APPLY]["widgets_values"].__setitem__(0, -3)),
        "unknown cache device": copy_with(lambda w, by: by[APPLY]["widgets_values"].__setitem__(3, "gpu 7")),
        "unknown node type": copy_with(lambda w, by: by[APPLY].__setitem__("type", "OmniHooks.Nope")),
        "dangling link": copy_with(lambda w, by: by[APPLY]["inputs"][0].__setitem__("link", 99999)),
        "model file in the wrong input": copy_with(lambda w, by: by["VAELoader"]["widgets_values"].__setitem__(
            0, "not-a-model-file")),
    }


@pytest.mark.parametrize("stem", [s for s in EXPECTED if s in UI_STEMS])
def test_the_checks_catch_broken_workflows(object_info, stem):
    workflow = load_ui(stem)
    for what, broken in _mutations(workflow).items():
        assert validate_ui(broken, object_info, missing_model_ok), f"not caught: {what}"
    api = load_api(stem)
    teacache = next(nid for nid, n in api.items() if n["class_type"] == APPLY)
    broken = json.loads(json.dumps(api))
    broken[teacache]["inputs"]["model_variant"] = "no such variant"
    assert validate_api(broken, object_info, missing_model_ok)
    broken = json.loads(json.dumps(api))
    del broken[teacache]["inputs"]["end_percent"]
    assert validate_api(broken, object_info, missing_model_ok)
    assert ui_to_api(_mutations(workflow)["values swapped"], object_info) != api
