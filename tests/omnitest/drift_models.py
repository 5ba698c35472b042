"""Simulated model drift for the drift tests: Wan's classes changed the way a newer ComfyUI might change them, with
``monkeypatch`` (undone after the test). Import only after ComfyUI's root is on ``sys.path``."""
from __future__ import annotations

import comfy.ldm.wan.model as wan_model


def gain_required_argument(monkeypatch) -> None:
    """``WanAttentionBlock.forward`` with one more required argument, ``gate`` (never passed: calling it fails)."""
    original = wan_model.WanAttentionBlock.forward

    def forward(self, x, e, freqs, context, gate, context_img_len=257, transformer_options={}):
        return original(self, x, e, freqs, context, context_img_len, transformer_options)

    monkeypatch.setattr(wan_model.WanAttentionBlock, "forward", forward)


def take_any_arguments(monkeypatch) -> None:
    """``WanAttentionBlock.forward`` behind ``*args, **kwargs`` that reaches the original through an attribute looked
    up at call time (so no function it calls can be followed): same results, parameters no longer readable."""
    monkeypatch.setattr(wan_model.WanAttentionBlock, "omnitest_original", wan_model.WanAttentionBlock.forward,
                        raising=False)

    def forward(self, *args, **kwargs):
        return type(self).omnitest_original(self, *args, **kwargs)

    monkeypatch.setattr(wan_model.WanAttentionBlock, "forward", forward)


def rope_table_as_pair(monkeypatch) -> None:
    """``WanModel.rope_encode`` returning its rotary table as a (real, imaginary) pair instead of one tensor."""
    original = wan_model.WanModel.rope_encode

    def rope_encode(self, *args, **kwargs):
        return tuple(original(self, *args, **kwargs).unbind(-1))

    monkeypatch.setattr(wan_model.WanModel, "rope_encode", rope_encode)
