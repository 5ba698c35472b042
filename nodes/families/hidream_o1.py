"""HiDream-O1 (ComfyUI's ``HiDreamO1``; comfy/ldm/hidream_o1/model.py: ``HiDreamO1Transformer``, ComfyUI 0.33).

A pixel-space image model inside a language model (Qwen3-VL's decoder, ``language_model``): ``_forward`` embeds the
prompt's tokens (the timestep replaces its ``<|tms|>`` token) and the image's 32x32 patches, concatenates them and
runs ``language_model.layers`` (``layer(x=, attention_mask=, freqs_cis=, optimized_attention=, past_key_value=)``
-> ``(x, keys and values)``; each layer adds into its input ``x`` in place), then ``language_model.norm`` (the tail)
and the final layer on the image tokens.

The model keeps the prompt's keys and values itself: the first call for a prompt (``past_key_value=()``) runs the
whole sequence and keeps each layer's keys and values of the prompt (the tokens before ``<|tms|>``, which attend
causally to each other only, so they do not change with the image or the timestep); later calls run the layers on
the rest (the ``<|tms|>`` token and the image tokens) and prepend the kept keys and values
(``past_key_value=(keys, values, prompt length)``). The model finds its entry by the prompt's tokens and the
reference tensor's identity; ComfyUI hands it a new reference tensor on every call, so with reference images nearly
every call fills the cache. So:

* the caches never skip a call that fills that cache (``must_compute``: the reason ``model-cache``); a skipped later
  call passes its layers' inputs through and the model discards their keys and values; the first later call has
  another length than the filling call, so it computes too (reason ``shape``), and the residuals reused after it are
  those of the tokens after the prompt;
* CPU Offload moves only weights: the kept keys and values are activations the layers computed, the same wherever
  the weights were;
* Sequence Parallel: none (``sequence_refusal``).

ComfyUI before 0.33 has no HiDream-O1: the class is probed from its module only when that module is loaded.
"""
from __future__ import annotations

import sys

import torch

from ...omni_hooks.blockstack import BlockStack, StackSignal, TensorArg, skip_returning
from ...omni_hooks.caching.stats import MODEL_CACHE
from .base import (DEFAULT_SIGNAL, Expectations, ForwardParameters, ModelFamily, Variant, call_arg,
                   nothing_published)

X = TensorArg("x", 0)  # the sequence a layer receives (and, positionally, the norm after the layers)
PAST = TensorArg("past_key_value", 4)
_MODULE = "comfy.ldm.hidream_o1.model"
# hidden size of the released checkpoint (Qwen3-VL-8B's decoder)
_SIZES = {4096: "8B"}


def _transformer_class() -> type | tuple:
    """``HiDreamO1Transformer`` when ComfyUI's module is loaded (a model of it can only exist then), else ()."""
    return getattr(sys.modules.get(_MODULE), "HiDreamO1Transformer", ())


def _fills_model_cache(args: tuple, kwargs: dict) -> str | None:
    """``must_compute``: a layer call that gives the model the prompt's keys and values to keep (``()``)."""
    past = call_arg(args, kwargs, "past_key_value", 4)
    return MODEL_CACHE if isinstance(past, tuple) and len(past) == 0 else None


def _stack(dm: torch.nn.Module) -> BlockStack:
    lm = dm.language_model
    return BlockStack(blocks=list(lm.layers), tail=lm.norm, head_hidden=X, tail_hidden=X,
                      skip_block=skip_returning(X, PAST), clone_head_input=True, must_compute=_fills_model_cache)


def _modulated_input(dm: torch.nn.Module) -> StackSignal:
    # The first layer's attention input, input_layernorm(x), with the layer's own norm: the timestep reaches the
    # layers only as the <|tms|> token of this sequence (there is no modulation to measure), so the normalised
    # sequence is the signal, as for HiDream-I1 dev/fast.
    return StackSignal(compute=lambda block, args, kwargs, captured: block.input_layernorm(X.get(args, kwargs)))


def _matches(base_model: torch.nn.Module, dm: torch.nn.Module) -> bool:
    lm = getattr(dm, "language_model", None)
    return (isinstance(dm, _transformer_class()) and len(lm.layers) > 0
            and isinstance(getattr(lm, "norm", None), torch.nn.Module))


def _variant(base_model: torch.nn.Module, dm: torch.nn.Module) -> Variant:
    size = _SIZES.get(dm.hidden_size) or f"hidden size {dm.hidden_size}"
    return nothing_published(f"HiDream-O1 {size}", "HiDream-O1",
                             "a call that fills the model's own prompt key/value cache is always computed")


FAMILY = ModelFamily(
    name="hidream_o1", display_name="HiDream-O1", matches=_matches, resolve_variant=_variant,
    build_stack=_stack, signals={DEFAULT_SIGNAL: _modulated_input},
    # the reference-image vision tower, the timestep and patch embeddings, the final layer, and the language model's
    # token embedding and final norm (the tail)
    resident=("visual", "t_embedder1", "x_embedder", "final_layer2", "language_model.embed_tokens",
              "language_model.norm"),
    sequence_refusal=("its attention is a function the model builds on every call (a causal pass over the prompt "
                      "straight through PyTorch, then the image tokens over every key), and the keys and values it "
                      "keeps of the prompt and the image tokens it selects index the whole sequence; the caches and "
                      "CPU Offload work on it"),
    expects=Expectations(
        blocks={"language_model.layers": ForwardParameters(
            ("x", "attention_mask", "freqs_cis", "optimized_attention", "past_key_value"),
            positions={"x": 0, "past_key_value": 4})},
        call=ForwardParameters(("x", "timesteps", "context", "transformer_options", "**kwargs"))))
