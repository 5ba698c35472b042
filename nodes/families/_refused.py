"""The models ComfyUI loads that no registered family handles, and why, keyed by their ``comfy.supported_models``
class name (``type(base_model.model_config).__name__``). Detection names the reason in its error, so every node
refuses such a MODEL saying why; docs/model-support.md lists the same reasons (a test checks both against ComfyUI's
``comfy.supported_models.models``).
"""
from __future__ import annotations

_UNET = ("a convolutional UNet, not a diffusion transformer: the caches, the offload and the sequence split of this "
         "pack work on transformer block stacks")
_NO_ADAPTER = ("a diffusion transformer without a family in this pack yet (its block stack, cache signal and sequence "
               "plan are not described; see docs/adding-a-model-family.md)")
_NOT_IMAGE = "not an image or video model: the pack's families are image and video transformers"

REFUSED: dict[str, str] = {
    **{name: _UNET for name in (
        "LotusD", "Stable_Zero123", "SD15_instructpix2pix", "SD15", "SD20", "SD21UnclipL", "SD21UnclipH",
        "SDXL_instructpix2pix", "SDXLRefiner", "SDXL", "SSD1B", "KOALA_700M", "KOALA_1B", "Segmind_Vega",
        "SD_X4Upscaler", "Stable_Cascade_C", "Stable_Cascade_B", "SV3D_u", "SV3D_p", "SVD_img2vid")},
    **{name: _NO_ADAPTER for name in (
        "SD3", "AuraFlow", "PixArtAlpha", "PixArtSigma", "HunyuanDiT", "HunyuanDiT1", "GenmoMochi", "CosmosT2V",
        "CosmosI2V", "CosmosT2IPredict2", "CosmosI2VPredict2", "Omnigen2")},
    **{name: _NOT_IMAGE + f" ({what})" for name, what in (
        ("StableAudio", "audio"), ("ACEStep", "audio"), ("Hunyuan3Dv2mini", "3D shapes"), ("Hunyuan3Dv2", "3D shapes"),
        ("Hunyuan3Dv2_1", "3D shapes"))},
    **{name: _NO_ADAPTER for name in (
        "Anima", "Krea2", "Ideogram4",
        "JoyImage", "ErnieImage", "CogVideoX_T2V", "CogVideoX_I2V", "CogVideoX_Inpaint", "MageFlow", "PixelDiTT2I",
        "PiD", "Boogu", "Lens")},
    **{name: _NOT_IMAGE + f" ({what})" for name, what in (
        ("StableAudio3", "audio"), ("ACEStep15", "audio"), ("MiniMaxMusic3", "music"), ("TripoSplat", "3D shapes"),
        ("Trellis2", "3D shapes"), ("RT_DETR_v4", "object detection"), ("SAM3", "segmentation"),
        ("SAM31", "segmentation"), ("DepthAnything3", "depth estimation"))},
    "SeedVR2": ("SeedVR2 is a video restoration model (NaDiT: windowed attention over variable-length patches), not a "
                "text-to-image or video generator with a block stack the pack describes"),
    "ZImagePixelSpace": ("Z-Image pixel space ends in a per-patch decoder network (dec_net) instead of NextDiT's final "
                         "layer, which the Z-Image family's stack does not describe"),
    "WAN_Animate2": ("Wan Animate 2 calls its blocks through forward_pose / forward_gen with pose keys and values, "
                     "not through the block call the Wan family hooks"),
    "WAN21_CausalAR_T2V": ("Causal autoregressive Wan writes a key/value cache in every block while it generates "
                           "chunk after chunk: skipping or streaming its blocks would leave that cache incomplete"),
    "WAN22_WanDancer": ("WanDancer injects music between the blocks and ends in one of two heads (head or "
                        "head_global, by frame rate), which the Wan family's stack does not describe"),
    "WAN22_S2V": ("Wan 2.2 S2V's blocks (WanModel_S2V) take audio and motion inputs per block that the Wan family "
                  "does not describe"),
    "ChromaRadiance": ("Chroma Radiance works in pixel space and ends in per-patch NeRF blocks instead of Flux's "
                       "final layer, which the Chroma family's stack does not describe"),
}


def refusal(base_model) -> str | None:
    """Why the pack refuses ``base_model`` (a ``comfy.model_base.BaseModel``), or None when it is not listed."""
    config = getattr(base_model, "model_config", None)
    return REFUSED.get(type(config).__name__) if config is not None else None
