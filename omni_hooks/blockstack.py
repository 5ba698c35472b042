"""How a diffusion transformer's block stack is called, described once and shared by the caches.

A cache that skips the stack needs to know: the blocks in execution order, the module that receives the stack's
image-stream output (the "tail": a final layer or output norm), where the image stream sits in the head block's and
the tail's arguments, and what a block returns when it is skipped (its image/text inputs passed through unchanged).
The model's own forward does everything else, embeddings, loops, slicing, unpatchify, so nothing of it is copied.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

ArgsKwargs = tuple[tuple, dict]


@dataclass(frozen=True)
class TensorArg:
    """A tensor argument found by keyword ``name`` or else at position ``index``."""

    name: str
    index: int

    def get(self, args: tuple, kwargs: dict) -> torch.Tensor:
        if self.name in kwargs:
            return kwargs[self.name]
        return args[self.index]

    def replace(self, args: tuple, kwargs: dict, value: torch.Tensor) -> ArgsKwargs:
        if self.name in kwargs:
            return args, {**kwargs, self.name: value}
        args = list(args)
        args[self.index] = value
        return tuple(args), kwargs


def pack_streams(streams: Sequence[torch.Tensor]) -> torch.Tensor:
    """Batch-first streams as one tensor [B, N]: each flattened per sample, concatenated in order."""
    return torch.cat([s.reshape(s.shape[0], -1) for s in streams], dim=1)


@dataclass(frozen=True)
class PackedStreams:
    """Several hidden streams a block receives in ONE argument (a tuple or list of batch-first tensors, by keyword
    ``name`` or else at position ``index``; LTX-2's ``(video, audio)``), read as one tensor by ``pack_streams``, so
    a cache measures and stores one residual over all of them. Only a head's hidden is read this way; the stack's
    output leaves through one tail module per stream (``BlockStack.tail`` and ``BlockStack.stream_tails``)."""

    name: str
    index: int

    def get(self, args: tuple, kwargs: dict) -> torch.Tensor:
        return pack_streams(TensorArg(self.name, self.index).get(args, kwargs))


@dataclass(frozen=True)
class ReturnedHidden:
    """A stack's ``tail_hidden`` read from what its ``tail`` returns (one tensor) rather than from its arguments: the
    stack's last block is then its own tail. For a model whose forward reshapes the stack's output before it calls
    the next module (Kandinsky 5 folds its tokens back into the latent grid), so that no module receives the tokens
    as the blocks made them. A cache stores the residual from that output and, on a skip, replaces it."""


SkipFn = Callable[[torch.nn.Module, tuple, dict], Any]
#: ``compute(head_block, args, kwargs, captured)``: a ``StackSignal``'s tensor
StackSignalFn = Callable[[torch.nn.Module, tuple, dict, "torch.Tensor | None"], torch.Tensor]


@dataclass
class StackSignal:
    """A tensor a model's own code computes from its block stack's head call, which a cache may measure from step to
    step (TeaCache measures one: the head block's timestep-modulated input). A model family offers its signals by
    name; the cache asks for the one it needs.

    ``compute(head_block, args, kwargs, captured)`` returns a batch-first tensor (first dimension = the head's image
    stream batch). If ``capture`` is set, the first positional input of that module, which the model calls before the
    head block, is passed as ``captured`` (e.g. Wan's time embedding entering ``time_projection``).
    """

    compute: StackSignalFn
    capture: torch.nn.Module | None = None


@dataclass
class BlockStack:
    """The block stack of one diffusion transformer instance.

    ``blocks[0]`` is the head block (caches decide there). ``skip_block(block, args, kwargs)`` returns what ``block``
    would return if it were the identity on its streams. The tail's image-stream input must have the same shape as
    the head's image-stream input for a residual to be reusable; caches check that and fall back to computing. With
    ``tail_hidden`` a ``ReturnedHidden``, ``tail`` is the last block and its output is read instead.
    """

    blocks: Sequence[torch.nn.Module]
    tail: torch.nn.Module
    head_hidden: TensorArg | PackedStreams
    tail_hidden: TensorArg | ReturnedHidden
    skip_block: SkipFn
    # Blocks that modify their input in place need the head input cloned before they run.
    clone_head_input: bool = True
    # With a PackedStreams head: for the second, third, ... stream, the module after the stack that receives it and
    # where (``tail`` receives the first), in the order the model calls them.
    stream_tails: Sequence[tuple[torch.nn.Module, TensorArg]] = ()
    # ``must_compute(args, kwargs)`` on the head block's call: why this call must run its blocks whatever the cache
    # decides (a reason for the statistics), or None. For blocks whose outputs feed more than the hidden stream on
    # some calls (HiDream-O1's layers fill the model's own key/value cache on its first call for a prompt).
    must_compute: Callable[[tuple, dict], str | None] | None = None

    def __post_init__(self) -> None:
        if not self.blocks:
            raise ValueError("A BlockStack needs at least one block")
        if self.stream_tails and not isinstance(self.head_hidden, PackedStreams):
            raise ValueError("A BlockStack with stream_tails reads its head hidden as PackedStreams")
        if isinstance(self.tail_hidden, ReturnedHidden) and (self.stream_tails or self.tail is not self.blocks[-1]):
            raise ValueError("A BlockStack whose tail_hidden is ReturnedHidden has its last block as tail and no "
                             "stream_tails")

    def tails(self) -> list[tuple[torch.nn.Module, TensorArg]]:
        """Every module that receives a stream of the stack's output, with where, in call order."""
        return [(self.tail, self.tail_hidden), *self.stream_tails]


def skip_returning(*names_or_indices: TensorArg) -> SkipFn:
    """A ``skip_block`` that returns the given arguments unchanged: one tensor, or a tuple of them in that order."""

    if len(names_or_indices) == 1:
        only = names_or_indices[0]
        return lambda block, args, kwargs: only.get(args, kwargs)
    return lambda block, args, kwargs: tuple(a.get(args, kwargs) for a in names_or_indices)
