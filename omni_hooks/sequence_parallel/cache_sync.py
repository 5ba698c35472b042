"""Rank-synchronized cache decisions: the ``RankAgreement`` (omni_hooks.context) of a sequence-parallel group.

TeaCache measures its input change on each rank's shard of the tokens, so ranks measure different values; a cache
that decided on its own shard would skip on one rank and compute on another, and the computing rank would wait
forever in the next all-to-all (vllm-omni #6180, fixed by averaging the statistic over the group in vllm-omni
#6228; Helios reduces the decision with MAX, vllm-omni #7905). The stack-cache mechanics call ``mean`` on the
measured metrics (once per call, measured or not) and ``any`` on the compute verdict (once per call), so every rank
decides the same and every rank makes the same collectives. A step- or ratio-only decision (MagCache) is identical
everywhere anyway; ``any`` still guards it.
"""
from __future__ import annotations

import torch

from .comm import Communicator

KIND = "cache_agreement"


class GroupAgreement:
    """``RankAgreement`` over one group (all-reduces on the group's backend device). ``any_comm``: a larger group
    that ``any`` decides over (CFG parallel: the metric is averaged over the ranks computing the same batch part, but
    every rank of the world must take the same path); None: ``comm``."""

    def __init__(self, comm: Communicator, device: torch.device, any_comm: Communicator | None = None):
        self.comm = comm
        self.device = device
        self.any_comm = any_comm or comm

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        total = self.comm.all_reduce(values.detach().to(self.device, torch.float64), "sum", KIND)
        return (total / self.comm.size).cpu()

    def any(self, flag: bool) -> bool:
        flags = self.any_comm.all_reduce(torch.tensor([1.0 if flag else 0.0], device=self.device), "max", KIND)
        return bool(flags.item() > 0)
