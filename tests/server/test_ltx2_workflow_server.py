"""The LTX-2 example workflow (example_workflows/api/offload_teacache_calibrate_ltx2.json) run through a ComfyUI
server's HTTP API on the tiny LTX-2 model.

The real model files are not here, so the test keeps the example's graph where it samples (CPU Offload, TeaCache
Calibrate, the video and audio latents joined and split again, the calibration text) and swaps what needs the
missing files: UNETLoader with the tiny LTX-2 file for the checkpoint loader, OmniTest.ZeroConditioning for the Gemma
text encoder, an empty 8 x 16-bin audio latent from a core node for the audio-VAE one, SaveLatent for the decoders.
Then it follows the example's note: Apply TeaCache with the calibration just made, between CPU Offload and a
KSampler, at threshold 0 gives exactly the latents of a plain KSampler, and at the calibration's threshold it runs.
The same graph runs with Sequence Parallel at 2 ranks (the server is rank 0, the pack starts a CPU worker; Ulysses
over the tiny model's 2 video and 2 audio heads) after CPU Offload: the calibration, and a KSampler whose video and
audio latents are the plain KSampler's bit for bit, with Apply TeaCache at threshold 0 on top too.
On a ComfyUI without LTX-2 (before 0.33) every test skips in one line naming the version.
"""
from __future__ import annotations

import json
import uuid

import pytest
import torch

from omnitest.server import REPO_ROOT
from omnitest.tiny_ltx2 import TINY_LTX2_NAME, write_in_subprocess

pytestmark = pytest.mark.server

STEM = "offload_teacache_calibrate_ltx2"
STEPS = 8  # TeaCache Calibrate's minimum
AUDIO_SECONDS = 1.5  # EmptyAceStepLatentAudio: [1, 8, 16, int(1.5 * 44100 / 512 / 8) = 16], LTX-2's [B, 8, T, 16]
TEXT_WIDTH = 64  # the tiny model's processed text: video and audio halves of 32


def load_api() -> dict:
    return json.loads((REPO_ROOT / "example_workflows" / "api" / f"{STEM}.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def tiny_server(comfy_server):
    """The server, once it can load LTX-2, with the tiny LTX-2 file in models/diffusion_models."""
    from omnitest.comfy_path import comfyui_version

    comfy_server.ensure_running()
    with comfy_server.client() as client:
        if "LTXVConcatAVLatent" not in client.object_info():
            pytest.skip(f"ComfyUI {comfyui_version()} has no LTX-2 (LTXVConcatAVLatent)")
    path = comfy_server.models_dir / "diffusion_models" / TINY_LTX2_NAME
    if not path.is_file():
        write_in_subprocess(path)
    return comfy_server


def tiny_prompt(name: str, nonce: int) -> dict:
    """The example's API graph with the file-dependent nodes swapped for the tiny model (see the module doc)."""
    prompt = load_api()
    by_class = {n["class_type"]: nid for nid, n in prompt.items()}
    loader, calibrate, separate = (by_class[c] for c in ("CheckpointLoaderSimple", "OmniHooks.TeaCacheCalibrate",
                                                         "LTXVSeparateAVLatent"))
    prompt[loader] = {"class_type": "UNETLoader", "inputs": {"unet_name": TINY_LTX2_NAME, "weight_dtype": "default"}}
    for nid in [n for n, node in prompt.items() if node["class_type"] == "CLIPTextEncode"]:
        prompt[nid] = {"class_type": "OmniTest.ZeroConditioning",
                       "inputs": {"tokens": 8, "dim": TEXT_WIDTH, "pooled_dim": 0, "nonce": nonce}}
    prompt[by_class["LTXVEmptyLatentAudio"]] = {"class_type": "EmptyAceStepLatentAudio",
                                                "inputs": {"seconds": AUDIO_SECONDS, "batch_size": 1}}
    prompt[by_class["EmptyLTXVLatentVideo"]]["inputs"] |= {"width": 128, "height": 128, "length": 9}
    prompt[calibrate]["inputs"] |= {"steps": STEPS, "name": name}
    for gone in ("LTXAVTextEncoderLoader", "LTXVAudioVAELoader", "VAEDecode", "LTXVAudioVAEDecode", "CreateVideo",
                 "SaveVideo"):
        del prompt[by_class[gone]]
    prefix = f"latents/ltx2_{uuid.uuid4().hex[:8]}"
    prompt["90"] = {"class_type": "SaveLatent", "inputs": {"samples": [separate, 0], "filename_prefix": prefix + "_v"}}
    prompt["91"] = {"class_type": "SaveLatent", "inputs": {"samples": [separate, 1], "filename_prefix": prefix + "_a"}}
    return prompt


def sampled_with(prompt: dict, model_chain: list[dict]) -> dict:
    """``prompt`` with TeaCache Calibrate replaced by a KSampler of the same settings on CPU Offload's MODEL after
    ``model_chain`` (nodes fed the previous MODEL in order), as the example's note says."""
    prompt = json.loads(json.dumps(prompt))
    calibrate = next(nid for nid, n in prompt.items() if n["class_type"] == "OmniHooks.TeaCacheCalibrate")
    model = prompt[calibrate]["inputs"]["model"]
    for i, node in enumerate(model_chain):
        nid = str(80 + i)
        prompt[nid] = {"class_type": node["class_type"], "inputs": {**node["inputs"], "model": model}}
        model = [nid, 0]
    inputs = {k: v for k, v in prompt[calibrate]["inputs"].items() if k != "name"}
    prompt[calibrate] = {"class_type": "KSampler", "inputs": {**inputs, "model": model, "denoise": 1.0}}
    prompt.pop(next(nid for nid, n in prompt.items() if n["class_type"] == "PreviewAny"))
    for nid in [n for n, node in prompt.items() if node["class_type"] == "SaveLatent"]:
        prompt[nid]["inputs"]["filename_prefix"] += f"_{uuid.uuid4().hex[:6]}"
    return prompt


def test_the_example_runs_on_tiny_ltx2_and_its_calibration_then_drives_apply_teacache(tiny_server):
    name = f"tiny-ltx2-{uuid.uuid4().hex[:8]}"
    prompt = tiny_prompt(name, nonce=uuid.uuid4().int & 0xFFFFFFFF)
    # the sampling part is the example's own: loader -> CPU Offload -> TeaCache Calibrate
    calibrate = next(nid for nid, n in prompt.items() if n["class_type"] == "OmniHooks.TeaCacheCalibrate")
    offload = prompt[calibrate]["inputs"]["model"][0]
    assert prompt[offload]["class_type"] == "OmniHooks.CPUOffload"
    with tiny_server.client() as comfy:
        result = comfy.run(prompt, timeout=300)
        video, audio = result.latent("90"), result.latent("91")
        assert video.shape == (1, 128, 2, 4, 4) and audio.shape == (1, 8, 16, 16)
        assert torch.isfinite(video).all() and torch.isfinite(audio).all() and video.abs().sum() > 0
        assert any(name in text for text in result.outputs[calibrate]["text"]), result.outputs
        data = json.loads((tiny_server.base_dir / "user" / "omni_hooks" / "teacache" / f"{name}.json").read_text())
        assert data["family"] == "ltxav" and len(data["coefficients"]) == 5

        option = f"calibration: {name}"
        plain = comfy.run(sampled_with(prompt, []), timeout=300)
        apply = {"class_type": "OmniHooks.ApplyTeaCache",
                 "inputs": {"rel_l1_thresh": 0.0, "start_percent": 0.0, "end_percent": 1.0,
                            "cache_device": "compute device", "model_variant": option}}
        at_zero = comfy.run(sampled_with(prompt, [apply]), timeout=300)
        for node in ("90", "91"):  # threshold 0 through CPU Offload: exactly the plain latents, video and audio
            assert torch.equal(at_zero.latent(node), plain.latent(node)), node
        # and the calibration (the same inputs as its own run, so the first sampled latents match too)
        assert torch.equal(plain.latent("90"), video) and torch.equal(plain.latent("91"), audio)
        apply["inputs"]["rel_l1_thresh"] = -1.0
        recommended = comfy.run(sampled_with(prompt, [apply]), timeout=300)
        assert torch.isfinite(recommended.latent("90")).all() and torch.isfinite(recommended.latent("91")).all()


SEQUENCE_PARALLEL = {"class_type": "OmniHooks.SequenceParallel",
                     "inputs": {"world_size": 2, "ulysses_degree": "auto", "ring_degree": "auto", "devices": "auto",
                                "backend": "auto", "master_address": "127.0.0.1", "master_port": 0,
                                "cfg_parallel": False}}


def test_the_example_runs_with_sequence_parallel_at_two_ranks(tiny_server):
    name = f"tiny-ltx2-sp-{uuid.uuid4().hex[:8]}"
    base = tiny_prompt(name, nonce=uuid.uuid4().int & 0xFFFFFFFF)
    prompt = json.loads(json.dumps(base))
    calibrate = next(nid for nid, n in prompt.items() if n["class_type"] == "OmniHooks.TeaCacheCalibrate")
    prompt["85"] = {**SEQUENCE_PARALLEL, "inputs": {**SEQUENCE_PARALLEL["inputs"],
                                                    "model": prompt[calibrate]["inputs"]["model"]}}
    prompt[calibrate]["inputs"]["model"] = ["85", 0]  # loader -> CPU Offload -> Sequence Parallel -> Calibrate
    with tiny_server.client() as comfy:
        result = comfy.run(prompt, timeout=600)
        assert any(name in text for text in result.outputs[calibrate]["text"]), result.outputs
        data = json.loads((tiny_server.base_dir / "user" / "omni_hooks" / "teacache" / f"{name}.json").read_text())
        assert data["family"] == "ltxav" and len(data["coefficients"]) == 5
        trials = data["speedup_trials"]  # the example's Calibrate tries the speed-up: one run per speed-up and forecast
        runs = comfy.get_json("/omni_hooks/runs", {"prompt_id": result.prompt_id})["runs"]
        assert len(runs) == 1 + len(trials["speedups"]) * len(trials["orders"])
        assert all(entry["status"] == "success" and entry["world_size"] == 2 for entry in runs)

        plain = comfy.run(sampled_with(base, []), timeout=300)
        parallel = comfy.run(sampled_with(base, [SEQUENCE_PARALLEL]), timeout=600)
        apply = {"class_type": "OmniHooks.ApplyTeaCache",
                 "inputs": {"rel_l1_thresh": 0.0, "start_percent": 0.0, "end_percent": 1.0,
                            "cache_device": "compute device", "model_variant": f"calibration: {name}"}}
        cached = comfy.run(sampled_with(base, [SEQUENCE_PARALLEL, apply]), timeout=600)
        for node in ("90", "91"):  # video and audio
            assert torch.equal(parallel.latent(node), plain.latent(node)), node
            assert torch.equal(cached.latent(node), plain.latent(node)), node
