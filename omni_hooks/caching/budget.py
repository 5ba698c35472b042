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


@dataclass(frozen=True)
class StepProfile:
    """How fast a model's block-stack residual changes along sigma, measured by a calibration run.

    ``sigmas[i]``: the sigma of calibrated step i (descending); ``changes[i]``: the relative change of the residual
    from step i - 1 to i, ``|r_i - r_(i-1)| / |r_(i-1)|`` (averaged over the branches; ``changes[0]`` is 0).
    """

    sigmas: tuple[float, ...]
    changes: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "sigmas", tuple(float(s) for s in self.sigmas))
        object.__setattr__(self, "changes", tuple(float(c) for c in self.changes))
        if len(self.sigmas) != len(self.changes) or len(self.sigmas) < 2:
            raise ValueError(f"a step profile needs as many sigmas as changes, at least 2; got {len(self.sigmas)} "
                             f"sigmas and {len(self.changes)} changes")
        if not all(np.isfinite(self.sigmas)) or not all(np.isfinite(self.changes)) or min(self.changes) < 0:
            raise ValueError("a step profile holds finite sigmas and finite non-negative changes")

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
        return {"sigmas": [round(s, 6) for s in self.sigmas], "changes": [round(c, 6) for c in self.changes]}

    @classmethod
    def from_data(cls, data) -> "StepProfile":
        """From ``to_data``'s dict; ValueError for anything else."""
        if not isinstance(data, dict) or not isinstance(data.get("sigmas"), list) \
                or not isinstance(data.get("changes"), list):
            raise ValueError("a step profile is a mapping with a 'sigmas' and a 'changes' list")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in data["sigmas"] + data["changes"]):
            raise ValueError("a step profile's sigmas and changes are numbers")
        return cls(tuple(data["sigmas"]), tuple(data["changes"]))


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

    def start(self, total: int, schedule: list[float] | None, protected: set[int] | frozenset[int] = frozenset()) \
            -> None:
        """Plan a run of ``total`` steps: ``schedule`` is its sigmas (``total + 1`` of them; None: unknown, then
        equal steps), ``protected`` the steps that must compute."""
        if schedule is None or len(schedule) != total + 1:
            schedule = [1.0 - i / total for i in range(total + 1)]
        self.total = total
        self._sizes = sigma_steps(schedule)
        self._changes = self.profile.changes_for(schedule) if self.profile is not None else steps_in_sigma(schedule)
        self._protected = frozenset(protected)
        self.plan = plan_steps(self.count, self._changes, self._sizes, 0, self._protected)
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
        done = f"forward budget {self.count}: computed {len(self.computed)} of {self.total} steps (steps {steps})"
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
                "held_back": self.held_back, "calibrated": self.profile is not None}


def compact(steps: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` as ``"0-2, 5, 7-8"``."""
    runs: list[list[int]] = []
    for s in sorted(steps):
        if runs and s == runs[-1][-1] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)

