"""CFG parallel's tensor work: one part of a call's batch for this rank's cfg half, and the parts gathered back.

A host batches cond and uncond (and further conds) into one model call along dim 0. Every tensor argument of the
plan's root whose leading dim is the call's batch is batched data (ComfyUI concatenates each conditioning input along
the batch), so a part of the batch is the same slice of each of them; tensors are found inside lists, tuples and dicts
too (ComfyUI's ControlNet ``control``). Parameters named in ``SequenceParallelConfig.batch_unsplit_inputs`` are left
whole (the host's options dict, whose tensors are not all batched).
"""
from __future__ import annotations

from typing import Any

import torch


def call_batch(args: tuple, kwargs: dict) -> int | None:
    """The batch of a call: the leading dim of its first tensor argument (positional first); None without one."""
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    return None


def batch_part(value: Any, batch: int, parts: int, index: int) -> Any:
    """``value`` with every tensor whose leading dim is ``batch`` narrowed to part ``index`` of ``parts`` (inside
    lists, tuples and dicts too); anything else unchanged. ``batch`` must be divisible by ``parts``."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] != batch:
            return value
        size = batch // parts
        return value.narrow(0, index * size, size)
    if isinstance(value, (list, tuple)):
        parted = [batch_part(v, batch, parts, index) for v in value]
        return type(value)(parted) if not hasattr(value, "_fields") else type(value)(*parted)
    if isinstance(value, dict):
        return type(value)((k, batch_part(v, batch, parts, index)) for k, v in value.items())
    return value


def split_call(args: tuple, kwargs: dict, names: list[str], unsplit: tuple[str, ...], batch: int, parts: int,
               index: int) -> tuple[tuple, dict]:
    """Part ``index`` of ``parts`` of a call's batch; ``names``: the forward's positional parameter names (to leave
    the ``unsplit`` ones whole when passed by position)."""
    new_args = tuple(a if i < len(names) and names[i] in unsplit else batch_part(a, batch, parts, index)
                     for i, a in enumerate(args))
    new_kwargs = {k: v if k in unsplit else batch_part(v, batch, parts, index) for k, v in kwargs.items()}
    return new_args, new_kwargs


def gather_output(output: Any, part_batch: int, gather) -> Any:
    """``output`` with every tensor whose leading dim is ``part_batch`` replaced by ``gather(tensor)`` (inside lists
    and tuples too). Other outputs are returned as they are: a rank's non-batched output is its own."""
    if isinstance(output, torch.Tensor):
        return gather(output) if output.dim() > 0 and output.shape[0] == part_batch else output
    if isinstance(output, (list, tuple)):
        gathered = [gather_output(o, part_batch, gather) for o in output]
        return type(output)(gathered) if not hasattr(output, "_fields") else type(output)(*gathered)
    return output
