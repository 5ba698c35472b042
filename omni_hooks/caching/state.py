"""What a block-stack cache keeps per branch (``CachedResidualState``), per call in progress (``ActiveCall``) and per
branch's verdict (``Decision``): the data the run (``run.py``), its hooks (``hooks.py``) and each cache's policy share.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..base import BaseState
from ..context import CallContext
from .forecast import ErrorPerMetric, OrderScores, ResidualHistory
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
    # with the "auto" forecast: how well each order has predicted this branch's computed residuals
    scores: OrderScores = field(default_factory=OrderScores)
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


@dataclass
class Decision:
    """One branch's verdict from a policy: ``reason`` (one of ``stats.REASONS``) ``REUSE`` means it may skip;
    anything else means compute."""

    reason: str
    metric: float | None = None

