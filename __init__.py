"""ComfyUI-OmniHooks: ComfyUI loads this file from custom_nodes/. Everything lives in nodes/ and omni_hooks/."""
from .nodes.extension import comfy_entrypoint

WEB_DIRECTORY = "./web"

__all__ = ["comfy_entrypoint", "WEB_DIRECTORY"]
