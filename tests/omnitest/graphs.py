"""Build API-format prompts (what ``POST /prompt`` accepts) without importing ComfyUI.

``Graph`` is a minimal GraphBuilder: ``g.node("KSampler", model=loader, seed=1, ...)``; a ``Node`` passed as an input
value is linked to its output 0, ``node.out(i)`` links another output. ``tiny_wan_graph()`` builds the standard
text-encoder-free tiny Wan workflow (UNETLoader -> [model patches...] -> KSampler -> SaveLatent), optionally with a
second KSampler on the unpatched model in the same prompt.
"""
from __future__ import annotations

import copy
import itertools
import json
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence, Union

from omnitest.server import TINY_WAN_NAME

ZERO_CONDITIONING = "OmniTest.ZeroConditioning"
WAIT = "OmniTest.Wait"


class Node:
    def __init__(self, graph: "Graph", node_id: str, class_type: str, inputs: dict[str, Any], title: str | None):
        self.graph, self.id, self.class_type, self.inputs, self.title = graph, node_id, class_type, inputs, title

    def out(self, index: int = 0) -> list:
        return [self.id, index]

    def set_input(self, name: str, value: Any) -> "Node":
        self.inputs[name] = value
        return self

    def __repr__(self) -> str:
        return f"Node({self.id!r}, {self.class_type!r})"


class Graph:
    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self._ids = itertools.count(1)

    def node(self, class_type: str, *, node_id: str | int | None = None, title: str | None = None,
             **inputs: Any) -> Node:
        if node_id is None:
            node_id = next(self._ids)
            while str(node_id) in self.nodes:
                node_id = next(self._ids)
        node_id = str(node_id)
        if node_id in self.nodes:
            raise ValueError(f"duplicate node id {node_id}")
        n = Node(self, node_id, class_type, dict(inputs), title)
        self.nodes[node_id] = n
        return n

    def remove(self, node: Node | str) -> None:
        del self.nodes[node.id if isinstance(node, Node) else str(node)]

    def prompt(self) -> dict[str, dict]:
        """The API-format dict (a fresh deep copy each call)."""
        api: dict[str, dict] = {}
        for nid, n in self.nodes.items():
            inputs = {k: (v.out(0) if isinstance(v, Node) else copy.deepcopy(v)) for k, v in n.inputs.items()}
            entry: dict[str, Any] = {"class_type": n.class_type, "inputs": inputs}
            if n.title:
                entry["_meta"] = {"title": n.title}
            api[nid] = entry
        return api


# A model patch to insert between UNETLoader and KSampler: ("ClassType", {inputs}) or
# {"class_type": ..., "inputs": {...}, "model_input": "model", "model_output": 0}.
PatchSpec = Union[Sequence[Any], Mapping[str, Any]]


@dataclass
class TinyWanGraph:
    graph: Graph
    loader: Node
    cond: Node
    latent: Node
    patches: list[Node]
    sampler: Node
    save: Node
    sampler_original: Node | None = None
    save_original: Node | None = None
    wait: Node | None = None

    def prompt(self) -> dict[str, dict]:
        return self.graph.prompt()

    def set_prefix(self, prefix: str) -> "TinyWanGraph":
        self.save.set_input("filename_prefix", prefix)
        if self.save_original is not None:
            self.save_original.set_input("filename_prefix", prefix + "_original")
        return self

    def set_nonce(self, nonce: int) -> "TinyWanGraph":
        """A new nonce on the conditioning node makes ComfyUI execute the sampler(s) again instead of serving them
        from its node cache (the loader and patch nodes stay cached)."""
        self.cond.set_input("nonce", int(nonce))
        return self


def unique_prefix(name: str = "tiny") -> str:
    """A SaveLatent prefix under output/latents/ that no other run uses."""
    return f"latents/{name}_{uuid.uuid4().hex[:8]}"


def fresh_nonce() -> int:
    return uuid.uuid4().int & 0xFFFFFFFFFFFF


def _patch(spec: PatchSpec) -> tuple[str, dict[str, Any], str, int]:
    if isinstance(spec, Mapping):
        return (spec["class_type"], dict(spec.get("inputs", {})), spec.get("model_input", "model"),
                int(spec.get("model_output", 0)))
    class_type, inputs = spec[0], (spec[1] if len(spec) > 1 else {})
    return class_type, dict(inputs), "model", 0


def tiny_wan_graph(patches: Iterable[PatchSpec] = (), *, seed: int = 1, steps: int = 4, cfg: float = 2.0,
                   sampler_name: str = "euler", scheduler: str = "simple", denoise: float = 1.0,
                   width: int = 64, height: int = 64, length: int = 1, batch_size: int = 1,
                   tokens: int = 8, text_dim: int = 4096, pooled_dim: int = 0,
                   prefix: str | None = None, nonce: int | None = None, compare_original: bool = False,
                   wait_seconds: float | None = None,
                   unet_name: str = TINY_WAN_NAME, weight_dtype: str = "default") -> TinyWanGraph:
    """The standard tiny Wan 2.1 workflow.

    Node ids: "1" UNETLoader, "2" ZeroConditioning (positive = negative), "3" EmptyHunyuanLatentVideo
    ([batch, 16, (length-1)//4+1, height/8, width/8]), "4" KSampler, "5" SaveLatent; patches get "10", "11", ... in
    order, each fed the previous MODEL through ``model_input``; ``compare_original`` adds "6" KSampler on the
    unpatched loader output with the same settings and "7" SaveLatent (prefix + "_original");
    ``wait_seconds`` puts "8" OmniTest.Wait between KSampler "4" and SaveLatent "5" (for interrupt tests).
    ``prefix`` defaults to a unique ``latents/tiny_<hex>``; ``nonce`` (see ``TinyWanGraph.set_nonce``) defaults to
    none, i.e. ComfyUI's normal node caching across prompts.
    """
    g = Graph()
    loader = g.node("UNETLoader", node_id=1, unet_name=unet_name, weight_dtype=weight_dtype)
    cond_inputs: dict[str, Any] = {"tokens": tokens, "dim": text_dim, "pooled_dim": pooled_dim}
    if nonce is not None:
        cond_inputs["nonce"] = int(nonce)
    cond = g.node(ZERO_CONDITIONING, node_id=2, **cond_inputs)
    latent = g.node("EmptyHunyuanLatentVideo", node_id=3, width=width, height=height, length=length,
                    batch_size=batch_size)
    model_ref: list = loader.out(0)
    patch_nodes = []
    for i, spec in enumerate(patches):
        class_type, inputs, model_input, model_output = _patch(spec)
        inputs[model_input] = model_ref
        node = g.node(class_type, node_id=10 + i, **inputs)
        patch_nodes.append(node)
        model_ref = node.out(model_output)
    sampler_settings = dict(seed=seed, steps=steps, cfg=cfg, sampler_name=sampler_name, scheduler=scheduler,
                            positive=cond.out(0), negative=cond.out(0), latent_image=latent.out(0), denoise=denoise)
    sampler = g.node("KSampler", node_id=4, model=model_ref, **sampler_settings)
    prefix = prefix or unique_prefix()
    samples = sampler.out(0)
    wait = None
    if wait_seconds is not None:
        wait = g.node(WAIT, node_id=8, latent=samples, seconds=float(wait_seconds))
        samples = wait.out(0)
    save = g.node("SaveLatent", node_id=5, samples=samples, filename_prefix=prefix)
    result = TinyWanGraph(g, loader, cond, latent, patch_nodes, sampler, save, wait=wait)
    if compare_original:
        result.sampler_original = g.node("KSampler", node_id=6, model=loader.out(0), **sampler_settings)
        result.save_original = g.node("SaveLatent", node_id=7, samples=result.sampler_original.out(0),
                                      filename_prefix=prefix + "_original")
    return result


def delay_output(prompt: Mapping[str, Any], sampler_id: str, save_id: str, new_ids: Sequence[str] = ("8", "9")
                 ) -> dict[str, dict]:
    """A copy of ``prompt`` with two zero-second OmniTest.Wait nodes between a sampler and its SaveLatent (the latent
    is unchanged).

    ComfyUI picks the next node among the ready ones by its distance to an output node (1 or 2 hops first); three
    hops push this sampler behind the other chain, whether or not ComfyUI still caches that chain's patch node. Used
    with ``compare_original`` to run the patched and the original sampler in both orders."""
    prompt = json.loads(json.dumps(prompt))
    source = [sampler_id, 0]
    for nid in new_ids:
        prompt[nid] = {"class_type": WAIT, "inputs": {"latent": source, "seconds": 0.0}}
        source = [nid, 0]
    prompt[save_id]["inputs"]["samples"] = source
    return prompt
