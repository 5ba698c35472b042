"""CPU Offload: the node and its one frozen config (``config_for``), checked once when the node runs; its sampling
run is ``session.OffloadSession``.
"""
from __future__ import annotations

import math
from typing import Any

import comfy.model_management
import comfy.patcher_extension
import torch
from comfy_api.latest import io

from ...omni_hooks.offload import OffloadConfig
from ..families import detect_for_node, model_input
from ..features import CATEGORY, AppliedFeature, Category, ConfigInput, ConfigInputs, attach_feature, display_name
from . import host, kept
from .placement import gib
from .session import KIND, OffloadSession

NODE_ID = "OmniHooks.CPUOffload"
NODE_TITLE = "CPU Offload"
AUTO = -1
MAX_BLOCKS = 256
MAX_PREFETCH = 8
PIN_OPTIONS: dict[str, bool | None] = {"auto": None, "on": True, "off": False}


GIB = 1024 ** 3


def _pin_option(value: str, model=None) -> bool | None:
    if value not in PIN_OPTIONS:  # ComfyUI 0.3.64 does not validate V3 combo values at /prompt
        raise ValueError(f"unknown pin_memory {value!r}; choose one of {list(PIN_OPTIONS)}")
    return PIN_OPTIONS[value]


#: the node's inputs over ``OffloadConfig``: what the node alone means by a value (-1 / 0 = None, a combo's words,
#: GiB); the config checks every value and gives every default
CONFIG_INPUTS = ConfigInputs(OffloadConfig, {
    "blocks_to_offload": ConfigInput("blocks_to_offload", lambda blocks, model: None if blocks == AUTO else blocks,
                                     lambda blocks: AUTO if blocks is None else blocks),
    "pin_memory": ConfigInput("pin_memory", _pin_option,
                              lambda pin: next(name for name, value in PIN_OPTIONS.items() if value is pin)),
    "vram_budget_gb": ConfigInput("vram_budget_bytes", lambda gb, model: None if gb == 0 else gb * GIB,
                                  lambda budget: 0.0 if budget is None else budget / GIB),
})


def config_for(model, **inputs: Any) -> OffloadConfig:
    """The node's one frozen config, from its inputs (``CONFIG_INPUTS``) and ``model``; the config checks each value
    once. ValueError naming the node and its input for a value it cannot use."""
    try:
        config = OffloadConfig(**CONFIG_INPUTS.fields(inputs, model))
    except ValueError as e:
        raise CONFIG_INPUTS.error(NODE_TITLE, e, inputs, model) from None
    detected = detect_for_node(NODE_TITLE, model)
    check_for_this_machine(model, len(detected.build_stack(model.model.diffusion_model).blocks), config)
    return config


def check_for_this_machine(model, block_count: int, config: OffloadConfig) -> None:
    """ValueError naming the node, the input and the fix for a value that cannot work with this MODEL on this machine
    (checked when the node runs, before anything is moved): more blocks to copy ahead than the model has, a load device
    that does not exist, a VRAM budget beyond the device's memory. Where there is nothing to offload to, the
    run changes nothing and says why, so only the block counts are checked."""
    ahead = max(block_count - 1, 1)  # blocks that can be copied ahead of the one computing (the default 1 always)
    prefetch_blocks = config.prefetch_blocks
    if prefetch_blocks > ahead:
        raise ValueError(f"{NODE_TITLE}: prefetch_blocks is {prefetch_blocks} but this model has {block_count} "
                         f"blocks, so at most {ahead} can be copied ahead of the one computing: set prefetch_blocks "
                         f"to {ahead} or less")
    load = torch.device(model.load_device)
    if load.type == "cuda" and load.index is not None and load.index >= torch.cuda.device_count():
        there = ", ".join(f"cuda:{i}" for i in range(torch.cuda.device_count())) or "none"
        raise ValueError(f"{NODE_TITLE}: the MODEL input runs on {load}, which this machine does not have (CUDA "
                         f"devices: {there}): load the model on a device that exists")
    target = host.offload_target(model)
    budget = config.vram_budget_bytes
    if target is None or budget is None:
        return
    total = int(comfy.model_management.get_total_memory(target))
    if budget > total:
        raise ValueError(f"{NODE_TITLE}: vram_budget_gb is {budget / GIB:g} but {target} has {gib(total)} in "
                         f"all: set at most {math.floor(total / GIB * 10) / 10:g}, or 0 for the VRAM ComfyUI "
                         f"reports free")


# -- the node ---------------------------------------------------------------------------------------------------------

class CPUOffload(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        inputs = [
            model_input(" Combine with Apply TeaCache or Apply MagCache in either order."),
            io.Int.Input("blocks_to_offload", default=CONFIG_INPUTS.default("blocks_to_offload"), min=AUTO,
                         max=MAX_BLOCKS,
                         tooltip="How many transformer blocks to stream from system RAM during sampling (the last "
                         "ones of the stack). -1 = auto: as few as needed so that the other blocks, whole, plus the "
                         "streaming slots fit in the VRAM ComfyUI reports free after loading, less its estimate of "
                         "this run's activations (or vram_budget_gb). 0 = none. More than the model has = all."),
            io.Int.Input("prefetch_blocks", default=CONFIG_INPUTS.default("prefetch_blocks"), min=0, max=MAX_PREFETCH,
                         tooltip="How many blocks to copy ahead while a block computes. The GPU holds 1 + this many "
                         "offloaded blocks at once. 1 hides the copies when a block computes longer than it copies "
                         "(video models); raise it for short blocks, 0 copies each block when it runs. At most the "
                         "model's blocks less one."),
            io.Combo.Input("pin_memory", options=list(PIN_OPTIONS), default=CONFIG_INPUTS.default("pin_memory"),
                           tooltip="Page-lock the system-RAM copies of the offloaded blocks so they copy at full "
                           "speed and in the background. auto = on with CUDA, up to half the machine's RAM; off "
                           "saves locked RAM on a machine short of memory."),
            io.Float.Input("vram_budget_gb", default=CONFIG_INPUTS.default("vram_budget_gb"), min=0.0, max=1024.0,
                           step=0.1,
                           tooltip="The most VRAM this model's weights may take while sampling (weights outside the "
                           "blocks + resident blocks + slots). 0 = the VRAM ComfyUI reports free after loading, less "
                           "its estimate of this run's activations. Decides auto, and how many partly loaded blocks "
                           "are completed on the GPU."),
        ]
        return io.Schema(
            node_id=NODE_ID, display_name=display_name(NODE_TITLE), category=CATEGORY,
            description=("Runs a diffusion transformer bigger than the GPU's free memory: the last blocks of its stack "
                         "stay in system RAM and are copied to the GPU one block ahead of the computation (pinned "
                         "memory, a copy stream), the others stay resident. Outputs are identical to sampling "
                         "without the node; LoRAs apply as usual. With Apply TeaCache / Apply MagCache a skipped "
                         "step copies nothing. It changes nothing on a CPU-only ComfyUI and where ComfyUI's dynamic "
                         "VRAM streams the weights itself (ComfyUI 0.33's default on NVIDIA); "
                         "its card and log line say which path a run took."),
            inputs=inputs,
            outputs=[io.Model.Output(tooltip="The same MODEL, with its blocks streamed during its sampling runs.")],
            hidden=[io.Hidden.unique_id])

    @classmethod
    def execute(cls, model, blocks_to_offload: int, prefetch_blocks: int, pin_memory: str,
                vram_budget_gb: float) -> io.NodeOutput:
        config = config_for(model, blocks_to_offload=blocks_to_offload, prefetch_blocks=prefetch_blocks,
                            pin_memory=pin_memory, vram_budget_gb=vram_budget_gb)
        feature = AppliedFeature(kind=KIND, category=Category.OFFLOAD, node_title=NODE_TITLE,
                                 node_id=cls.hidden.unique_id, config=config)
        clone = attach_feature(model, feature)
        # ComfyUI unloading the model frees the packed blocks kept for its next run
        clone.add_callback_with_key(comfy.patcher_extension.CallbacksMP.ON_DETACH, kept.CALLBACK_KEY, kept.on_detach)
        return io.NodeOutput(clone)


__all__ = ["CPUOffload", "OffloadSession", "config_for"]
