"""Tiny real diffusion models built in-process from ComfyUI's own model classes, at least one per registered family.

Every case is a real ``comfy.model_base.BaseModel`` subclass (``WAN21``, ``WAN21_Vace``, ``WAN22``, ``Flux``,
``Chroma``, ``HunyuanVideo``, ``LTXV``, ``QwenImage``, ``Lumina2``, ``HiDream``) around the real diffusion
``nn.Module`` (``WanModel``, ``Flux``, ...), shrunk to hidden sizes of 64 with 1-2 blocks of each kind and narrow
text widths, wrapped in a ``comfy.model_patcher.ModelPatcher`` on CPU. Sampling goes through
``comfy.sample.sample`` - ComfyUI's own KSampler, CFG, conds batching, wrappers and model loading.

How a case is built (the steps of ``comfy.sd.load_diffusion_model_state_dict``, minus state-dict detection,
which cannot shrink most of these families on ComfyUI 0.3.64):

1. a small ``unet_config`` is written by hand per family;
2. ``comfy.model_detection.model_config_from_unet_config`` picks the ``comfy.supported_models`` class
   the host would pick for it (checked against the expected class name);
3. ``set_inference_dtype(float32, manual_cast)`` then ``get_model({}, "")`` builds the BaseModel;
4. every parameter is filled deterministically from ``seed`` (the host's ``load_model_weights`` step);
5. ``ModelPatcher(model, load_device=cpu, offload_device=cpu)``.

Every case names the registered model family (``nodes/families/``) it is a model of (``CASE_FAMILY``); the host tests
fail for a registered family without a case. The case names and families are importable without ComfyUI (test
parametrisation needs them at collection); building and sampling need ComfyUI's root on ``sys.path``
(``tests/host/conftest.py`` puts it there).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from omnitest.host_config import unet_config_for_host

if TYPE_CHECKING:
    import comfy.clip_vision
    import comfy.model_patcher

__all__ = ["CASES", "CASE_FAMILY", "TinyCase", "build_case", "packed_latent", "sample"]

Conditioning = list  # ComfyUI CONDITIONING: [[cross_attn_tensor, {extra keys}], ...]


@dataclass
class TinyCase:
    """One tiny model plus inputs that sample it the way the matching ComfyUI workflow would.

    Contract:
      * ``patcher`` is a fresh ``ModelPatcher`` (load and offload device CPU, float32) around a model nobody
        else holds; tests that patch must sample a ``patcher.clone()``, as nodes do.
      * ``positive`` / ``negative`` are CONDITIONING lists with the widths and extra keys this model needs;
        they differ from each other, have equal token counts (so CFG batches cond and uncond in one forward;
        except for a model ComfyUI calls once per branch, ``calls_per_step`` 2) and are never mutated by sampling.
      * ``latent`` has the model's latent shape (channels, 4-D image or 5-D ``[B, C, T, H, W]`` video).
        It is what the empty-latent / image-to-video node would output: zeros, except ``wan22_ti2v`` whose
        first frame is an encoded start image; ``noise_mask`` is then the node's ``noise_mask`` (0 = keep).
      * ``cfg`` is > 1 unless the family is guidance/step distilled (Flux dev/schnell/Kontext, HunyuanVideo).
      * ``config_name`` is the ``comfy.supported_models`` class used; ``unet_config`` the config it was given.
      * ``family`` is the registered model family (``nodes/families/``) the pack must detect on ``patcher``.
    """

    name: str
    family: str  # the registered model family (nodes/families/) this is a model of
    patcher: comfy.model_patcher.ModelPatcher
    positive: Conditioning
    negative: Conditioning
    latent: torch.Tensor
    cfg: float
    steps: int = 4
    noise_mask: Optional[torch.Tensor] = None
    config_name: str = ""
    unet_config: dict = field(default_factory=dict)
    #: diffusion-model calls per sampling step at cfg > 1: 1 where ComfyUI batches cond and uncond into one call, 2
    #: for a model that takes batch size 1 (MiniMax-H3), whose branches ComfyUI calls one after the other
    calls_per_step: int = 1

    def call_steps(self, steps: int) -> list[int]:
        """The step of each diffusion-model call of a ``steps``-step sampling run at cfg > 1, in call order."""
        return [step for step in range(steps) for _ in range(self.calls_per_step)]

    @property
    def diffusion_model(self) -> torch.nn.Module:
        """The diffusion ``nn.Module`` (``patcher.model.diffusion_model``), shared by every clone."""
        return self.patcher.model.diffusion_model


# --------------------------------------------------------------------------------------------------
# Inputs


def _randn(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=g) * scale


def _cond(g: torch.Generator, tokens: int, width: int, **extra: Any) -> Conditioning:
    """One conditioning entry: ``[[randn(1, tokens, width), extra]]``."""
    return [[_randn(g, 1, tokens, width), dict(extra)]]


def _pair(g: torch.Generator, tokens: int, width: int, extra: Callable[[], dict]) -> tuple[Conditioning, Conditioning]:
    """Positive and negative conditioning of equal shape; ``extra()`` builds each entry's extra dict."""
    return _cond(g, tokens, width, **extra()), _cond(g, tokens, width, **extra())


def _clip_vision_output(g: torch.Generator, tokens: int) -> comfy.clip_vision.Output:
    """A CLIP-vision output as ``CLIPVisionEncode`` returns it; Wan i2v reads ``penultimate_hidden_states``."""
    import comfy.clip_vision

    out = comfy.clip_vision.Output()
    out["penultimate_hidden_states"] = _randn(g, 1, tokens, 1280)
    return out


# --------------------------------------------------------------------------------------------------
# Case specs: (registered family, supported_models class name, model_base class name, unet_config, inputs builder,
# cfg)

_Inputs = tuple[Conditioning, Conditioning, torch.Tensor, Optional[torch.Tensor]]


@dataclass(frozen=True)
class _Spec:
    family: str
    config_name: str
    base_model: str
    unet_config: dict
    inputs: Callable[[torch.Generator], _Inputs]
    cfg: float
    #: the ComfyUI class this case needs, ``(module, name)``: on a ComfyUI without it, building the case skips the test
    requires: Optional[tuple[str, str]] = None
    #: fills the diffusion model's buffers as a checkpoint would (``torch.empty`` ones are otherwise uninitialised)
    buffers: Optional[Callable[[torch.nn.Module], None]] = None
    #: see ``TinyCase.calls_per_step``
    calls_per_step: int = 1


def _wan_config(**over: Any) -> dict:
    cfg = {
        "image_model": "wan2.1", "model_type": "t2v", "patch_size": (1, 2, 2), "in_dim": 16, "out_dim": 16,
        "dim": 64, "ffn_dim": 128, "freq_dim": 256, "text_dim": 32, "num_heads": 2, "num_layers": 2,
        "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6,
    }
    cfg.update(over)
    return cfg


def _wan_t2v_inputs(g: torch.Generator) -> _Inputs:
    pos, neg = _pair(g, 8, 32, dict)
    return pos, neg, torch.zeros(1, 16, 2, 8, 8), None  # EmptyHunyuanLatentVideo(64x64, length 5)


def _wan_i2v_inputs(g: torch.Generator) -> _Inputs:
    # WanImageToVideo: concat_latent_image (VAE-encoded start image + grey frames), concat_mask (0 = given
    # frame) and the CLIP-vision output, on both positive and negative.
    concat = _randn(g, 1, 16, 2, 8, 8)
    mask = torch.ones(1, 1, 2, 8, 8)
    mask[:, :, :1] = 0.0
    clip = _clip_vision_output(g, 4)
    extra = lambda: {"concat_latent_image": concat, "concat_mask": mask, "clip_vision_output": clip}  # noqa: E731
    pos, neg = _pair(g, 8, 32, extra)
    return pos, neg, torch.zeros(1, 16, 2, 8, 8), None


def _wan_vace_inputs(g: torch.Generator) -> _Inputs:
    # WanVaceToVideo: vace_frames [B, 32, T, H, W] (inactive + reactive latents), vace_mask [B, 64, T, H, W],
    # vace_strength; lists, one item per control video.
    frames = [_randn(g, 1, 32, 2, 8, 8)]
    vmask = [torch.ones(1, 64, 2, 8, 8)]
    extra = lambda: {"vace_frames": frames, "vace_mask": vmask, "vace_strength": [1.0]}  # noqa: E731
    pos, neg = _pair(g, 8, 32, extra)
    return pos, neg, torch.zeros(1, 16, 2, 8, 8), None


def _wan22_ti2v_inputs(g: torch.Generator) -> _Inputs:
    # Wan22ImageToVideoLatent with a start image: first latent frame given, noise_mask 0 there, 1 elsewhere
    # (WAN22.process_timestep then makes per-token timesteps).
    latent = torch.zeros(1, 48, 2, 4, 4)
    latent[:, :, :1] = _randn(g, 1, 48, 1, 4, 4)
    mask = torch.ones(1, 1, 2, 4, 4)
    mask[:, :, :1] = 0.0
    pos, neg = _pair(g, 8, 32, dict)
    return pos, neg, latent, mask


def _flux_config(guidance_embed: bool) -> dict:
    return {
        "image_model": "flux", "in_channels": 16, "out_channels": 16, "patch_size": 2, "vec_in_dim": 32,
        "context_in_dim": 32, "hidden_size": 64, "mlp_ratio": 4.0, "num_heads": 2, "depth": 1,
        "depth_single_blocks": 1, "axes_dim": [8, 12, 12], "theta": 10000, "qkv_bias": True,
        "guidance_embed": guidance_embed,
    }


def _flux_inputs(g: torch.Generator) -> _Inputs:
    pos, neg = _pair(g, 8, 32, lambda: {"pooled_output": _randn(g, 1, 32), "guidance": 3.5})
    return pos, neg, torch.zeros(1, 16, 8, 8), None  # EmptySD3LatentImage(64x64)


def _flux_schnell_inputs(g: torch.Generator) -> _Inputs:
    pos, neg = _pair(g, 8, 32, lambda: {"pooled_output": _randn(g, 1, 32)})
    return pos, neg, torch.zeros(1, 16, 8, 8), None


def _flux_kontext_inputs(g: torch.Generator) -> _Inputs:
    # ReferenceLatent: reference_latents = [VAE-encoded image]; FluxGuidance 2.5.
    ref = [_randn(g, 1, 16, 8, 8)]
    pos, neg = _pair(g, 8, 32, lambda: {"pooled_output": _randn(g, 1, 32), "guidance": 2.5, "reference_latents": ref})
    return pos, neg, torch.zeros(1, 16, 8, 8), None


def _chroma_inputs(g: torch.Generator) -> _Inputs:
    # T5-only text encoder: pooled_output is None.
    pos, neg = _pair(g, 8, 32, lambda: {"pooled_output": None})
    return pos, neg, torch.zeros(1, 16, 8, 8), None


def _hunyuan_video_inputs(g: torch.Generator) -> _Inputs:
    pos, neg = _pair(g, 8, 32, lambda: {"pooled_output": _randn(g, 1, 32), "guidance": 6.0})
    return pos, neg, torch.zeros(1, 16, 2, 8, 8), None


def _ltxv_inputs(g: torch.Generator) -> _Inputs:
    # LTXV's T5 encoder returns an attention mask; LTXVConditioning sets frame_rate.
    ones = torch.ones(1, 8, dtype=torch.long)
    pos, neg = _pair(g, 8, 32, lambda: {"attention_mask": ones, "frame_rate": 25.0})
    return pos, neg, torch.zeros(1, 128, 2, 4, 4), None  # EmptyLTXVLatentVideo(128x128, length 9)


def _qwen_image_inputs(g: torch.Generator) -> _Inputs:
    pos, neg = _pair(g, 8, 32, dict)
    return pos, neg, torch.zeros(1, 16, 1, 8, 8), None  # EmptySD3LatentImage after fix_empty_latent_channels


def _lumina2_inputs(g: torch.Generator) -> _Inputs:
    # The Gemma encoder returns attention_mask; all ones -> model gets num_tokens only.
    ones = torch.ones(1, 8, dtype=torch.long)
    pos, neg = _pair(g, 8, 32, lambda: {"attention_mask": ones})
    return pos, neg, torch.zeros(1, 16, 8, 8), None


def _hidream_inputs(g: torch.Generator) -> _Inputs:
    # cross_attn = T5 [1, L, 32]; conditioning_llama3 = [1, n_llama_layers, L2, 48]; pooled_output [1, 32].
    pos, neg = _pair(g, 8, 32, lambda: {"pooled_output": _randn(g, 1, 32),
                                        "conditioning_llama3": _randn(g, 1, 2, 6, 48)})
    return pos, neg, torch.zeros(1, 16, 8, 8), None


def _flux2_inputs(g: torch.Generator) -> _Inputs:
    # Mistral text encoder, no pooled output; ComfyUI pads the text to 512 tokens (model_base.Flux2.extra_conds).
    pos, neg = _pair(g, 8, 32, lambda: {"pooled_output": None, "guidance": 4.0})
    return pos, neg, torch.zeros(1, 128, 8, 8), None  # EmptyFlux2LatentImage(128x128)


def _z_image_inputs(g: torch.Generator) -> _Inputs:
    ones = torch.ones(1, 8, dtype=torch.long)
    pos, neg = _pair(g, 8, 32, lambda: {"attention_mask": ones})
    return pos, neg, torch.zeros(1, 16, 8, 8), None  # EmptySD3LatentImage(64x64): 16 tokens, padded to 32


def _hunyuan_video15_inputs(g: torch.Generator) -> _Inputs:
    # Qwen2.5-VL text plus ByT5 glyph tokens (conditioning_byt5small); HunyuanVideo15EmptyLatent: 32 channels
    pos, neg = _pair(g, 8, 32, lambda: {"pooled_output": None, "conditioning_byt5small": _randn(g, 1, 4, 1472)})
    return pos, neg, torch.zeros(1, 32, 2, 8, 8), None


def _hunyuan_video15_sr_inputs(g: torch.Generator) -> _Inputs:
    # HunyuanVideo15SuperResolution: concat_latent_image [B, 2C + 2, T, H, W] with the upscaled low-resolution latent
    # at [C + 1, 2C + 1) and ones at 2C + 1; noise_augmentation.
    cond = torch.zeros(1, 66, 2, 8, 8)
    cond[:, 33:65] = _randn(g, 1, 32, 2, 8, 8)
    cond[:, 65] = 1.0
    pos, neg = _pair(g, 8, 32, lambda: {"pooled_output": None, "conditioning_byt5small": _randn(g, 1, 4, 1472),
                                        "concat_latent_image": cond, "noise_augmentation": 0.7})
    return pos, neg, torch.zeros(1, 32, 2, 8, 8), None


def _ltxav_inputs(g: torch.Generator) -> _Inputs:
    # LTX-2's Gemma encoder gives the processed text of both streams side by side (2 x caption_channels) and an
    # attention mask; LTXVConditioning sets frame_rate. LTXVConcatAVLatent: the video latent
    # (EmptyLTXVLatentVideo(128x128, length 9)) and the audio latent ([B, 8, frames, 16], LTXVEmptyLatentAudio) as
    # one NestedTensor.
    import comfy.nested_tensor

    ones = torch.ones(1, 8, dtype=torch.long)
    pos, neg = _pair(g, 8, 64, lambda: {"attention_mask": ones, "frame_rate": 25.0})
    latent = comfy.nested_tensor.NestedTensor([torch.zeros(1, 128, 2, 4, 4), torch.zeros(1, 8, 5, 16)])
    return pos, neg, latent, None


def _kandinsky5_inputs(g: torch.Generator) -> _Inputs:
    # Qwen2.5-VL text [1, L, in_text_dim] and the CLIP pooled output (y); EmptyHunyuanLatentVideo(64x64, length 5).
    # Text-to-video: concat_cond adds zeros and a zero mask (16 + 16 + 1 channels, 132 = 33 x 2 x 2 per patch).
    pos, neg = _pair(g, 8, 32, lambda: {"pooled_output": _randn(g, 1, 32)})
    return pos, neg, torch.zeros(1, 16, 2, 8, 8), None


def _kandinsky5_image_inputs(g: torch.Generator) -> _Inputs:
    # the same text; EmptySD3LatentImage(64x64): Flux's [B, 16, H, W] latent, no concat (64 = 16 x 2 x 2 per patch)
    pos, neg, _video, _ = _kandinsky5_inputs(g)
    return pos, neg, torch.zeros(1, 16, 8, 8), None


def _hidream_o1_inputs(g: torch.Generator) -> _Inputs:
    # HiDream-O1's tokenizer-only text encoder: the chat template's token ids as text_input_ids (the cross_attn
    # slot holds them as floats, [1, L, 1]); the model embeds them itself. Pixel space: EmptyImage-like [B, 3, H, W]
    # in 32x32 patches (64x96: 6 image tokens).
    template = ([151644, 872, 198], [151645, 198, 151644, 77091, 198, 151669, 151673])  # im_start user \n | ... tms

    def cond() -> Conditioning:
        ids = torch.tensor([[*template[0], *torch.randint(0, 151000, (6,), generator=g).tolist(), *template[1]]])
        return [[ids.unsqueeze(-1).float(), {"text_input_ids": ids}]]
    return cond(), cond(), torch.zeros(1, 3, 64, 96), None


def _minimax_h3_inputs(g: torch.Generator) -> _Inputs:
    # Qwen3-VL text states [1, L, text_dim] (MiniMaxH3.extra_conds refines them once per run);
    # EmptyMiniMaxH3LatentAV(64x64, length 5): video [B, 24, 2, H/16, W/16] and stereo audio [B, 32, 2, 8] as one
    # NestedTensor
    import comfy.nested_tensor

    # ComfyUI calls each branch alone (batch size 1), so the negative prompt keeps its own length: the two branches'
    # packed sequences differ in length, as with real prompts
    pos, neg = _cond(g, 8, 32), _cond(g, 5, 32)
    latent = comfy.nested_tensor.NestedTensor([torch.zeros(1, 24, 2, 4, 4), torch.zeros(1, 32, 2, 8)])
    return pos, neg, latent, None


@torch.no_grad()
def _minimax_h3_buffers(dm: torch.nn.Module) -> None:
    # rotary inverse frequencies 1 / 10000^(i / n), as the checkpoint's rope.inv_freq
    n = dm.rope.inv_freq.numel()
    dm.rope.inv_freq.copy_(1.0 / 10000.0 ** (torch.arange(n, dtype=torch.float32) / n))


def _hunyuan_video15_config(**over: Any) -> dict:
    config = {
        "image_model": "hunyuan_video", "in_channels": 65, "out_channels": 32, "patch_size": [1, 1, 1],
        "vec_in_dim": None, "context_in_dim": 32, "hidden_size": 64, "mlp_ratio": 4.0, "num_heads": 2,
        "depth": 2, "depth_single_blocks": 0, "axes_dim": [8, 12, 12], "theta": 256, "qkv_bias": True,
        "guidance_embed": False, "byt5": True, "meanflow": False, "use_cond_type_embedding": True,
        "vision_in_dim": 1152,
    }
    config.update(over)
    return config


_FLUX2 = ("comfy.model_base", "Flux2")
_HUNYUAN_VIDEO15 = ("comfy.model_base", "HunyuanVideo15")
# NextDiT's z_image_modulation (ComfyUI 0.3.75, with Z-Image); comfy.supported_models.ZImage only matches dim 3840
_Z_IMAGE = ("comfy.supported_models", "ZImage")


_SPECS: dict[str, _Spec] = {
    "wan21_t2v": _Spec("wan", "WAN21_T2V", "WAN21", _wan_config(), _wan_t2v_inputs, 5.0),
    "wan21_i2v": _Spec("wan", "WAN21_I2V", "WAN21", _wan_config(model_type="i2v", in_dim=36), _wan_i2v_inputs, 5.0),
    "wan21_vace": _Spec("wan", "WAN21_Vace", "WAN21_Vace",
                        _wan_config(model_type="vace", vace_layers=2, vace_in_dim=96), _wan_vace_inputs, 5.0),
    "wan22_ti2v": _Spec("wan", "WAN22_T2V", "WAN22", _wan_config(in_dim=48, out_dim=48), _wan22_ti2v_inputs, 5.0),
    "flux": _Spec("flux", "Flux", "Flux", _flux_config(True), _flux_inputs, 1.0),
    "flux_schnell": _Spec("flux", "FluxSchnell", "Flux", _flux_config(False), _flux_schnell_inputs, 1.0),
    "flux_kontext": _Spec("flux", "Flux", "Flux", _flux_config(True), _flux_kontext_inputs, 1.0),
    "chroma": _Spec("chroma", "Chroma", "Chroma", {
        "image_model": "chroma", "in_channels": 64, "out_channels": 64, "patch_size": 2, "context_in_dim": 32,
        "hidden_size": 64, "mlp_ratio": 4.0, "num_heads": 2, "depth": 1, "depth_single_blocks": 1,
        "axes_dim": [8, 12, 12], "theta": 10000, "qkv_bias": True, "in_dim": 64, "out_dim": 64,
        "hidden_dim": 32, "n_layers": 1,
    }, _chroma_inputs, 4.0),
    "hunyuan_video": _Spec("hunyuan_video", "HunyuanVideo", "HunyuanVideo", {
        "image_model": "hunyuan_video", "in_channels": 16, "out_channels": 16, "patch_size": [1, 2, 2],
        "vec_in_dim": 32, "context_in_dim": 32, "hidden_size": 64, "mlp_ratio": 4.0, "num_heads": 2,
        "depth": 1, "depth_single_blocks": 1, "axes_dim": [8, 12, 12], "theta": 256, "qkv_bias": True,
        "guidance_embed": True, "byt5": False, "meanflow": False,
    }, _hunyuan_video_inputs, 1.0),
    "ltxv": _Spec("ltxv", "LTXV", "LTXV", {
        "image_model": "ltxv", "in_channels": 128, "num_layers": 2, "attention_head_dim": 32,
        "num_attention_heads": 2, "cross_attention_dim": 64, "caption_channels": 32,
    }, _ltxv_inputs, 3.0),
    "qwen_image": _Spec("qwen_image", "QwenImage", "QwenImage", {
        "image_model": "qwen_image", "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 2,
        "attention_head_dim": 32, "num_attention_heads": 2, "joint_attention_dim": 32,
        "axes_dims_rope": (8, 12, 12),
    }, _qwen_image_inputs, 2.5),
    "lumina2": _Spec("lumina2", "Lumina2", "Lumina2", {
        "image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 64, "n_layers": 2,
        "n_refiner_layers": 1, "n_heads": 2, "n_kv_heads": 1, "multiple_of": 32, "qk_norm": True,
        "cap_feat_dim": 32, "axes_dims": [8, 12, 12], "axes_lens": [300, 512, 512],
    }, _lumina2_inputs, 4.0),
    "hidream": _Spec("hidream", "HiDream", "HiDream", {
        "image_model": "hidream", "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 1,
        "num_single_layers": 1, "attention_head_dim": 32, "num_attention_heads": 2,
        "caption_channels": [32, 48], "text_emb_dim": 32, "num_routed_experts": 4, "num_activated_experts": 2,
        "axes_dims_rope": [16, 8, 8], "max_resolution": [128, 128], "llama_layers": [0, 1],
    }, _hidream_inputs, 5.0),
    "flux2": _Spec("flux2", "Flux2", "Flux2", {
        "image_model": "flux2", "in_channels": 128, "out_channels": 128, "patch_size": 1, "vec_in_dim": None,
        "context_in_dim": 32, "hidden_size": 64, "mlp_ratio": 3.0, "num_heads": 2, "depth": 1,
        "depth_single_blocks": 1, "axes_dim": [8, 8, 8, 8], "theta": 2000, "qkv_bias": False, "guidance_embed": True,
        "global_modulation": True, "mlp_silu_act": True, "ops_bias": False, "default_ref_method": "index",
        "ref_index_scale": 10.0,
    }, _flux2_inputs, 1.0, requires=_FLUX2),
    # Z-Image's NextDiT at dim 256 (its modulation needs dim >= 256), built through the Lumina2 config class (the
    # one that builds model_base.Lumina2 for ZImage too): ZImage's matcher only accepts the released dim 3840.
    "z_image": _Spec("z_image", "Lumina2", "Lumina2", {
        "image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 256, "n_layers": 2,
        "n_refiner_layers": 1, "n_heads": 4, "n_kv_heads": 4, "multiple_of": 256, "ffn_dim_multiplier": 8.0 / 3.0,
        "qk_norm": True, "cap_feat_dim": 32, "axes_dims": [16, 24, 24], "axes_lens": [1536, 512, 512],
        "rope_theta": 256.0, "z_image_modulation": True, "time_scale": 1000.0, "pad_tokens_multiple": 32,
    }, _z_image_inputs, 4.0, requires=_Z_IMAGE),
    "hunyuan_video15": _Spec("hunyuan_video15", "HunyuanVideo15", "HunyuanVideo15", _hunyuan_video15_config(),
                             _hunyuan_video15_inputs, 6.0, requires=_HUNYUAN_VIDEO15),
    "hunyuan_video15_sr": _Spec("hunyuan_video15", "HunyuanVideo15_SR_Distilled", "HunyuanVideo15_SR_Distilled",
                                _hunyuan_video15_config(in_channels=98, meanflow=True), _hunyuan_video15_sr_inputs,
                                1.0, requires=_HUNYUAN_VIDEO15),
    "ltxav": _Spec("ltxav", "LTXAV", "LTXAV", {
        "image_model": "ltxav", "in_channels": 128, "audio_in_channels": 128, "num_layers": 2,
        "attention_head_dim": 32, "num_attention_heads": 2, "audio_attention_head_dim": 16,
        "audio_num_attention_heads": 2, "cross_attention_dim": 64, "audio_cross_attention_dim": 32,
        "caption_channels": 32, "connector_attention_head_dim": 16, "connector_num_attention_heads": 2,
        "connector_num_layers": 1,
    }, _ltxav_inputs, 3.0, requires=("comfy.model_base", "LTXAV")),
    # Kandinsky 5 video
    "kandinsky5": _Spec("kandinsky5", "Kandinsky5", "Kandinsky5", {
        "image_model": "kandinsky5", "in_visual_dim": 16, "out_visual_dim": 16, "in_text_dim": 32,
        "in_text_dim2": 32, "time_dim": 32, "model_dim": 64, "ff_dim": 128, "visual_embed_dim": 132,
        "patch_size": (1, 2, 2), "num_text_blocks": 1, "num_visual_blocks": 2, "axes_dims": (8, 12, 12),
    }, _kandinsky5_inputs, 5.0, requires=("comfy.model_base", "Kandinsky5")),
    # Kandinsky 5 image: Kandinsky5Image's matcher only accepts the released model_dim 2560 (80 heads of 32), so the
    # case has that width, with one text and two visual blocks and a narrow feed-forward (135M parameters)
    "kandinsky5_image": _Spec("kandinsky5", "Kandinsky5Image", "Kandinsky5Image", {
        "image_model": "kandinsky5", "in_visual_dim": 16, "out_visual_dim": 16, "in_text_dim": 32,
        "in_text_dim2": 32, "time_dim": 32, "model_dim": 2560, "ff_dim": 64, "visual_embed_dim": 64,
        "patch_size": (1, 2, 2), "num_text_blocks": 1, "num_visual_blocks": 2, "axes_dims": (8, 12, 12),
    }, _kandinsky5_image_inputs, 5.0, requires=("comfy.model_base", "Kandinsky5Image")),
    # MiniMax-H3 (ComfyUI 0.33): 6 x rope_inv_freq_len rotary dims fit the head dim
    "minimax_h3": _Spec("minimax_h3", "MiniMaxH3", "MiniMaxH3", {
        "image_model": "minimax_h3", "hidden_size": 64, "num_layers": 2, "token_refiner_num_layers": 1,
        "num_attention_heads": 2, "attention_head_dim": 32, "ffn_hidden_size": 128, "latents_dim": 24,
        "audio_latents_dim": 32, "text_dim": 32, "timestep_input_dim": 64, "time_embed_hidden_size": 64,
        "time_embed_dim": 32, "rope_inv_freq_len": 4,
    }, _minimax_h3_inputs, 4.0, requires=("comfy.model_base", "MiniMaxH3"), buffers=_minimax_h3_buffers,
       calls_per_step=2),
    # the vocabulary stays Qwen3-VL's (the model's special token ids are fixed); the vision tower only runs on
    # reference images
    "hidream_o1": _Spec("hidream_o1", "HiDreamO1", "HiDreamO1", {
        "image_model": "hidream_o1",
        "text_config_overrides": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                  "rope_dims": [4, 2, 2]},
        "vision_config_overrides": {"hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "depth": 1,
                                    "num_position_embeddings": 64},
    }, _hidream_o1_inputs, 4.0, requires=("comfy.model_base", "HiDreamO1")),
}

#: Every case name ``build_case`` accepts, in a stable order.
CASES: tuple[str, ...] = tuple(_SPECS)
#: case name -> the registered model family it is a model of
CASE_FAMILY: dict[str, str] = {name: spec.family for name, spec in _SPECS.items()}


# --------------------------------------------------------------------------------------------------
# Building


@torch.no_grad()
def _fill_parameters(module: torch.nn.Module, seed: int) -> None:
    """Deterministic weights with O(1) activations: matrices/convs ~ N(0, 1/fan_in), 1-D weights/scales
    (norm gains) ~ 1 + N(0, 0.1), everything else (biases) ~ N(0, 0.1). Depends only on ``seed`` and the
    parameter order, never on the global RNG."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in module.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if p.ndim >= 2:
            val = torch.randn(p.shape, generator=g) / math.sqrt(max(1, p[0].numel()))
        elif leaf in ("weight", "scale"):
            val = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        else:
            val = 0.1 * torch.randn(p.shape, generator=g)
        p.copy_(val.to(dtype=p.dtype, device=p.device))


def _build_patcher(spec: _Spec, seed: int) -> comfy.model_patcher.ModelPatcher:
    import comfy.model_detection
    import comfy.model_management
    import comfy.model_patcher

    model_config = comfy.model_detection.model_config_from_unet_config(unet_config_for_host(spec.unet_config))
    if model_config is None or type(model_config).__name__ != spec.config_name:
        got = None if model_config is None else type(model_config).__name__
        raise RuntimeError(f"unet_config matched supported_models.{got}, expected {spec.config_name}")

    cpu = torch.device("cpu")
    unet_dtype = torch.float32
    manual_cast_dtype = comfy.model_management.unet_manual_cast(unet_dtype, cpu,
                                                                model_config.supported_inference_dtypes)
    model_config.set_inference_dtype(unet_dtype, manual_cast_dtype)

    model = model_config.get_model({}, "")
    if type(model).__name__ != spec.base_model:
        raise RuntimeError(f"{spec.config_name} built model_base.{type(model).__name__}, expected {spec.base_model}")
    model = model.to(cpu)
    _fill_parameters(model.diffusion_model, seed)
    if spec.buffers is not None:
        spec.buffers(model.diffusion_model)
    for name, buf in model.diffusion_model.named_buffers():  # none today; an uninitialised one would be a bug
        if buf.is_floating_point() and not torch.isfinite(buf).all():
            raise RuntimeError(f"non-finite buffer {name} in tiny model")
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


def build_case(name: str, seed: int = 0, unet_overrides: Optional[dict] = None,
               latent_shape: Optional[tuple[int, ...]] = None) -> TinyCase:
    """Build the tiny model ``name`` (one of ``CASES``) and its inputs, all determined by ``seed``.

    ``unet_overrides`` changes the config (e.g. a wider, deeper Wan for benchmarks); ``latent_shape`` replaces the
    empty latent's shape. Two calls with the same arguments give bit-identical weights and inputs. Raises
    ``KeyError`` for an unknown name and ``RuntimeError`` if the host's model matcher picks a different config class
    or that class builds a different ``comfy.model_base`` class.
    """
    try:
        spec = _SPECS[name]
    except KeyError:
        raise KeyError(f"unknown tiny model {name!r}; choose from {CASES}") from None
    if spec.requires is not None:
        from omnitest.comfy_path import skip_without_comfy_class

        skip_without_comfy_class(*spec.requires)
    if unet_overrides:
        spec = dataclasses.replace(spec, unet_config={**spec.unet_config, **unet_overrides})
    patcher = _build_patcher(spec, seed)
    g = torch.Generator(device="cpu").manual_seed(10_000 + seed)
    positive, negative, latent, noise_mask = spec.inputs(g)
    if latent_shape is not None:
        latent = torch.zeros(latent_shape)
    return TinyCase(name=name, family=spec.family, patcher=patcher, positive=positive, negative=negative, latent=latent,
                    cfg=spec.cfg, noise_mask=noise_mask, config_name=spec.config_name,
                    unet_config=dict(spec.unet_config), calls_per_step=spec.calls_per_step)


def sample(case: TinyCase, model: Optional[comfy.model_patcher.ModelPatcher] = None, steps: Optional[int] = None,
           cfg: Optional[float] = None, sampler_name: str = "euler", scheduler: str = "simple",
           denoise: float = 1.0, seed: int = 0, callback=None) -> torch.Tensor:
    """Sample ``case`` with ComfyUI's own KSampler path, as the ``KSampler`` node does.

    ``model`` defaults to ``case.patcher`` (pass a clone carrying patches/wrappers), ``steps`` to
    ``case.steps``, ``cfg`` to ``case.cfg``. Noise is ``comfy.sample.prepare_noise(case.latent, seed)``;
    ``case.noise_mask`` is passed as the denoise mask. Runs under ``torch.inference_mode`` like the
    executor. Returns the sampled latent (CPU, same shape as ``case.latent``; an audio-video latent, a
    NestedTensor, as one tensor: its streams flattened per sample and concatenated); deterministic for equal
    arguments. Never mutates ``case``'s conditioning or latent. ``callback(step, x0, x, total_steps)``: called after
    each step, where the ``KSampler`` node's progress callback runs (and ComfyUI checks for an interrupt).

    Each call starts as a fresh process's first run: a diffusion model that keeps its text prefix's keys and values
    across runs (HiDream-O1's ``clear_kv_cache``) forgets them first. Else a later run computes its first step on
    fewer tokens (the cached prefix left out), where other matrix shapes may round otherwise (``MKL_CBWR=COMPATIBLE``
    and ``AVX2`` do; bit-equality holds only where the same kernels see the same shapes).
    """
    import comfy.sample

    model = case.patcher if model is None else model
    forget = getattr(model.model.diffusion_model, "clear_kv_cache", None)
    if forget is not None:
        forget()
    steps = case.steps if steps is None else steps
    cfg = case.cfg if cfg is None else cfg
    with torch.inference_mode():
        noise = comfy.sample.prepare_noise(case.latent, seed)
        out = comfy.sample.sample(model, noise, steps, cfg, sampler_name, scheduler, case.positive, case.negative,
                                  case.latent, denoise=denoise, noise_mask=case.noise_mask, disable_pbar=True,
                                  seed=seed, callback=callback)
    return packed_latent(out)


def packed_latent(latent) -> torch.Tensor:
    """A latent as one tensor: the streams of an audio-video latent (a NestedTensor, or the ``[video, audio]`` list
    LTX-2's diffusion model returns) flattened per sample and concatenated (what ``sample`` returns for it); any
    other latent unchanged."""
    streams = latent.unbind() if getattr(latent, "is_nested", False) else latent
    if isinstance(streams, (list, tuple)):
        return torch.cat([t.reshape(t.shape[0], -1) for t in streams], dim=1)
    return latent
