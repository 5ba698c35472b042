"""The pack's example workflows, checked against a running ComfyUI server (the real model files are not here: only
their video output is executed).

Layout: ``example_workflows/<name>.json`` (UI format; ComfyUI 0.3.64 lists every ``*.json`` directly in that folder in
its template browser, under the custom-node folder's name, and serves it with ``<name>.jpg`` as the thumbnail from
``/api/workflow_templates/<folder>/``) and ``example_workflows/api/<name>.json`` (the same graph in API format; in a
subfolder so the template browser does not offer it as a broken template).

Every node type and widget value is checked against /object_info (see ``omnitest.workflows`` for how widgets_values
map onto inputs, frontend-only control_after_generate widgets included), the UI and API files must describe the
same graph, every sampler gets exactly one cache node (Apply TeaCache / Apply MagCache) between its model loader and
itself (a calibrate node samples the loader's model directly), queuing the API graph must fail only because the
model files are missing, and each example's video output (CreateVideo, SaveVideo) runs with the inputs it ships. One
set of files serves every host of the matrix: the checks read this server's node definitions and model what its
frontend makes of a saved workflow (``omnitest.workflows``). The Wan 2.2 A14B example must keep the layout of ComfyUI's
own Wan 2.2 14B T2V template (served by the server from the installed comfyui-workflow-templates package) with one Apply
MagCache per expert.
"""
from __future__ import annotations

import json
import tomllib

import pytest

from omnitest.server import PACK_DIR_NAME, REPO_ROOT, PromptRejected
from omnitest.workflows import (ACTIVE_MODE, FRONTEND_ONLY_NODES, as_run, fold_values, ui_to_api, upstream,
                                validate_api,
                                validate_ui, widget_layout)

pytestmark = pytest.mark.server

EXAMPLES = REPO_ROOT / "example_workflows"
API_DIR = EXAMPLES / "api"
APPLY = "OmniHooks.ApplyTeaCache"
APPLY_MAGCACHE = "OmniHooks.ApplyMagCache"
CACHES = (APPLY, APPLY_MAGCACHE)
CALIBRATORS = ("OmniHooks.TeaCacheCalibrate", "OmniHooks.MagCacheCalibrate")
SAMPLERS = ("KSampler", "KSamplerAdvanced", *CALIBRATORS)
LOADERS = ("UNETLoader", "CheckpointLoaderSimple")
PACK_ID = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["name"]

# input name -> models/ subfolder, for the loader inputs whose files the test server does not have
MODEL_INPUTS = {"unet_name": "diffusion_models", "ckpt_name": "checkpoints", "text_encoder": "text_encoders",
                "clip_name": "text_encoders",
                "clip_name1": "text_encoders", "clip_name2": "text_encoders", "clip_name3": "text_encoders",
                "vae_name": "vae"}
MODEL_SUFFIXES = (".safetensors", ".gguf", ".pt", ".pth", ".ckpt", ".sft")

# the usual ComfyUI file names (those of ComfyUI's own Wan 2.1, Wan 2.2 14B and Flux dev templates), per input
WAN21_FILES = {"unet_name": ["wan2.1_t2v_1.3B_fp16.safetensors"],
               "clip_name": ["umt5_xxl_fp8_e4m3fn_scaled.safetensors"],
               "vae_name": ["wan_2.1_vae.safetensors"]}
EXPECTED = {
    "teacache_wan21_t2v": WAN21_FILES,
    "teacache_flux_dev_t2i": {"unet_name": ["flux1-dev.safetensors"], "clip_name1": ["clip_l.safetensors"],
                              "clip_name2": ["t5xxl_fp16.safetensors"], "vae_name": ["ae.safetensors"]},
    "magcache_wan21_t2v": WAN21_FILES,
    "magcache_wan22_t2v_14B": {"unet_name": ["wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors",
                                             "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors"],
                               "clip_name": ["umt5_xxl_fp8_e4m3fn_scaled.safetensors"],
                               "vae_name": ["wan_2.1_vae.safetensors"]},
    "magcache_calibrate_wan21": WAN21_FILES,
    "offload_teacache_wan21_t2v_14B": {**WAN21_FILES, "unet_name": ["wan2.1_t2v_14B_fp8_scaled.safetensors"]},
    "sequence_parallel_magcache_wan21_t2v_14B": {**WAN21_FILES,
                                                 "unet_name": ["wan2.1_t2v_14B_fp8_scaled.safetensors"]},
    "sequence_parallel_magcache_flux2_dev": {"unet_name": ["flux2_dev_fp8mixed.safetensors"],
                                             "clip_name": ["mistral_3_small_flux2_bf16.safetensors"],
                                             "vae_name": ["flux2-vae.safetensors"]},
}
# examples of models only a newer ComfyUI has: a node the example needs that older versions lack
REQUIRES_NODE = {"sequence_parallel_magcache_flux2_dev": "EmptyFlux2LatentImage",
                 "offload_teacache_calibrate_ltx2": "LTXVConcatAVLatent"}

# the cache node of every sampler (in the order the samplers denoise), with the settings the example shows: a fresh
# node's (its speed-up, every other input at its default), TeaCache's coefficients picked from the model, MagCache's
# published curve ('auto', or the Wan 2.2 A14B part of each expert); a calibrate node has none.
FRESH = {"forecast": "off", "forward_budget": 0, "skip_correction": 0.0, "speedup": 2.0}
TEACACHE_RECOMMENDED = {"rel_l1_thresh": -1, "start_percent": 0, "end_percent": 1, "cache_device": "compute device",
                        "model_variant": "auto", **FRESH}
MAGCACHE_DEFAULTS = {"threshold": 0.06, "max_skip_steps": 2, "retention_ratio": 0.2, "start_percent": 0,
                     "end_percent": 1, "cache_device": "compute device", **FRESH}
EXPECTED_CACHES = {
    "teacache_wan21_t2v": [(APPLY, TEACACHE_RECOMMENDED)],
    "teacache_flux_dev_t2i": [(APPLY, TEACACHE_RECOMMENDED)],
    "magcache_wan21_t2v": [(APPLY_MAGCACHE, MAGCACHE_DEFAULTS | {"curve": "auto"})],
    "magcache_wan22_t2v_14B": [(APPLY_MAGCACHE, MAGCACHE_DEFAULTS | {"curve": "wan2.2_t2v_14B (high noise)"}),
                               (APPLY_MAGCACHE, MAGCACHE_DEFAULTS | {"curve": "wan2.2_t2v_14B (low noise)"})],
    "magcache_calibrate_wan21": [None],
    "offload_teacache_wan21_t2v_14B": [(APPLY, TEACACHE_RECOMMENDED)],
    "sequence_parallel_magcache_wan21_t2v_14B": [(APPLY_MAGCACHE, MAGCACHE_DEFAULTS | {"curve": "auto"})],
    "sequence_parallel_magcache_flux2_dev": [(APPLY_MAGCACHE, MAGCACHE_DEFAULTS | {"curve": "auto"})],
    "offload_teacache_calibrate_ltx2": [None],  # no published LTX-2 numbers: calibrates first (its note: then apply)
}
OFFLOAD = "OmniHooks.CPUOffload"
SEQUENCE_PARALLEL = "OmniHooks.SequenceParallel"
# the examples with CPU Offload / Sequence Parallel in a sampler's model chain, with the settings they show (the
# node's defaults)
EXPECTED_MODEL_NODES = {
    OFFLOAD: {stem: {"blocks_to_offload": -1, "prefetch_blocks": 1, "pin_memory": "auto", "vram_budget_gb": 0}
              for stem in ("offload_teacache_wan21_t2v_14B", "offload_teacache_calibrate_ltx2")},
    SEQUENCE_PARALLEL: {stem: {
        "world_size": 2, "ulysses_degree": "auto", "ring_degree": "auto", "devices": "auto", "backend": "auto",
        "master_address": "127.0.0.1", "master_port": 0, "cfg_parallel": False}
        for stem in ("sequence_parallel_magcache_wan21_t2v_14B", "sequence_parallel_magcache_flux2_dev")},
}
WAN22_TEMPLATE = "video_wan2_2_14B_t2v"  # ComfyUI's own template the A14B example follows

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


def skip_without_its_nodes(object_info: dict, stem: str) -> None:
    """Skip, in one line naming the ComfyUI version, an example whose model this ComfyUI cannot load."""
    from omnitest.comfy_path import comfyui_version

    node = REQUIRES_NODE.get(stem)
    if node is not None and node not in object_info:
        pytest.skip(f"ComfyUI {comfyui_version()} has no {node} node, which {stem} needs")


def test_expected_examples_exist_in_both_formats():
    assert set(EXPECTED) <= set(UI_STEMS), UI_STEMS
    assert set(EXPECTED_CACHES) == set(UI_STEMS), "every example needs its EXPECTED_CACHES entry"
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
    skip_without_its_nodes(object_info, stem)
    workflow = load_ui(stem)
    assert workflow.get("version") == 0.4 and workflow.get("id"), "not a current frontend workflow"
    problems = validate_ui(workflow, object_info, missing_model_ok)
    assert not problems, "\n".join(problems)
    nodes = [n for n in workflow["nodes"] if n["type"] not in FRONTEND_ONLY_NODES]
    for node in nodes:
        if node["type"].startswith("OmniHooks."):
            assert node["properties"].get("cnr_id") == PACK_ID, node["properties"]
        layout = widget_layout(object_info[node["type"]], node["widgets_values"])
        values = dict(zip([w.name for w in layout], node["widgets_values"]))
        for model in node.get("properties", {}).get("models", []):
            inputs = [name for name, value in values.items() if value == model["name"]]
            assert inputs and all(MODEL_INPUTS.get(i) == model["directory"] for i in inputs), (node["type"], model)
            assert model["url"].startswith("https://huggingface.co/") and model["name"] in model["url"], model


@pytest.mark.parametrize("stem", API_STEMS)
def test_api_workflow_matches_the_servers_node_definitions(object_info, stem):
    skip_without_its_nodes(object_info, stem)
    problems = validate_api(load_api(stem), object_info, missing_model_ok)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("stem", UI_STEMS)
def test_ui_and_api_versions_describe_the_same_graph(object_info, stem):
    skip_without_its_nodes(object_info, stem)
    """What this host's frontend queues for the UI file is what this server runs for the API file (one API file
    serves every host: an older server ignores the sub-inputs a newer one adds to an input, a newer one gives the
    optional inputs it adds their defaults)."""
    assert as_run(ui_to_api(load_ui(stem), object_info), object_info) == as_run(load_api(stem), object_info)


def samplers_in_order(prompt: dict) -> list[str]:
    """The sampler nodes, each after the sampler whose latent it continues (Wan 2.2: high-noise expert first)."""
    samplers = [nid for nid, n in prompt.items() if n["class_type"] in SAMPLERS]
    return sorted(samplers, key=lambda nid: len([s for s in upstream(prompt, nid, "latent_image") if s in samplers]))


@pytest.mark.parametrize("stem", API_STEMS)
def test_each_sampler_gets_one_cache_between_its_loader_and_itself(stem):
    prompt = load_api(stem)
    samplers = samplers_in_order(prompt)
    assert samplers, "no sampler"
    found = []
    for sampler in samplers:
        chain = upstream(prompt, sampler, "model")
        classes = [prompt[nid]["class_type"] for nid in chain]
        assert classes and classes[-1] in LOADERS, classes
        caches = [nid for nid in chain if prompt[nid]["class_type"] in CACHES]
        if prompt[sampler]["class_type"] in CALIBRATORS:
            assert not caches, f"{sampler} calibrates a model that already has a cache: {classes}"
            found.append(None)
            continue
        assert len(caches) == 1, classes
        cache = prompt[caches[0]]
        found.append((cache["class_type"], {k: v for k, v in cache["inputs"].items() if k != "model"}))
    assert found == EXPECTED_CACHES[stem]
    if stem in EXPECTED:
        files: dict[str, list] = {}
        for n in prompt.values():
            for name, value in n["inputs"].items():
                if name in MODEL_INPUTS:
                    files.setdefault(name, []).append(value)
        assert {name: sorted(values) for name, values in files.items()} == EXPECTED[stem]


@pytest.mark.parametrize("node_type", [OFFLOAD, SEQUENCE_PARALLEL])
@pytest.mark.parametrize("stem", API_STEMS)
def test_offload_and_sequence_parallel_sit_between_the_loader_and_the_cache_with_their_defaults(object_info, stem,
                                                                                               node_type):
    prompt = load_api(stem)
    found = {}
    for sampler in samplers_in_order(prompt):
        chain = [prompt[nid] for nid in upstream(prompt, sampler, "model")]
        classes = [n["class_type"] for n in chain]
        nodes = [n for n in chain if n["class_type"] == node_type]
        if nodes:
            assert len(nodes) == 1, classes
            assert classes.index(node_type) > max((i for i, c in enumerate(classes) if c in CACHES), default=-1), \
                f"the cache should take the {node_type} MODEL (either order works; the example shows one): {classes}"
            found[stem] = {k: v for k, v in nodes[0]["inputs"].items() if k != "model"}
    assert found.get(stem) == EXPECTED_MODEL_NODES[node_type].get(stem)
    if stem in found:
        defaults = {w.name: w.options.get("default") for w in widget_layout(object_info[node_type])}
        assert found[stem] == {k: defaults[k] for k in found[stem]}


def host_value_node(kind: str, inputs: dict) -> tuple | None:
    """The outputs of ComfyUI's own ``ComfyMathExpression`` on value inputs (the one computing value node ComfyUI's
    templates use), from the host's node itself; None for any other node."""
    if kind != "ComfyMathExpression":
        return None
    from omnitest.comfy_path import use_comfyui_in_process

    use_comfyui_in_process()
    from comfy_extras.nodes_math import MathExpressionNode

    values = {name.split(".", 1)[1]: v for name, v in inputs.items() if name.startswith("values.")}
    return MathExpressionNode.execute(inputs["expression"], values).result


def test_wan22_example_follows_comfyuis_own_template_with_one_magcache_per_expert(comfy, object_info):
    """The A14B example is the fp8_scaled (no LoRA) workflow of ComfyUI's Wan 2.2 14B T2V template, with one Apply
    MagCache between each expert's ModelSamplingSD3 and its KSamplerAdvanced: the same files, shift, steps, switch
    step, sampler settings, size and prompts, and the expert part that matches each loader.

    The template as the server serves it, with the templates the host's requirements pin: since
    comfyui-workflow-templates 0.11 (ComfyUI 0.33's) a subgraph whose LoRA switch is off by default and whose settings
    are primitives, compared flattened and folded (``flatten_subgraphs``, ``fold_values``). Older ones (ComfyUI
    0.3.64's 0.1.95) ship the no-LoRA workflow bypassed beside the LoRA one, with shift 8 where the newer template
    has 5 on both paths, and a prompt one word shorter: the example follows the newer template, and with the older one
    those two are the differences allowed, each checked."""
    r = comfy.get(f"/templates/{WAN22_TEMPLATE}.json")
    if r.status_code != 200:
        pytest.skip(f"the server does not serve ComfyUI's {WAN22_TEMPLATE} template (comfyui-workflow-templates)")
    template = r.json()
    legacy = not template.get("definitions", {}).get("subgraphs")
    for node in template["nodes"]:  # the older template ships the no-LoRA workflow bypassed: compare it as if enabled
        node["mode"] = ACTIVE_MODE
    reference = fold_values(ui_to_api(template, object_info), host_value_node)
    ours = load_api("magcache_wan22_t2v_14B")

    def experts(prompt: dict, with_cache: bool) -> list[dict]:
        """Per sampler (in denoising order) of the no-LoRA workflow: its inputs and its model chain's nodes."""
        result = []
        for sampler in samplers_in_order(prompt):
            chain = [prompt[nid] for nid in upstream(prompt, sampler, "model")]
            if any(n["class_type"] == "LoraLoaderModelOnly" for n in chain):
                continue
            by_class = {n["class_type"]: n["inputs"] for n in chain}
            expected_chain = ["ModelSamplingSD3", "UNETLoader"]
            assert [n["class_type"] for n in chain] == ([APPLY_MAGCACHE] if with_cache else []) + expected_chain
            inputs = {k: v for k, v in prompt[sampler]["inputs"].items() if not isinstance(v, list)}
            del inputs["noise_seed"]  # the template randomizes it, the example fixes it
            inputs["end_at_step"] = min(inputs["end_at_step"], inputs["steps"])  # at or past the last step: the end
            latent = prompt[prompt[sampler]["inputs"]["latent_image"][0]]
            result.append({"sampler": inputs, "unet": by_class["UNETLoader"],
                           "shift": round(by_class["ModelSamplingSD3"]["shift"], 6),
                           "cache": by_class.get(APPLY_MAGCACHE), "latent": latent["class_type"],
                           "latent_inputs": None if latent["class_type"] in SAMPLERS else latent["inputs"],
                           "prompts": [prompt[prompt[sampler]["inputs"][k][0]]["inputs"]["text"]
                                       for k in ("positive", "negative")]})
        return result

    want, got = experts(reference, False), experts(ours, True)
    assert len(want) == len(got) == 2, (want, got)
    for phase, w, g in zip(("high noise", "low noise"), want, got):
        assert phase.replace(" ", "_") in g["unet"]["unet_name"], g["unet"]
        assert g["cache"]["curve"] == f"wan2.2_t2v_14B ({phase})", g["cache"]
        g.pop("cache"), w.pop("cache")
        if legacy:  # the older template's known differences from the newer one the example follows
            assert (w.pop("shift"), g.pop("shift")) == (8.0, 5.0)
            assert w.pop("prompts")[0].endswith("cinematic portrait.") and g.pop("prompts")[0].endswith(
                "cinematic slow-motion portrait.")
        assert g == w, phase
    high, low = got[0]["sampler"], got[1]["sampler"]
    assert high["end_at_step"] == low["start_at_step"] < high["steps"] == low["steps"], (high, low)


@pytest.mark.parametrize("stem", API_STEMS)
def test_queuing_the_api_workflow_fails_only_for_the_missing_model_files(comfy, object_info, stem):
    skip_without_its_nodes(object_info, stem)
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


CACHE_DEVICE_WIDGET = {APPLY: 3, APPLY_MAGCACHE: 5}  # index of cache_device in the node's widgets_values


def _cache_type(workflow: dict) -> str:
    (cache,) = {n["type"] for n in workflow["nodes"] if n["type"] in CACHES}
    return cache


def _mutations(workflow: dict) -> dict[str, dict]:
    """Broken copies of a UI workflow, each with one mistake the checks must catch."""
    cache = _cache_type(workflow)

    def copy_with(change):
        broken = json.loads(json.dumps(workflow))
        change(broken, {n["type"]: n for n in broken["nodes"]})
        return broken

    return {
        "control widget dropped": copy_with(lambda w, by: by["KSampler"]["widgets_values"].pop(1)),
        "values swapped": copy_with(lambda w, by: by["KSampler"]["widgets_values"].__setitem__(
            slice(2, 5), ["euler", 1.0, 20])),  # steps, cfg, sampler_name -> sampler_name, cfg, steps
        "unknown sampler": copy_with(lambda w, by: by["KSampler"]["widgets_values"].__setitem__(4, "nope")),
        "threshold out of range": copy_with(lambda w, by: by[cache]["widgets_values"].__setitem__(0, -3)),
        "unknown cache device": copy_with(lambda w, by: by[cache]["widgets_values"].__setitem__(
            CACHE_DEVICE_WIDGET[cache], "gpu 7")),
        "unknown node type": copy_with(lambda w, by: by[cache].__setitem__("type", "OmniHooks.Nope")),
        "dangling link": copy_with(lambda w, by: by[cache]["inputs"][0].__setitem__("link", 99999)),
        "model file in the wrong input": copy_with(lambda w, by: by["VAELoader"]["widgets_values"].__setitem__(
            0, "not-a-model-file")),
    }


MUTATED = [s for s in UI_STEMS if {"KSampler", "VAELoader"} <= {n["type"] for n in load_ui(s)["nodes"]}
           and any(n["type"] in CACHES for n in load_ui(s)["nodes"])]


@pytest.mark.parametrize("stem", MUTATED)
def test_the_checks_catch_broken_workflows(object_info, stem):
    skip_without_its_nodes(object_info, stem)
    workflow = load_ui(stem)
    for what, broken in _mutations(workflow).items():
        assert validate_ui(broken, object_info, missing_model_ok), f"not caught: {what}"
    api = load_api(stem)
    cache = next(nid for nid, n in api.items() if n["class_type"] in CACHES)
    variant = "model_variant" if api[cache]["class_type"] == APPLY else "curve"
    broken = json.loads(json.dumps(api))
    broken[cache]["inputs"][variant] = "no such variant"
    assert validate_api(broken, object_info, missing_model_ok)
    broken = json.loads(json.dumps(api))
    del broken[cache]["inputs"]["end_percent"]
    assert validate_api(broken, object_info, missing_model_ok)
    assert ui_to_api(_mutations(workflow)["values swapped"], object_info) != api


VIDEO_STEMS = [s for s in API_STEMS if any(n["class_type"] == "SaveVideo" for n in load_api(s).values())]


@pytest.mark.parametrize("stem", VIDEO_STEMS)
def test_the_examples_video_output_runs_as_shipped(comfy, stem):
    """The example's CreateVideo and SaveVideo, with the inputs the API file ships (core nodes whose inputs changed
    across ComfyUI versions), run on this server and save a video; the decoded frames come from EmptyImage and the
    audio, where the example has some, from EmptyAudio, since the real model files are not here."""
    prompt = load_api(stem)
    (save,) = [nid for nid, n in prompt.items() if n["class_type"] == "SaveVideo"]
    create = prompt[save]["inputs"]["video"][0]
    assert prompt[create]["class_type"] == "CreateVideo", prompt[create]
    tail = {nid: json.loads(json.dumps(prompt[nid])) for nid in (create, save)}
    tail["frames"] = {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "batch_size": 5, "color": 0}}
    tail[create]["inputs"]["images"] = ["frames", 0]
    if "audio" in tail[create]["inputs"]:
        tail["audio"] = {"class_type": "EmptyAudio", "inputs": {"duration": 0.2, "sample_rate": 16000, "channels": 1}}
        tail[create]["inputs"]["audio"] = ["audio", 0]
    result = comfy.run(tail)
    saved = [item for out in result.outputs.get(save, {}).values() if isinstance(out, list) for item in out
             if isinstance(item, dict) and "filename" in item]
    assert saved, result.outputs
    path = comfy.output_dir / saved[0].get("subfolder", "") / saved[0]["filename"]
    assert path.is_file() and path.stat().st_size > 0, path
