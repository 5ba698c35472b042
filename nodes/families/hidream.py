"""HiDream-I1 Full / Dev / Fast and E1 (comfy/ldm/hidream/model.py: HiDreamImageTransformer2DModel).

The blocks are ``HiDreamImageBlock`` wrappers whose ``.block`` is the real block. ``_forward`` runs
``double_stream_blocks`` (``block(image_tokens=, image_tokens_masks=, text_tokens=, adaln_input=, rope=, ...)``
-> (image_tokens, text_tokens)), concatenates the text and runs ``single_stream_blocks`` (same keywords,
``text_tokens=None``, -> image_tokens), keeps the image tokens and calls ``final_layer(hidden_states, adaln_input)``.
All blocks are out of place.

Two published signals, each matching the polynomials fitted on it:
  * ``default`` - the timestep embedding ``t_embedder(t)`` (before the pooled embedding is added), what ali-vilab
    TeaCache4HiDream-I1 and welltop measure for ``hidream_i1_full``;
  * ``hidden`` - the image tokens entering the first block (``x_embedder`` output), what welltop measures for
    ``hidream_i1_dev`` and ``hidream_i1_fast``.
"""
from __future__ import annotations

import comfy.ldm.hidream.model as hidream_model
import torch

from ...omni_hooks.blockstack import BlockStack, StackSignal, TensorArg, skip_returning
from .base import DEFAULT_SIGNAL, AutoChoice, Expectations, ForwardParameters, ModelFamily, Variant, skip_by_type

IMAGE = TensorArg("image_tokens", 0)
TEXT = TensorArg("text_tokens", 2)
X = TensorArg("x", 0)  # final_layer(hidden_states, adaln_input)


def _stack(dm: torch.nn.Module) -> BlockStack:
    skip = skip_by_type({hidream_model.HiDreamImageTransformerBlock: skip_returning(IMAGE, TEXT),
                         hidream_model.HiDreamImageSingleTransformerBlock: skip_returning(IMAGE)},
                        inner=lambda wrapper: wrapper.block)
    return BlockStack(blocks=[*dm.double_stream_blocks, *dm.single_stream_blocks], tail=dm.final_layer,
                      head_hidden=IMAGE, tail_hidden=X, skip_block=skip, clone_head_input=False)


def _image_tokens(dm: torch.nn.Module) -> StackSignal:
    return StackSignal(compute=lambda block, args, kwargs, captured: IMAGE.get(args, kwargs))


def _timestep_embedding(dm: torch.nn.Module) -> StackSignal:
    def compute(block, args, kwargs, captured):
        # `captured` is the (batch-expanded) timestep that entered t_embedder; its output is not kept by the model
        # (only t + pooled embedding reaches the blocks), so the small time MLP is evaluated once more here.
        return dm.t_embedder(captured, IMAGE.get(args, kwargs).dtype)
    return StackSignal(compute=compute, capture=dm.t_embedder)


def _matches(base_model: torch.nn.Module, dm: torch.nn.Module) -> bool:
    return isinstance(dm, hidream_model.HiDreamImageTransformer2DModel) and len(dm.double_stream_blocks) > 0


def _variant(base_model: torch.nn.Module, dm: torch.nn.Module) -> Variant:
    return Variant("HiDream-I1", magcache=AutoChoice(None), teacache=AutoChoice("hidream_i1_full", (
        "HiDream-I1 Full, Dev and Fast have the same weights shape: the Full coefficients are used; for Dev or Fast "
        "choose 'hidream_i1_dev' or 'hidream_i1_fast' (a wrong choice gives blocky images)",)))


FAMILY = ModelFamily(
    name="hidream", display_name="HiDream-I1", matches=_matches, resolve_variant=_variant, build_stack=_stack,
    signals={DEFAULT_SIGNAL: _timestep_embedding, "hidden": _image_tokens},
    resident=("x_embedder", "t_embedder", "p_embedder", "caption_projection", "final_layer"),
    auto_keys={"teacache": frozenset({"hidream_i1_full"})},
    expects=Expectations(
        blocks={name: ForwardParameters(("image_tokens", "image_tokens_masks", "text_tokens", "adaln_input", "rope",
                                         "transformer_options"), positions={"image_tokens": 0, "text_tokens": 2})
                for name in ("double_stream_blocks", "single_stream_blocks")},
        call=ForwardParameters(("x", "t", "y", "context", "encoder_hidden_states_llama3", "image_cond", "control",
                                "transformer_options"))))
