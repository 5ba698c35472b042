"""A tiny LTX-2 (audio and video) diffusion-model file for the server tests: the ``ltxav`` tiny model's weights
(``omnitest.tiny_models``), written as a safetensors file that core ``UNETLoader`` loads through ComfyUI's own
detection (``audio_adaln_single`` marks LTX-2; its sizes come from the file's ``config`` metadata, as in the released
checkpoints).

Building the weights imports ComfyUI, which the server tests never do in their own process: they run
``python -m omnitest.tiny_ltx2 <path>`` (``write_in_subprocess``), with ``COMFYUI_PATH`` naming the checkout.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TINY_LTX2_NAME = "tiny_ltx2.safetensors"
CASE = "ltxav"


def write(path: str | os.PathLike) -> Path:
    """Write the file (parents created); needs ComfyUI importable in this process."""
    from safetensors.torch import save_file

    from omnitest.comfy_path import use_comfyui_in_process
    use_comfyui_in_process()
    from omnitest.tiny_models import build_case

    case = build_case(CASE)
    weights = {k: v.contiguous() for k, v in case.diffusion_model.state_dict().items()}
    sizes = {k: v for k, v in case.unet_config.items() if k != "image_model"}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(weights, str(tmp), metadata={"config": json.dumps({"transformer": sizes})})
    os.replace(tmp, path)
    return path


def write_in_subprocess(path: str | os.PathLike, timeout: float = 300.0) -> Path:
    """``write(path)`` in a child Python process (this one never imports ComfyUI); RuntimeError with its output."""
    tests_dir = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests_dir), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "omnitest.tiny_ltx2", str(path)], env=env, capture_output=True,
                          text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"writing {path} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    return Path(path)


if __name__ == "__main__":
    write(sys.argv[1])
