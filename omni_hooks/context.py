"""The context of one diffusion-model call, shared by every feature on the model (caches, offload, sequence parallel).

The host creates one ``CallContext`` per call of the diffusion model and hands the same object to each feature in
turn; features read what the host and earlier features wrote and write their own verdicts into typed fields. There is
no untyped scratch space: a new fact that features share gets a field here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@runtime_checkable
class RankAgreement(Protocol):
    """Makes a per-call decision identical on every rank of a sequence-parallel group.

    Every method is a collective: each rank must call it the same number of times, in the same order, whatever it
    decided locally (a rank that skips a call its peers make leaves them waiting forever). Provided by the
    sequence-parallel layer (``omni_hooks.sequence_parallel``); a cache calls it once per decision.
    """

    def mean(self, values: "torch.Tensor") -> "torch.Tensor":
        """The element-wise mean of ``values`` (same shape on every rank) over the ranks, as a CPU tensor."""
        ...

    def any(self, flag: bool) -> bool:
        """True on every rank iff ``flag`` is True on at least one rank."""
        ...


@dataclass(frozen=True)
class RankView:
    """This process's place in a sequence-parallel group (world size 1 = no parallelism).

    ``agreement`` is how features that decide per call (caches) make the same decision on every rank; a view of
    more than one rank must carry one. ``batch_part`` (CFG parallel), asked during the call: ``(index, parts)``, this
    rank computes part ``index`` of ``parts`` equal parts of the call's batch, so it holds only those of the call's
    branches; None or ``(0, 1)``: the whole batch.
    """

    rank: int = 0
    world_size: int = 1
    agreement: RankAgreement | None = None
    batch_part: Callable[[], tuple[int, int]] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"RankView: rank {self.rank} is outside a group of {self.world_size}")
        if self.world_size > 1 and self.agreement is None:
            raise ValueError(
                f"RankView: a group of {self.world_size} ranks needs an agreement (per-rank cache decisions would "
                "differ and deadlock the next collective); use omni_hooks.sequence_parallel's "
                "SequenceParallelRun.rank_view()")


@dataclass
class CallContext:
    """One call of the diffusion model.

    * ``branches`` / ``labels``: one key (stable within a run) and one display label ("cond", "uncond", "cond.1")
      per batch chunk, in batch order;
    * ``step`` / ``total_steps``: the sampler step this call belongs to (None when the host cannot tell);
    * ``sigma``: the noise level the model is evaluated at (None when the host cannot tell); a forecasting cache
      extrapolates in it, so every rank of a group (which sees the same sigma) forecasts alike;
    * ``schedule``: the sampler's sigmas for the run, ``total_steps + 1`` of them (the last one after the final step;
      None when the host cannot tell); a cache with a forward budget plans its computed steps on it;
    * ``blocks_run``: the block stack's verdict for this call, written by a cache at its head block: None until
      decided (and for a model without a cache), True when the blocks compute, False when they are passed through;
      under sequence parallelism it is the same on every rank (``RankView.agreement``);
    * ``rank``: the sequence-parallel view of this process for this call;
    * ``euler_steps``: the sampler moves the latent by ``(next sigma - sigma) * output`` at each step of
      ``schedule`` (plain Euler on a model whose denoised is ``x - sigma * output``), so what a call's output adds to
      the latent is known (``omni_hooks.caching.skip_correction``); False when it does not or the host cannot tell;
    * ``step_weights``: per step of ``schedule``, how far a unit error in that step's model output moves the final
      latent on the run's sampler, the other steps' outputs held fixed (plain Euler's are its sigma steps; a multistep
      sampler's differ, most at its last steps); a cache with a forward budget places its computed steps by them.
      None when the host cannot tell (then the sigma steps stand in);
    * ``weighted_correction``: the sampler is one whose skip correction, under a speed-up, adds up a gap's error by
      ``step_weights`` (``omni_hooks.caching.skip_correction``: a multistep sampler with one model call per step, where
      it was measured to gain); False otherwise or when the host cannot tell.
    """

    branches: list[str]
    labels: list[str]
    step: int | None = None
    total_steps: int | None = None
    sigma: float | None = None
    schedule: tuple[float, ...] | None = None
    blocks_run: bool | None = None
    rank: RankView = RankView()
    euler_steps: bool = False
    step_weights: tuple[float, ...] | None = None
    weighted_correction: bool = False


def sigma_steps(schedule) -> list[float]:
    """How far each step of ``schedule`` (a run's sigmas, ``CallContext.schedule``) moves sigma: ``len(schedule) - 1``
    non-negative sizes, step i's from ``schedule[i]`` to ``schedule[i + 1]``."""
    return [abs(schedule[i] - schedule[i + 1]) for i in range(len(schedule) - 1)]
