"""A forward budget: a cache computes about N of a run's steps, placed where they matter most for the final latent.

A skipped step adds a residual its cache made up (reused or forecast); its error reaches the latent multiplied by
the step's size in sigma, and a reused residual errs by as much as the residual changed since the last computed
step. So the cost of skipping the steps between two computed steps ``a`` and ``b`` is taken as

    ``(sum over a < j < b of size_j * (change_{a+1} + ... + change_j)) ** 2``

(errors within one gap point the same way and add up, those of different gaps are independent), where ``size_j`` is
step j's sigma step and ``change_i`` how much the block stack's residual changes from step i - 1 to i. ``plan_steps``
chooses the computed steps that minimise the summed cost over the run (dynamic programming, exact), with the first
step and the last computed (the first has nothing to reuse; an error of the last lands unrepaired) and any other
protected step. Measured on the benchmark models, the plan computes most of the final steps, where the schedule
takes its large sigma steps; a threshold policy skips most there (docs/benchmarks.md).

``change`` comes from the cache's calibration (``StepProfile``: each calibrated step's sigma and the relative change
of the residual from the step before, as a rate per unit sigma, so it fits another schedule or step count); without
one the residual is taken to change in proportion to sigma. The schedule is the run's own (``CallContext.schedule``).

A measured plan (``measured_plan``) replaces that model where the calibration kept a sketch of the residual itself
(``StepProfile.sketches``: per step a fixed random projection of each branch's residual, ``residuals.sketch``) and the
run forecasts to first order: the cost of a gap is then what the calibration's own trajectory says its skips would
have erred, ``|sum over a < j < b of w_j * (r_j - f_j)| ** 2``, with ``r_j`` the sketch at step j's sigma (linear in
sigma between calibrated steps), ``f_j`` its 1st-order forecast from the two computed steps before the gap (reuse of
the first step in the first gap) and ``w_j`` the sampler's step weight (``CallContext.step_weights``: how far an error
of step j's output moves the final latent; plain Euler's are the sigma steps). A speed-up places its steps so with a
sampler that takes no Euler steps (docs/benchmarks.md, against the profile's plan at 2x to 6x, before the speed-up
corrected these samplers: with ``uni_pc`` up to 13.3 dB ahead on three of the four benchmark models, mean +4.0 over
all four, up to 4.9 behind on the fourth; with ``dpmpp_2m`` and ``res_multistep`` about even at 2x to 3.75x and ahead
at 5x and 6x). That cost leaves out the skip correction that follows a gap: modelling it there moved single cells by
several dB either way and gained nothing reliable (docs/benchmarks.md, "A skip correction for the multistep samplers").

With a sampler that takes Euler steps a speed-up computes a tail plan (``tail_plan``): the profile's plan with its
last k steps all computed, for the k whose gaps the measured cost rates lowest, with the skip correction that follows
each gap modelled (``measured_costs``). One calibration's trajectory separates near-equal plans by less than another
prompt's errors do, so the DP over all plans chose several dB wrong at times; among the ``count - 1`` plans of this
one shape its choice held up: against the profile's plan, +2.1 dB in the mean over the four benchmark models at 2x
to 6x, never more than 0.1 behind (docs/benchmarks.md, "The speed-up's plan with euler"). With any other sampler the
tail plan replaces the measured plan only where the measured cost with that sampler's correction modelled rates it
lower (``measured_or_tail``): the tail plan in its place everywhere lost with ``uni_pc``.

``ForwardBudget`` is a run's budget: ``decide`` answers per step, computing the planned steps and the protected ones
(``must``), and lets the cache's policy bring the next planned compute forward (``wants``: its threshold says compute
now), by at most half its gap, so the count stays the budget and the steps planned after it stay where they are; a
compute the plan could not foresee (``must``: nothing cached, a new shape) re-plans the rest with what is left.
Every input is the same on every rank of a group (the schedule, the profile, the policy's rank-mean metric), so every
rank plans alike.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..context import sigma_steps

BUDGET_REASON = "budget"  # BranchDecision.reason of a step computed because the budget's plan placed it there
MEASURED, TAIL = "measured", "tail"  # ForwardBudget.start's ``by``: ``measured_plan``, ``tail_plan``
PLACEMENTS = {MEASURED: "the calibration's measured trajectory and the sampler's step weights",
              TAIL: "the calibration's step profile, with as many of the last steps as its measured trajectory favours",
              "calibrated": "the calibration's step profile", "schedule": "the schedule (no calibration)"}


#: a calibration's sketch of a step's residual: this many numbers per branch (``residuals.sketch``) ...
SKETCH_SIZE = 1024
#: ... and at most this many over all its steps (a longer run's sketches keep every k-th of their numbers)
SKETCH_VALUES = 1 << 16
#: the most steps ``measured_plan`` plans (its cost table is steps ** 3 / 6 sketches long); a longer run gets the
#: profile's plan
MAX_MEASURED_STEPS = 100


@dataclass(frozen=True)
class StepProfile:
    """How a model's block-stack residual changes along sigma, measured by a calibration run.

    ``sigmas[i]``: the sigma of calibrated step i (descending); ``changes[i]``: the relative change of the residual
    from step i - 1 to i, ``|r_i - r_(i-1)| / |r_(i-1)|`` (averaged over the branches; ``changes[0]`` is 0);
    ``sketches[i]`` (None: a calibration made before they were kept): a fixed random projection of step i's residual
    (``residuals.sketch``), its branches one after the other, the same length at every step (``measured_plan``).
    """

    sigmas: tuple[float, ...]
    changes: tuple[float, ...]
    sketches: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "sigmas", tuple(float(s) for s in self.sigmas))
        object.__setattr__(self, "changes", tuple(float(c) for c in self.changes))
        if len(self.sigmas) != len(self.changes) or len(self.sigmas) < 2:
            raise ValueError(f"a step profile needs as many sigmas as changes, at least 2; got {len(self.sigmas)} "
                             f"sigmas and {len(self.changes)} changes")
        if not all(np.isfinite(self.sigmas)) or not all(np.isfinite(self.changes)) or min(self.changes) < 0:
            raise ValueError("a step profile holds finite sigmas and finite non-negative changes")
        if self.sketches is not None:
            sketches = tuple(tuple(float(v) for v in sketch) for sketch in self.sketches)
            object.__setattr__(self, "sketches", sketches)
            if len(sketches) != len(self.sigmas) or len({len(k) for k in sketches}) != 1 or not sketches[0]:
                raise ValueError(f"a step profile's sketches are one per step ({len(self.sigmas)}), all of one "
                                 "non-zero length")
            if len(sketches) * len(sketches[0]) > SKETCH_VALUES:
                raise ValueError(f"a step profile's sketches hold at most {SKETCH_VALUES} values")
            if not all(np.isfinite(k).all() for k in sketches):
                raise ValueError("a step profile's sketches hold finite numbers")

    def rates(self) -> tuple[list[float], list[float]]:
        """The change per unit sigma over each calibrated interval, at the interval's middle: (middles ascending,
        rates)."""
        points = []
        for i in range(1, len(self.sigmas)):
            width = abs(self.sigmas[i - 1] - self.sigmas[i])
            if width > 0:
                points.append(((self.sigmas[i - 1] + self.sigmas[i]) / 2, self.changes[i] / width))
        points.sort()
        return [p[0] for p in points], [p[1] for p in points]

    def changes_for(self, schedule: list[float]) -> list[float]:
        """The expected change at each step of ``schedule`` (sigmas, the last one after the final step): the rate
        at the interval's middle (linear between calibrated points, constant beyond them) times its width; step 0
        gets 0."""
        middles, rates = self.rates()
        if not rates:
            return steps_in_sigma(schedule)
        out = [0.0]
        for i in range(1, len(schedule) - 1):
            mid, width = (schedule[i - 1] + schedule[i]) / 2, abs(schedule[i - 1] - schedule[i])
            out.append(width * float(np.interp(mid, middles, rates)))
        return out

    def to_data(self) -> dict:
        data = {"sigmas": [round(s, 6) for s in self.sigmas], "changes": [round(c, 6) for c in self.changes]}
        if self.sketches is not None:
            data["sketches"] = [[float(f"{v:.5g}") for v in sketch] for sketch in self.sketches]
        return data

    @classmethod
    def from_data(cls, data) -> "StepProfile":
        """From ``to_data``'s dict (one without sketches too); ValueError for anything else."""
        if not isinstance(data, dict) or not isinstance(data.get("sigmas"), list) \
                or not isinstance(data.get("changes"), list):
            raise ValueError("a step profile is a mapping with a 'sigmas' and a 'changes' list")
        sketches = data.get("sketches")
        if sketches is not None and (not isinstance(sketches, list) or not all(isinstance(k, list) for k in sketches)):
            raise ValueError("a step profile's 'sketches' is a list of lists")
        values = data["sigmas"] + data["changes"] + [v for k in sketches or () for v in k]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise ValueError("a step profile's sigmas, changes and sketches are numbers")
        return cls(tuple(data["sigmas"]), tuple(data["changes"]),
                   None if sketches is None else tuple(tuple(k) for k in sketches))

    def sketches_for(self, schedule: list[float]) -> np.ndarray | None:
        """The sketch at each step of ``schedule`` (its sigmas, the last one after the final step), linear in sigma
        between calibrated steps and the nearest one's beyond them: ``[steps, values]`` float64; None without
        sketches."""
        if self.sketches is None:
            return None
        order = np.argsort(self.sigmas, kind="stable")
        sigmas = np.asarray(self.sigmas, dtype=np.float64)[order]
        sketches = np.asarray(self.sketches, dtype=np.float64)[order]
        at = np.clip(np.asarray(schedule[:-1], dtype=np.float64), sigmas[0], sigmas[-1])
        upper = np.clip(np.searchsorted(sigmas, at, side="left"), 1, len(sigmas) - 1)
        lower = upper - 1
        width = sigmas[upper] - sigmas[lower]
        t = np.where(width > 0, (at - sigmas[lower]) / np.where(width > 0, width, 1.0), 0.0)[:, None]
        return sketches[lower] * (1 - t) + sketches[upper] * t


def steps_in_sigma(schedule: list[float]) -> list[float]:
    """Without a profile: the change at each step taken as its sigma step (0 for step 0)."""
    return [0.0] + sigma_steps(schedule)[:-1]


def gap_costs(changes: list[float], sizes: list[float]) -> np.ndarray:
    """``cost[a, b]`` (a < b): the cost of computing steps a and b and skipping every step between them (module
    docstring), from prefix sums: ``sum_j size_j * (C_j - C_a)`` with ``C`` the running sum of ``changes``."""
    steps = len(changes)
    c = np.cumsum(np.asarray(changes, dtype=np.float64))
    s = np.asarray(sizes, dtype=np.float64)
    sc = np.concatenate([[0.0], np.cumsum(s * c)])  # sc[k] = sum_{j<k} s_j C_j
    ss = np.concatenate([[0.0], np.cumsum(s)])
    a = np.arange(steps)[:, None]
    b = np.arange(steps)[None, :]
    inner = (sc[b] - sc[np.minimum(a + 1, b)]) - c[a] * (ss[b] - ss[np.minimum(a + 1, b)])  # j in a+1 .. b-1
    cost = np.where(b > a, inner ** 2, np.inf)
    return cost


#: the most steps ``plan_steps`` plans exactly: its cost table is steps x steps and its search count x steps x steps,
#: so a longer run (rare: hundreds of sampler steps) gets evenly spaced steps instead
MAX_PLANNED_STEPS = 500


def plan_steps(count: int, changes: list[float], sizes: list[float], first: int = 0,
               protected: frozenset[int] | set[int] = frozenset()) -> list[int]:
    """The ``count`` steps of ``first .. len(changes) - 1`` to compute (``first`` and the last one among them, and
    every ``protected`` step in that range) that minimise the summed gap cost (``gap_costs``); fewer or more steps
    than that allows are clamped. Exact dynamic programming, deterministic: the same plan on every rank. Over
    ``MAX_PLANNED_STEPS`` steps, the other steps are spread evenly between ``first`` and the last instead."""
    last = len(changes) - 1
    must = sorted({first, last} | {p for p in protected if first <= p <= last})
    available = last - first + 1
    count = max(len(must), min(count, available))
    if count >= available:
        return list(range(first, last + 1))
    if available > MAX_PLANNED_STEPS:
        spread = np.linspace(first, last, count - len(must) + 2).round().astype(int).tolist()
        plan = set(must) | set(spread)
        free = (s for s in range(first, last + 1) if s not in plan)  # where rounding made two coincide
        while len(plan) < count:
            plan.add(next(free))
        return sorted(plan)
    cost = gap_costs(changes, sizes)[first:, first:]
    span = available
    # a gap may not pass over a protected step
    blocked = np.zeros((span, span), dtype=bool)
    for p in must:
        q = p - first
        blocked[:q, q + 1:] = True
    cost = np.where(blocked, np.inf, cost)
    best = np.full((count + 1, span), np.inf)
    back = np.full((count + 1, span), -1, dtype=np.int64)
    best[1, 0] = 0.0
    for k in range(2, count + 1):
        totals = best[k - 1][:, None] + cost  # [from a, to b]
        back[k] = np.argmin(totals, axis=0)
        best[k] = totals[back[k], np.arange(span)]
    plan, j, k = [], span - 1, count
    while k >= 1 and j >= 0:
        plan.append(j + first)
        j, k = int(back[k, j]), k - 1
    return sorted(plan)


def measured_costs(profile: StepProfile, schedule: list[float], weights: list[float] | None,
                   correction: float = 0.0) -> np.ndarray | None:
    """``cost[p + 1, a, b]`` (module docstring): the measured cost of computing ``p`` and ``a`` (``p`` = -1: ``a`` is
    the first) and then ``b``, skipping ``a + 1 .. b - 1``; inf where ``b <= a`` or ``p >= a``. Each skip's 1st-order
    forecast error on the profile's sketches at ``schedule``'s sigmas, weighed by ``weights`` (the sampler's step
    weights; None, or not one per step: the sigma steps). ``correction`` above 0: what the skip correction of that
    strength (``skip_correction``, by these weights, no floor) leaves of each gap's error once ``b`` is computed:
    ``strength * sigma_(b+1) / sigma_b * sum_j w_j * (interp_j - f_j)`` taken off it, ``interp_j`` the sketch
    interpolated between ``a`` and ``b`` (nothing at the final step, to sigma 0). None where the profile has no
    sketches or the run has fewer than 2 or more than ``MAX_MEASURED_STEPS`` steps."""
    steps = len(schedule) - 1
    sketches = profile.sketches_for(schedule) if 2 <= steps <= MAX_MEASURED_STEPS else None
    if sketches is None:
        return None
    w = np.abs(np.asarray(weights if weights is not None and len(weights) == steps else sigma_steps(schedule),
                          dtype=np.float64))
    sigma = np.asarray(schedule[:-1], dtype=np.float64)
    after = np.asarray(schedule[1:], dtype=np.float64)  # the sigma each step goes to
    cost = np.full((steps + 1, steps, steps), np.inf)
    for a in range(steps - 1):
        later = sketches[a + 1:]
        ends = np.arange(a + 2, steps)  # row k of a gap's sums: skips a + 1 .. a + 1 + k, computed b = a + 2 + k
        if correction > 0 and len(ends):
            wj = w[a + 1:, None]
            steps_sum, moments = np.cumsum(wj, axis=0)[:len(ends)], np.cumsum(wj * sigma[a + 1:, None], axis=0)
            along = (moments[:len(ends)] - sigma[a] * steps_sum) / (sigma[ends] - sigma[a])[:, None]
            interpolated = steps_sum * sketches[a] + (sketches[ends] - sketches[a]) * along
            damped = np.where((after[ends] > 0) & (after[ends] < sigma[ends]),
                              correction * after[ends] / sigma[ends], 0.0)[:, None]
        for p in range(-1, a):
            if p < 0:
                forecast = np.broadcast_to(sketches[a], later.shape)
            else:
                span = sigma[a] - sigma[p]
                if span == 0:
                    continue
                slope = (sketches[a] - sketches[p]) / span
                forecast = sketches[a] + (sigma[a + 1:, None] - sigma[a]) * slope
            errors = np.cumsum(w[a + 1:, None] * (later - forecast), axis=0)[:len(ends)]  # r - f, summed
            if correction > 0 and len(ends):
                used = np.cumsum(w[a + 1:, None] * forecast, axis=0)[:len(ends)]
                errors = errors - damped * (interpolated - used)
            cost[p + 1, a, a + 1] = 0.0
            cost[p + 1, a, a + 2:] = np.square(errors).sum(axis=1)
    return cost


def plan_cost(plan: list[int], cost: np.ndarray) -> float:
    """The summed ``measured_costs`` of ``plan``'s gaps (computed steps, ascending)."""
    return float(sum(cost[(plan[i - 2] if i >= 2 else -1) + 1, plan[i - 1], plan[i]] for i in range(1, len(plan))))


def measured_plan(count: int, profile: StepProfile, schedule: list[float], weights: list[float] | None,
                  protected: frozenset[int] | set[int] = frozenset()) -> list[int] | None:
    """The ``count`` steps of a run on ``schedule`` (its sigmas, ``steps + 1`` of them) to compute, the first, the
    last and every ``protected`` one among them, that minimise the measured cost of the gaps (``measured_costs``,
    no correction). Exact dynamic programming over the last two computed steps, deterministic: the same plan on every
    rank. None where ``measured_costs`` is."""
    steps = len(schedule) - 1
    cost = measured_costs(profile, schedule, weights)
    if cost is None:
        return None
    must = sorted({0, steps - 1} | {p for p in protected if 0 <= p < steps})
    count = max(len(must), min(count, steps))
    if count >= steps:
        return list(range(steps))
    for q in must:  # a gap may not pass over a step that must compute
        cost[:, :q, q + 1:] = np.inf
    # best[p + 1, a]: the cheapest plan of k steps whose last two are p and a
    best = np.full((steps + 1, steps), np.inf)
    best[0, 0] = 0.0
    back = []
    for _ in range(count - 1):
        totals = best[:, :, None] + cost  # [p + 1, a, b]
        chosen = np.argmin(totals, axis=0)  # [a, b]
        back.append(chosen)
        best = np.full((steps + 1, steps), np.inf)
        best[1:, :] = np.take_along_axis(totals, chosen[None], axis=0)[0]
    a = int(np.argmin(best[:, steps - 1])) - 1
    if not np.isfinite(best[a + 1, steps - 1]):
        return None
    plan, b = [steps - 1], steps - 1
    for chosen in reversed(back):
        plan.append(a)
        a, b = int(chosen[a, b]) - 1, a
    return sorted(plan)


def tail_plan(count: int, profile: StepProfile, schedule: list[float], weights: list[float] | None,
              protected: frozenset[int] | set[int] = frozenset(), correction: float = 0.0) -> list[int] | None:
    """The step profile's plan (``plan_steps``) with its last k steps all computed, for the k from 1 up whose gaps
    the measured cost (``measured_costs``, the skip correction of strength ``correction`` modelled) rates lowest (the
    smallest such k; k = 1 is the profile's own plan): a choice among ``count - 1`` plans of one shape, which the
    measured cost, taken from one calibration's trajectory, tells apart more reliably than all plans at once
    (``measured_plan``). Deterministic. None where ``measured_costs`` is."""
    cost = measured_costs(profile, schedule, weights, correction)
    return None if cost is None else cheapest_tail(count, profile, schedule, protected, cost)


def cheapest_tail(count: int, profile: StepProfile, schedule: list[float], protected: frozenset[int] | set[int],
                  cost: np.ndarray) -> list[int] | None:
    """``tail_plan``'s choice by the cost table ``cost`` (``measured_costs``)."""
    steps = len(schedule) - 1
    count = max(len({0, steps - 1} | {p for p in protected if 0 <= p < steps}), min(count, steps))
    if count >= steps:
        return list(range(steps))
    changes, sizes = profile.changes_for(schedule), sigma_steps(schedule)
    best: tuple[float, list[int]] | None = None
    for k in range(1, count):
        tail = steps - k  # the tail's first step, the head plan's last
        head = plan_steps(count - k + 1, changes[:tail + 1], sizes[:tail + 1], 0, {p for p in protected if p <= tail})
        plan = sorted(set(head) | set(range(tail, steps)))
        total = plan_cost(plan, cost) if len(plan) == count else np.inf
        if np.isfinite(total) and (best is None or total < best[0]):
            best = (total, plan)
    return best[1] if best is not None else None


def measured_or_tail(count: int, profile: StepProfile, schedule: list[float], weights: list[float] | None,
                     protected: frozenset[int] | set[int] = frozenset(), correction: float = 0.0
                     ) -> tuple[list[int] | None, str]:
    """``measured_plan``'s plan, or ``tail_plan``'s where the measured cost with the run's skip correction of strength
    ``correction`` modelled (``measured_costs``) rates it lower (the DP rated its own plan without the correction; with
    none to model, its plan stands): (the plan, ``MEASURED`` or ``TAIL``); (None, ``MEASURED``) where
    ``measured_plan`` is None."""
    plan = measured_plan(count, profile, schedule, weights, protected)
    if plan is None or correction <= 0:
        return plan, MEASURED
    cost = measured_costs(profile, schedule, weights, correction)
    tail = cheapest_tail(count, profile, schedule, protected, cost)
    if tail is not None and plan_cost(tail, cost) < plan_cost(plan, cost):
        return tail, TAIL
    return plan, MEASURED


class BudgetSettings(Protocol):
    """What a budget reads of its cache's config (``StackCacheConfig``): how many steps a run of so many computes,
    and the calibration's step profile the plan places them by (None: none)."""

    step_profile: StepProfile | None

    def budget_steps(self, total_steps: int) -> int: ...


@dataclass
class ForwardBudget:
    """One run's budget of ``count`` computed steps (see the module docstring): ``config.budget_steps(total)`` and
    ``config.step_profile``, read from the config as it is (never copied).

    ``start(total, schedule, protected)`` plans the run; ``decide(step, wants, must)`` says whether that step
    computes and why; ``settle(step, computed)`` takes the step's final verdict (a group's agreed one, or one forced
    by the model). The same step asked again (a second call of it: unbatched cond and uncond, a sampler that
    evaluates twice per step) gets the same answer.
    """

    config: BudgetSettings
    total: int | None = None
    plan: list[int] = field(default_factory=list)
    planned: list[int] = field(default_factory=list)  # the first plan, for the statistics
    computed: list[int] = field(default_factory=list)  # the steps computed so far
    placement: str = "schedule"                         # what placed the plan: a key of PLACEMENTS
    brought_forward: int = 0                            # computes the policy's threshold moved earlier
    held_back: int = 0                                  # steps the threshold asked for when none could move
    _changes: list[float] = field(default_factory=list)
    _sizes: list[float] = field(default_factory=list)
    _protected: frozenset[int] = frozenset()
    _verdicts: dict[int, bool] = field(default_factory=dict)
    _origin: dict[int, int] = field(default_factory=dict)  # a planned step -> where the plan first put it

    @property
    def count(self) -> int:
        return self.config.budget_steps(self.total or 0)

    @property
    def profile(self) -> StepProfile | None:
        return self.config.step_profile

    def start(self, total: int, schedule: list[float] | None, protected: set[int] | frozenset[int] = frozenset(),
              weights: list[float] | tuple[float, ...] | None = None, by: str | None = None,
              correction: float = 0.0) -> None:
        """Plan a run of ``total`` steps: ``schedule`` is its sigmas (``total + 1`` of them; None: unknown, then
        equal steps), ``protected`` the steps that must compute. ``by``: ``MEASURED`` places them by
        ``measured_or_tail``, ``TAIL`` by ``tail_plan`` (both with the sampler's step ``weights`` and the skip
        correction of strength ``correction`` modelled), where the profile has sketches; else (and on every re-plan)
        by the profile's changes or the schedule (``plan_steps``)."""
        known = schedule is not None and len(schedule) == total + 1
        if not known:
            schedule = [1.0 - i / total for i in range(total + 1)]
        self.total = total
        self._sizes = sigma_steps(schedule)
        self._changes = self.profile.changes_for(schedule) if self.profile is not None else steps_in_sigma(schedule)
        self._protected = frozenset(protected)
        plan = None
        if by in (MEASURED, TAIL) and known and self.profile is not None:
            listed = None if weights is None else list(weights)
            if by == MEASURED:
                plan, by = measured_or_tail(self.count, self.profile, schedule, listed, self._protected, correction)
            else:
                plan = tail_plan(self.count, self.profile, schedule, listed, self._protected, correction)
        self.placement = by if plan is not None else "calibrated" if self.profile is not None else "schedule"
        self.plan = plan if plan is not None else plan_steps(self.count, self._changes, self._sizes, 0,
                                                             self._protected)
        self.planned = list(self.plan)
        self._origin = {p: p for p in self.plan}
        self.computed, self.brought_forward, self._verdicts = [], 0, {}

    def decide(self, step: int, wants: bool = False, must: bool = False) -> tuple[bool, str | None]:
        """Whether ``step`` computes: (True, BUDGET_REASON) where the plan placed it, (True, None) where ``must``
        makes it or ``wants`` brings the next planned compute forward to it (at most half its gap: no earlier than
        the middle between the last computed step and it, so the steps planned after it stay where they are),
        (False, None) otherwise (``wants`` too: then ``held_back``)."""
        if step in self._verdicts:
            return self._verdicts[step], None
        if must:
            return True, None
        if step in self.plan:
            return True, BUDGET_REASON
        if wants:
            if self._pullable(step) is not None:
                return True, None
            self.held_back += 1
        return False, None

    def _pullable(self, step: int) -> int | None:
        """The planned step a compute at ``step`` would replace: the next one, if it is not protected and ``step``
        lies in the second half of the gap the plan first gave it (so computes brought forward one after the other
        never drift further than that); None otherwise."""
        later = [p for p in self.plan if p > step]
        if not later or later[0] in self._protected or later[0] == self.total - 1:
            return None
        target = self._origin.get(later[0], later[0])
        before = max((self._origin.get(p, p) for p in self.plan if p < step), default=0)
        return later[0] if 2 * step >= before + target else None

    def settle(self, step: int, computed: bool) -> None:
        """Record ``step``'s verdict. A compute brought forward replaces the next planned one; a compute forced off
        the plan (``must``) re-plans what follows with what is left of the budget."""
        if step in self._verdicts:
            if computed and not self._verdicts[step]:  # a later call of the step computed after all
                self._verdicts[step] = True
                self._computed_off_plan(step)
            return
        self._verdicts[step] = computed
        if not computed:
            if step in self.plan:  # a planned step that did not compute (only a host quirk could do that)
                self._replan(step)
            return
        if step in self.plan:
            self.computed.append(step)
        else:
            self._computed_off_plan(step)

    def _computed_off_plan(self, step: int) -> None:
        replaced = self._pullable(step)
        self.computed.append(step)
        if replaced is not None:
            self.plan = sorted(set(self.plan) - {replaced} | {step})
            self._origin[step] = self._origin.pop(replaced, replaced)
            self.brought_forward += 1
        else:
            self._replan(step)

    def _replan(self, step: int) -> None:
        """Plan the steps after ``step`` with what is left of the budget, ``step`` being the last computed."""
        left = self.count - len(self.computed)
        if step >= self.total - 1 or left <= 0:
            self.plan = [p for p in self.plan if p <= step] + [p for p in sorted(self._protected) if p > step]
            return
        later = plan_steps(left + 1, self._changes, self._sizes, step, self._protected)
        self.plan = sorted({p for p in self.plan if p <= step} | set(later))
        self._origin = {p: self._origin.get(p, p) for p in self.plan}

    def describe(self) -> str:
        """In words, for the run's statistics (steps numbered from 1, as the panel shows them)."""
        steps = compact([s + 1 for s in self.computed])
        done = (f"forward budget {self.count}: computed {len(self.computed)} of {self.total} steps (steps {steps}), "
                f"placed by {PLACEMENTS[self.placement]}")
        if self.brought_forward:
            done += (f"; the threshold brought {self.brought_forward} forward (a threshold of 0 leaves the placement "
                     f"to the plan)")
        if self.held_back:
            done += f"; {self.held_back} step(s) over the threshold skipped, the budget being spent"
        return done

    def summary(self) -> dict:
        """What the statistics panel shows: the budget, the steps planned at the start and those computed."""
        return {"steps": self.count, "total_steps": self.total, "planned": list(self.planned),
                "computed": list(self.computed), "brought_forward": self.brought_forward,
                "held_back": self.held_back, "calibrated": self.profile is not None, "placement": self.placement,
                "placed_by": PLACEMENTS[self.placement]}


def compact(steps: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` as ``"0-2, 5, 7-8"``."""
    runs: list[list[int]] = []
    for s in sorted(steps):
        if runs and s == runs[-1][-1] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)

