"""ComfyUI-OmniHooks: ComfyUI loads this file from custom_nodes/. Everything lives in nodes/ and omni_hooks/."""

WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    # Imported here, not at module level, so that this file also imports where ComfyUI does not (pytest, pip).
    from .nodes.extension import OmniHooksExtension

    return OmniHooksExtension()


__all__ = ["comfy_entrypoint", "WEB_DIRECTORY"]
