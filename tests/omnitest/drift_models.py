"""Simulated model drift for the drift tests: Wan's classes (and LTX-2's and Kandinsky 5's, ComfyUI 0.33) changed the
way a newer ComfyUI might change them, with ``monkeypatch`` (undone after the test). Import only after ComfyUI's root
is on ``sys.path``."""
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


def compressed_timestep_by_another_name(monkeypatch) -> None:
    """LTX-2's ``CompressedTimestep`` keeping its frame count under another name (``frames`` for ``num_frames``)."""
    import comfy.ldm.lightricks.av_model as av_model

    class Renamed:
        def __init__(self, tensor, patches_per_frame, per_frame=False):
            self.data, self.frames = tensor, tensor.shape[1]
            self.patches_per_frame = patches_per_frame or 1

    monkeypatch.setattr(av_model, "CompressedTimestep", Renamed)


def kandinsky5_rope_as_pair(monkeypatch) -> None:
    """Kandinsky 5's ``rope_encode_3d`` returning its rotary table as a (real, imaginary) pair."""
    import comfy.ldm.kandinsky5.model as k5

    original = k5.Kandinsky5.rope_encode_3d

    def rope_encode_3d(self, *args, **kwargs):
        return tuple(original(self, *args, **kwargs).unbind(-1))

    monkeypatch.setattr(k5.Kandinsky5, "rope_encode_3d", rope_encode_3d)
