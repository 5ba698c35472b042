"""The V3 extension that registers this pack's nodes (and its HTTP routes) with ComfyUI."""
from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from . import stats_store
from .caches.magcache import ApplyMagCache, MagCacheCalibrate
from .offload.node import CPUOffload
from .sequence_parallel.node import SequenceParallel
from .caches.teacache import ApplyTeaCache, TeaCacheCalibrate


class OmniHooksExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [ApplyTeaCache, TeaCacheCalibrate, ApplyMagCache, MagCacheCalibrate, CPUOffload,
                SequenceParallel]


# Routes must exist before ComfyUI's server adds its routes, which happens after custom nodes are loaded.
stats_store.register_routes()
