"""What a block-stack cache keeps per branch (``CachedResidualState``), per call in progress (``ActiveCall``) and per
branch's verdict (``Decision``): the data the run (``run.py``), its hooks (``hooks.py``) and each cache's policy share.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..base import BaseState
from ..context import CallContext
from .forecast import ErrorPerMetric, CandidateScores, ResidualHistory
from .skip_correction import SkipCorrection
from .stats import EvaluationRecord


@dataclass
class CachedResidualState(BaseState):
    """Per-branch fields the shared mechanics use; each cache's state class extends this."""

    previous_residual: torch.Tensor | None = None
    # shape of the head input the residual was measured on: a skip is only valid for the same shape
    residual_input_shape: torch.Size | None = None
    # with forecasting: the last computed residuals (the newest is ``previous_residual``)
    history: ResidualHistory = field(default_factory=ResidualHistory)
    # with the "auto" forecast: how well each candidate has predicted this branch's computed residuals
    scores: CandidateScores = field(default_factory=CandidateScores)
    # ... and, for a cache that weighs its metric by the forecast: the forecast's error per unit of metric, and the
    # unweighted metric of the branch's latest decision (None: not measured), which a computed call is scored with
    error_per_metric: ErrorPerMetric = field(default_factory=ErrorPerMetric)
    unweighted_metric: float | None = None
    # with ``skip_correction``: the sigma ``previous_residual`` was computed at, and the skipped steps since
    residual_sigma: float | None = None
    skips: SkipCorrection = field(default_factory=SkipCorrection)

    def reset(self) -> None:
        self.__init__()


@dataclass
class ActiveCall:
    """The cache's own bookkeeping for the call in progress."""

    context: CallContext
    keys: list[str]
    labels: list[str]
    chunk: int
    started: float
    record: EvaluationRecord | None = None
    # at the head block (``StackCacheRun.decide``): its arguments, each branch's state and the shape of its input
    head_call: tuple[tuple, dict] = field(default_factory=lambda: ((), {}))
    states: list[CachedResidualState] = field(default_factory=list)
    branch_shapes: list[torch.Size] = field(default_factory=list)
    head_input: torch.Tensor | None = None
    captured: torch.Tensor | None = None
    # per branch key: what the policy measured at the head and compares at the tail (TeaCache: the input change;
    # MagCache: the residual the new one is compared with)
    head_measures: dict[str, float | torch.Tensor] = field(default_factory=dict)
    # a stack with several tails (one per packed stream): the next tail's part, the stream outputs seen so far (a
    # computed call) or the packed reused hidden and how much of it the earlier tails took (a skipped call)
    tail_part: int = 0
    tail_outputs: list[torch.Tensor] = field(default_factory=list)
    reused: torch.Tensor | None = None
    reused_offset: int = 0

    @property
    def skipping(self) -> bool:
        return self.context.blocks_run is False

    def keep_own_part(self) -> None:
        """CFG parallel: keep the branches of the part of the batch this rank computes (``RankView.batch_part``);
        branches that do not divide into the parts become one."""
        batch_part = self.context.rank.batch_part
        index, parts = batch_part() if batch_part is not None else (0, 1)
        if parts == 1:
            return
        if self.chunk == 0 or self.chunk % parts:
            self.as_one_branch()
            return
        size = self.chunk // parts
        self.keys = self.keys[index * size:(index + 1) * size]
        self.labels = self.labels[index * size:(index + 1) * size]
        self.chunk = size

    def as_one_branch(self) -> None:
        """Treat the whole batch as one branch (its chunks unknown or inconsistent)."""
        self.keys, self.labels = ["|".join(self.keys) or "default"], ["+".join(self.labels) or "all"]
        self.chunk = 1


@dataclass
class Decision:
    """One branch's verdict from a policy: ``reason`` (one of ``stats.REASONS``) ``REUSE`` means it may skip;
    anything else means compute."""

    reason: str
    metric: float | None = None


def measured_floats(call: ActiveCall, values: list[torch.Tensor | None]) -> list[float | None]:
    """Per-branch measured 0-d tensors (None: not measured) as host floats, with one host sync.

    Under sequence parallelism (``call.context.rank.agreement``) each value is the mean over the ranks, since a
    rank measures only its shard of the tokens; the agreement is then called exactly once per call, on every
    rank, measured or not, so no rank waits on a collective another one skipped.
    """
    agreement = call.context.rank.agreement
    measured = [v for v in values if v is not None]
    if agreement is None:
        floats = iter(torch.stack(measured).tolist() if measured else [])
        return [next(floats) if v is not None else None for v in values]
    zero = torch.zeros((), dtype=torch.float32, device=measured[0].device if measured else None)
    means = agreement.mean(torch.stack([zero if v is None else v.float() for v in values])).tolist()
    return [m if v is not None else None for v, m in zip(values, means)]


def held_bytes(states: list[CachedResidualState]) -> int:
    """Bytes of the tensors the branch states hold (each tensor once: the newest residual is also in the forecast
    history)."""
    seen: set[int] = set()
    total = 0
    for st in states:
        for value in [*vars(st).values(), *st.history.residuals, st.skips.used]:
            if isinstance(value, torch.Tensor) and id(value) not in seen:
                seen.add(id(value))
                total += value.numel() * value.element_size()
    return total
