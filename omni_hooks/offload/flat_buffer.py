"""A block's offloaded tensors packed into one flat byte buffer, and the three ways its tensors can be bound.

Every offloaded tensor of a block gets a byte range in one flat ``uint8`` buffer (aligned to ``ALIGN_BYTES``), so a
block moves with one copy, from its CPU master copy into a device slot of the same layout. A tensor of the block is
always in exactly one of three states, and keeps its object identity (only ``.data`` changes):
  * bound: a view into the slot that holds the block (``bind``);
  * released: a 0-element placeholder of its dtype on the device (``release``): a forward of a block in this state
    fails loudly instead of computing with wrong weights, and residency is measurable on any device;
  * restored: a fresh tensor with its original device, dtype, shape, strides and inference-ness, filled from the
    master copy (``restore``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import KeepResidentFn
from .platform import is_page_locked

# Offsets of tensors inside a flat buffer: enough for every dtype's alignment and for vectorised device loads.
ALIGN_BYTES = 64


@dataclass(frozen=True)
class PackedTensor:
    """One offloaded tensor: where it lives in its module, what it looked like, and its byte range in the flat."""

    name: str                 # inside the block, e.g. "attn.q.weight"
    tensor: torch.Tensor      # the Parameter or buffer object itself; only its .data is ever replaced
    is_buffer: bool
    dtype: torch.dtype
    shape: torch.Size
    stride: tuple[int, ...]
    device: torch.device
    offset: int
    nbytes: int
    # the original strides when they cover the bytes densely (e.g. a transposed weight), so kernels see the same
    # layout as without offload; else the contiguous strides
    view_stride: tuple[int, ...]
    # an inference tensor (e.g. a parameter a host created under torch.inference_mode): such a tensor only works with
    # inference data, so it is bound, released and restored with inference tensors
    inference: bool = False

    def signature(self) -> tuple:
        """Everything of this entry but the tensor's values: two layouts with equal signatures pack the same tensor
        objects into the same byte ranges."""
        return (id(self.tensor), self.name, self.is_buffer, self.dtype, self.shape, self.stride, self.device,
                self.offset, self.nbytes, self.view_stride, self.inference)

    def view_in(self, flat: torch.Tensor) -> torch.Tensor:
        elements = flat.narrow(0, self.offset, self.nbytes).view(self.dtype)
        return elements.as_strided(self.shape, self.view_stride, elements.storage_offset())


@dataclass(frozen=True)
class BlockLayout:
    """The offloaded tensors of one block and the size of its flat buffer; ``kept_bytes`` were left in place."""

    tensors: tuple[PackedTensor, ...]
    nbytes: int
    kept_bytes: int

    @classmethod
    def of(cls, block: torch.nn.Module, keep_resident: KeepResidentFn | None, offload_buffers: bool,
           where: str) -> "BlockLayout":
        """Lay out ``block``'s parameters (and buffers), each tensor object once. ``where`` names the block in errors.

        Raises ValueError for a tensor that cannot be packed as plain bytes (a tensor subclass such as a quantized
        or GGUF weight, a sparse, quantized or meta tensor); ``keep_resident`` can leave such tensors in place.
        """
        seen: set[int] = set()
        packed: list[PackedTensor] = []
        offset = kept = 0
        for module_name, module in block.named_modules():
            entries = [(n, t, False) for n, t in module._parameters.items()]
            if offload_buffers:
                entries += [(n, t, True) for n, t in module._buffers.items()]
            for attr, tensor, is_buffer in entries:
                if tensor is None or id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                name = f"{module_name}.{attr}" if module_name else attr
                if keep_resident is not None and keep_resident(name, tensor):
                    kept += tensor.numel() * tensor.element_size()
                    continue
                _check_packable(tensor, name, where)
                offset = -(-offset // ALIGN_BYTES) * ALIGN_BYTES
                nbytes = tensor.numel() * tensor.element_size()
                stride = tuple(tensor.stride())
                packed.append(PackedTensor(name=name, tensor=tensor, is_buffer=is_buffer, dtype=tensor.dtype,
                                           shape=tensor.shape, stride=stride, device=tensor.device,
                                           offset=offset, nbytes=nbytes,
                                           view_stride=stride if _is_dense(tensor.shape, stride)
                                           else _contiguous_strides(tensor.shape),
                                           inference=tensor.is_inference()))
                offset += nbytes
        return cls(tensors=tuple(packed), nbytes=offset, kept_bytes=kept)

    def pack_into(self, flat: torch.Tensor) -> None:
        """Copy every tensor's current values into ``flat`` (the master copy)."""
        with torch.no_grad():
            for t in self.tensors:
                t.view_in(flat).copy_(t.tensor.data)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's view into ``flat`` (a slot holding this block), in layout order; inference tensors get views
        of an inference alias of ``flat`` (the same memory)."""
        alias = None
        views = []
        for t in self.tensors:
            if t.inference:
                if alias is None:
                    alias = _inference_alias(flat)
                with torch.inference_mode():
                    views.append(t.view_in(alias))
            else:
                with torch.inference_mode(False):
                    views.append(t.view_in(flat))
        return views

    def bind(self, views: list[torch.Tensor]) -> None:
        for t, view in zip(self.tensors, views):
            t.tensor.data = view

    def release(self, placeholders: "Placeholders") -> None:
        for t in self.tensors:
            t.tensor.data = placeholders.of(t.dtype, t.inference)

    def page_locked_data(self) -> list[torch.Tensor | None]:
        """Per tensor, its current data when that is host memory another owner page-locked (else None): the caller
        keeps it alive while the tensor is released and gives it back with ``restore``, so that memory is never
        freed while it is registered."""
        return [t.tensor.data if is_page_locked(t.tensor.data) else None for t in self.tensors]

    def restore(self, master: torch.Tensor, kept: list[torch.Tensor | None] | None = None) -> None:
        """Give every tensor back its original device, dtype, shape, strides and inference-ness, with the master
        copy's values; a tensor with ``kept`` data (``page_locked_data``) gets that very data back instead."""
        with torch.no_grad():
            for i, t in enumerate(self.tensors):
                if kept is not None and kept[i] is not None:
                    t.tensor.data = kept[i]
                    continue
                with torch.inference_mode(t.inference):
                    original = torch.empty_strided(t.shape, t.stride, dtype=t.dtype, device=t.device)
                    original.copy_(t.view_in(master))
                t.tensor.data = original


class Placeholders:
    """0-element tensors on the device, one per dtype (and inference-ness), shared by every released tensor of it."""

    def __init__(self, device: torch.device):
        self.device = device
        self._by_kind: dict[tuple[torch.dtype, bool], torch.Tensor] = {}

    def of(self, dtype: torch.dtype, inference: bool = False) -> torch.Tensor:
        placeholder = self._by_kind.get((dtype, inference))
        if placeholder is None:
            with torch.inference_mode(inference):
                placeholder = torch.empty(0, dtype=dtype, device=self.device)
            self._by_kind[(dtype, inference)] = placeholder
        return placeholder


def _inference_alias(flat: torch.Tensor) -> torch.Tensor:
    """An inference tensor over the same memory as ``flat`` (its views are inference tensors; ``flat``'s are not)."""
    with torch.inference_mode():
        return torch.empty(0, dtype=flat.dtype, device=flat.device).set_(
            flat.untyped_storage(), flat.storage_offset(), flat.shape, flat.stride())


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _is_dense(shape: torch.Size, stride: tuple[int, ...]) -> bool:
    """True when ``stride`` lays ``shape`` out without gaps or overlaps (a permutation of a contiguous layout)."""
    dims = sorted((s, n) for s, n in zip(stride, shape) if n != 1)
    step = 1
    for s, n in dims:
        if s != step:
            return False
        step *= n
    return True


def unpackable_reason(tensor: torch.Tensor) -> str | None:
    """Why ``tensor`` cannot be offloaded as plain bytes (e.g. "is a GGMLTensor, a tensor subclass"), else None.
    A host can leave such tensors in place with ``keep_resident``."""
    data = tensor.data
    if type(data) is not torch.Tensor:
        return f"is a {type(data).__name__}, a tensor subclass"
    if data.layout != torch.strided:
        return f"has layout {data.layout}"
    if data.is_quantized:
        return "is a quantized tensor"
    if data.device.type == "meta":
        return "is on the meta device (not loaded)"
    return None


def _check_packable(tensor: torch.Tensor, name: str, where: str) -> None:
    problem = unpackable_reason(tensor)
    if problem:
        raise ValueError(f"block offload: {where} tensor {name!r} {problem}, which cannot be offloaded as "
                         "plain bytes; leave it in place with keep_resident")


def plan_pinning(pinned_sizes: list[int], budget: int) -> list[bool]:
    """Which blocks to pin: in list order, each block whose pinned size still fits in what is left of ``budget``."""
    plan = []
    left = budget
    for size in pinned_sizes:
        fits = size <= left
        plan.append(fits)
        if fits:
            left -= size
    return plan
