"""Test-only ComfyUI node pack, linked into the server tests' custom_nodes/ (never shipped with the pack).

V1 style, no dependencies besides torch and ComfyUI core:

* ``OmniTest.ZeroConditioning`` (tokens, dim, pooled_dim[, nonce]) -> CONDITIONING
  ``[[zeros(1, tokens, dim), {"pooled_output": zeros(1, pooled_dim)} if pooled_dim else {}]]``; a text-encoder-free
  conditioning for the tiny models. ``nonce`` is ignored by the node but part of ComfyUI's cache key: a new value
  makes the node and everything downstream (the sampler) execute again.
* ``OmniTest.Wait`` (latent, seconds) -> LATENT unchanged, after sleeping ``seconds`` in small slices while honouring
  interrupts, so a test has time to interrupt a running prompt.
* ``OmniTest.SlowSteps`` (model, seconds) -> a clone of MODEL whose every diffusion model call first sleeps
  ``seconds`` (a keyed wrapper, as a pack would add one), so a tiny model's run lasts long enough to be watched live.
"""
from __future__ import annotations

import time

import torch

import comfy.model_management
import comfy.patcher_extension


class ZeroConditioning:
    CATEGORY = "_for_testing/omnitest"
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "build"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "tokens": ("INT", {"default": 8, "min": 1, "max": 4096}),
                "dim": ("INT", {"default": 4096, "min": 1, "max": 16384}),
                "pooled_dim": ("INT", {"default": 0, "min": 0, "max": 16384}),
            },
            "optional": {
                "nonce": ("INT", {"default": 0, "min": 0, "max": 0xFFFFFFFFFFFFFFFF}),
            },
        }

    def build(self, tokens, dim, pooled_dim, nonce=0):
        extra = {"pooled_output": torch.zeros(1, pooled_dim)} if pooled_dim else {}
        return ([[torch.zeros(1, tokens, dim), extra]],)


class Wait:
    CATEGORY = "_for_testing/omnitest"
    RETURN_TYPES = ("LATENT",)
    FUNCTION = "wait"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"latent": ("LATENT",),
                             "seconds": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 600.0, "step": 0.01})}}

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")  # never cached: the wait must happen on every run

    def wait(self, latent, seconds):
        sleep(seconds)
        return (latent,)


def sleep(seconds: float) -> None:
    """Sleep ``seconds`` in slices of at most 20 ms, raising as soon as the prompt is interrupted."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        comfy.model_management.throw_exception_if_processing_interrupted()
        time.sleep(min(left, 0.02))
    comfy.model_management.throw_exception_if_processing_interrupted()


class SlowSteps:
    CATEGORY = "_for_testing/omnitest"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    WRAPPER_KEY = "omnitest.slow_steps"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",),
                             "seconds": ("FLOAT", {"default": 0.025, "min": 0.0, "max": 10.0, "step": 0.005})}}

    def patch(self, model, seconds):
        def slow(executor, *args, **kwargs):
            sleep(seconds)
            return executor(*args, **kwargs)
        clone = model.clone()
        clone.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, self.WRAPPER_KEY, slow)
        return (clone,)


NODE_CLASS_MAPPINGS = {
    "OmniTest.ZeroConditioning": ZeroConditioning,
    "OmniTest.Wait": Wait,
    "OmniTest.SlowSteps": SlowSteps,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "OmniTest.ZeroConditioning": "Zero Conditioning (OmniHooks tests)",
    "OmniTest.Wait": "Wait (OmniHooks tests)",
    "OmniTest.SlowSteps": "Slow Steps (OmniHooks tests)",
}
