"""Tensor-level splitting: equal shards in rank order, zero padding for lengths the world size does not divide."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PaddingRecord:
    """One split sequence's length before and after padding (equal when the world size divides it)."""

    original_len: int
    padded_len: int

    @property
    def pad(self) -> int:
        return self.padded_len - self.original_len


def length_error(where: str, length: int, dim: int, world_size: int) -> ValueError:
    """The strict-mode error for a length the world size does not divide, naming the fixes."""
    return ValueError(
        f"{where}: sequence length {length} along dim {dim} is not divisible by sequence_parallel_size {world_size} "
        f"(strict mode); fix: set auto_pad=True on this input in the sequence-parallel plan (padded tokens are left "
        f"out of attention and cut from the gathered output), or use a size whose token count is a multiple of "
        f"{world_size}")


def shard(x: torch.Tensor, dim: int, world_size: int, index: int, where: str = "split") -> torch.Tensor:
    """Shard ``index`` of ``world_size`` equal shards of ``x`` along ``dim`` (a view). Strict: the length must be
    divisible (ValueError naming the fix otherwise)."""
    length = x.shape[dim]
    if length % world_size:
        raise length_error(where, length, dim, world_size)
    size = length // world_size
    return x.narrow(dim, index * size, size)


def padded_length(length: int, world_size: int) -> int:
    return -(-length // world_size) * world_size


def pad_to(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """``x`` with zeros appended along ``dim`` up to ``length`` (``x`` itself when already that long)."""
    missing = length - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_zeros(shape)], dim)
