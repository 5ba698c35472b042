"""Z-Image and Z-Image Turbo (ComfyUI's ``ZImage``; comfy/ldm/lumina/model.py: ``NextDiT`` built with
``z_image_modulation``), a Lumina Image 2.0 relative.

``_forward`` embeds the caption (``cap_embedder``, ``context_refiner``) and the image tokens (``x_embedder``, padded
with ``x_pad_token`` to a multiple of 32 when the checkpoint has pad tokens, then ``noise_refiner``), runs ``layers``
(``layer(x, mask, freqs_cis, adaln_input, ...)`` -> x, out of place) over the joint ``[caption | image]`` sequence,
then ``final_layer(x, adaln_input)``; the blocks differ from Lumina 2's in their modulation (``adaLN_modulation`` is
one Linear from a 256-wide time embedding, no SiLU). The stack and signals are Lumina 2's
(``nodes/families/lumina2.py``).

ComfyUI before 0.3.75 has no Z-Image: no NextDiT there is built that way and nothing matches.
"""
from __future__ import annotations

import inspect

import torch

from ...omni_hooks.sequence_parallel import (
    ReplicatedTokens,
    SequenceParallelInput,
    SequenceParallelOutput,
    SequenceParallelPartialInput,
    SequenceParallelRefusedInput,
    SequenceParallelSelfAttention,
)
from .base import ModelFamily, Variant, nothing_published
from .lumina2 import LUMINA_SIGNALS, is_z_image, lumina_stack


def _matches(base_model: torch.nn.Module, dm: torch.nn.Module) -> bool:
    # Z-Image pixel space (NextDiTPixelSpace) deletes the final layer for a per-patch decoder: refused
    return is_z_image(dm) and hasattr(dm, "final_layer")


def _variant(base_model: torch.nn.Module, dm: torch.nn.Module) -> Variant:
    few_step = ("Z-Image Turbo samples in about 8 steps: the caches keep its first and last steps computed and skip "
                "little; see the run statistics")
    return nothing_published(f"Z-Image (dim {dm.dim}, {len(dm.layers)} layers)",
                             "Z-Image (vllm-omni's TeaCache numbers are Qwen-Image's, marked there as 'need to be "
                             "tuned')",
                             few_step)


# Sequence parallelism. Inside ``patchify_and_embed``, ``x_embedder``'s tokens are padded to the pad multiple and run
# through ``noise_refiner`` (image-only attention, the table's image part), then ``layers`` attend ``cat(caption,
# image)`` with the whole table ``freqs_cis`` [B, caption + image, 1, D/2, 2, 2]. ``patchify_and_embed`` must return
# the whole refined image: ComfyUI 0.33 gives the caption length as the joint length minus the image length measured
# before the refiner, so a shard there would put unpatchify at the wrong offset. Hence the image tokens are split at
# ``noise_refiner.0`` (after the pad tokens are appended, so every rank sees the one-process sequence), the refiners'
# image-only table alike at every refiner, and the last refiner's output is gathered back to the whole image. The
# joint sequence is split again at ``layers.0``, its caption part whole (the input's length minus the whole image
# sequence), and the joint table likewise at every layer: the cached stack (layers .. final_layer; the head's cache
# decides on the split arguments) sees this rank's ``[caption | image shard]``. Every refiner and layer attention is
# exchanged; ``final_layer``'s output is gathered back to ``[caption | image]`` before unpatchify. The caption refiner
# attends locally over the whole caption. Z-Image Omni (reference images, newer hosts) passes ``timestep_zero_index``,
# slices of the whole sequence, to the refiners and layers: on a shard they would modulate the wrong tokens, so a call
# with it is refused at the first refiner, before any exchange.
_TIMESTEP_ZERO = "timestep_zero_index"
_TIMESTEP_ZERO_REFUSED = SequenceParallelRefusedInput(
    "Sequence Parallel: Z-Image with reference images (Z-Image Omni) is not supported (their tokens are modulated by "
    "their position in the whole sequence); fix: remove the reference images, or remove Sequence Parallel from this "
    "workflow")


def _sequence_plan(dm: torch.nn.Module) -> dict:
    if not is_z_image(dm) or len(dm.noise_refiner) == 0:
        raise ValueError(f"Sequence Parallel: {type(dm).__name__} without Z-Image's noise refiner does not fit the "
                         "Z-Image plan")
    split_image = {"x": SequenceParallelInput(split_dim=1, expected_dims=3, auto_pad=True)}
    split_table = {"freqs_cis": SequenceParallelInput(split_dim=1, expected_dims=6, auto_pad=True)}
    gather_image = SequenceParallelOutput(gather_dim=1, expected_dims=3)
    if _TIMESTEP_ZERO in inspect.signature(type(dm.noise_refiner[0]).forward).parameters:
        split_image = {**split_image, _TIMESTEP_ZERO: _TIMESTEP_ZERO_REFUSED}
    last = len(dm.noise_refiner) - 1
    if last == 0:  # one spec per module id: the only refiner takes both splits, and "*" names it for the gather
        refiner = {"noise_refiner.0": {**split_image, **split_table}, "noise_refiner.*": gather_image}
    else:
        refiner = {"noise_refiner.0": split_image, "noise_refiner.*": split_table,
                   f"noise_refiner.{last}": gather_image}
    return {
        **refiner,
        "layers.0": {"x": SequenceParallelPartialInput(
            split_dim=1, expected_dims=3, auto_pad=True,
            text_len_source=ReplicatedTokens("x", dim=1, beside="sequence"))},
        "layers.*": {"freqs_cis": SequenceParallelPartialInput(
            split_dim=1, expected_dims=6, auto_pad=True,
            text_len_source=ReplicatedTokens("freqs_cis", dim=1, beside="sequence"))},
        "noise_refiner.*.attention": SequenceParallelSelfAttention(),
        "layers.*.attention": SequenceParallelSelfAttention(joint_tokens=ReplicatedTokens("x")),
        "final_layer": SequenceParallelOutput(gather_dim=1, expected_dims=3, replicated_position="front"),
    }


def _attention_sites(dm: torch.nn.Module) -> list[torch.nn.Module]:
    return [*(layer.attention for layer in dm.noise_refiner), *(layer.attention for layer in dm.layers)]


FAMILY = ModelFamily(
    name="z_image", display_name="Z-Image (Turbo)", matches=_matches, resolve_variant=_variant,
    build_stack=lumina_stack, signals=LUMINA_SIGNALS,
    resident=("x_embedder", "t_embedder", "cap_embedder", "noise_refiner", "context_refiner", "norm_final",
              "final_layer", "x_pad_token", "cap_pad_token"),
    sequence_plan=_sequence_plan, attention_sites=_attention_sites)
