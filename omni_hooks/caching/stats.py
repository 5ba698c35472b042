"""Per-run cache statistics: every decision a cache made, and the totals a log line or a UI panel shows.

What leaves this module for JSON (``to_dict``, ``timeline``, ``json_safe``) is always valid JSON: a number that is not
finite (a threshold or metric that overflowed) becomes the text ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``, so a
reader can tell it from a missing value (``null``) and show it as such.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from .config import StackCacheConfig
from .budget import BUDGET_REASON
from .few_step import FEW_STEP_REASON
from .forecast import CANDIDATE_NAMES, FORECAST, FORECAST_FALLBACK
from .large_steps import LARGE_STEP_REASON

# Why a branch was computed or skipped (``BranchDecision.reason``). ``REASONS`` lists every value the library and its
# host can record; the statistics panel's legend (web/stats_model.js ``REASONS``) explains each one.
REUSE = "reuse"                # skipped: the policy allowed it (also FORECAST, FORECAST_FALLBACK: how it was filled)
FIRST = "first"                # nothing cached yet for the branch
SHAPE = "shape"                # the cached residual does not fit the input's shape
FORCED = "forced"              # a step the policy always computes (TeaCache's first steps and last step)
WINDOW = "window"              # outside start_percent..end_percent
RETENTION = "retention"        # within MagCache's retention_ratio of the first steps
THRESHOLD = "threshold"        # the accumulated change or error reached the threshold
MAX_SKIPS = "max-skips"        # MagCache's K consecutive skips reached
MEASURE = "measure"            # measured, not yet decided (TeaCache's reason until the measurement is compared)
CALIBRATE = "calibrate"        # a calibrating run computes every step
OTHER_BRANCH = "other-branch"  # this branch may skip, another branch of the call computes
OTHER_RANK = "other-rank"      # every branch here may skip, another sequence-parallel rank computes
MODEL_CACHE = "model-cache"    # a stack's ``must_compute``: the call fills the model's own key/value cache
DISABLED = "disabled"          # caching is off for the whole run (``CacheRunStats.disabled``)
REASONS: tuple[str, ...] = (REUSE, FORECAST, FORECAST_FALLBACK, FIRST, SHAPE, FORCED, WINDOW, RETENTION, THRESHOLD,
                            MAX_SKIPS, MEASURE, CALIBRATE, FEW_STEP_REASON, LARGE_STEP_REASON, BUDGET_REASON,
                            OTHER_BRANCH, OTHER_RANK, MODEL_CACHE, DISABLED)
#: the reasons of a skipped branch
SKIP_REASONS = frozenset({REUSE, FORECAST, FORECAST_FALLBACK})

NON_FINITE_TEXT = ("NaN", "Infinity", "-Infinity")


def json_safe(value: Any) -> Any:
    """``value`` with only JSON types left: non-finite numbers as text (``NON_FINITE_TEXT``), tuples as lists,
    mapping keys as text, numpy/torch scalars as Python numbers and anything else as its ``str``."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        x = float(value)
        if math.isfinite(x):
            return x
        return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", None) == 0:
        return json_safe(value.item())  # a 0-d tensor or array
    return str(value)


@dataclass
class BranchDecision:
    """One branch's part of one model evaluation."""

    branch: str            # "cond", "uncond", "cond.1", ...
    computed: bool
    reason: str            # one of ``REASONS``; a skipped branch's is one of ``SKIP_REASONS``
    metric: float | None   # the accumulated distance (TeaCache) or error (MagCache) the decision compared
    threshold: float
    # with a forecast: the candidate a skipped branch's residual came from (its key in ``forecast.CANDIDATE_NAMES``;
    # 0: the last residual reused); None otherwise
    candidate: int | None = None


@dataclass
class EvaluationRecord:
    """One call of the diffusion model: the step it belongs to and each branch's decision."""

    step: int | None
    total_steps: int | None
    computed: bool
    branches: list[BranchDecision]
    seconds: float = 0.0


class RuleEntry(Protocol):
    """What the statistics read of a step rule (``caching.rules.StepRule``): its name, what it did in words and its
    figures."""

    name: str

    def note(self) -> str | None: ...

    def summary(self) -> dict[str, Any] | None: ...


@dataclass
class CacheRunStats:
    """Everything one sampling run's cache did. Cheap to update; ``summary()`` is for logs and the stats panel.

    ``config`` is the run's cache config, read as it is: the model's label, the threshold and the notes (facts about
    the setup worth showing, e.g. what 'auto' chose) come from it."""

    kind: str                       # "teacache" / "magcache"
    config: StackCacheConfig
    evaluations: list[EvaluationRecord] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    cache_bytes: int = 0
    # set when the block stack's output had another shape than its input, so no residual could be kept
    stack_shape_mismatch: bool = False
    disabled: str | None = None  # why caching was disabled for the whole run (every step computed), if it was
    # branch evaluations computed only because the forecast's record weighed the metric (ErrorPerMetric), and
    # the largest weight that did so
    sooner_by_forecast: int = 0
    largest_forecast_weight: float = 1.0
    # skip correction (``caching.skip_correction``): computed calls whose output carried one, and why the run
    # could not correct, if it could not
    corrected_steps: int = 0
    corrected_by_weights: bool = False  # the correction weighed the gaps by the sampler's step weights
    skip_correction_note: str | None = None
    # the run's step rules (``caching.rules.StepRule``), in the order it asks them: each is its own entry here, with
    # its ``note()`` and ``summary()``
    rules: list[RuleEntry] = field(default_factory=list)
    # what the host changed for this run, in words (e.g. a compiler left out), set by the host's side
    host_notes: list[str] = field(default_factory=list)

    @property
    def model(self) -> str:
        """What the statistics call the model (``config.model_label``)."""
        return self.config.model_label

    @property
    def threshold(self) -> float:
        return self.config.threshold

    def computed_sooner(self, weight: float) -> None:
        """Count a branch evaluation that the forecast's record (``weight`` > 1) made compute."""
        self.sooner_by_forecast += 1
        self.largest_forecast_weight = max(self.largest_forecast_weight, weight)

    def forecast_note(self) -> str | None:
        """In words, what the forecast's record changed (None: nothing)."""
        if not self.sooner_by_forecast:
            return None
        return (f"forecast: {self.sooner_by_forecast} branch step(s) computed sooner because the forecast had "
                f"recently erred more than usual (the change weighed up to {self.largest_forecast_weight:.2f}x)")

    def record(self, record: EvaluationRecord) -> None:
        self.evaluations.append(record)

    def warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)

    @property
    def computed(self) -> int:
        return sum(1 for e in self.evaluations if e.computed)

    @property
    def reused(self) -> int:
        return sum(1 for e in self.evaluations if not e.computed)

    @property
    def hit_rate(self) -> float:
        return self.reused / len(self.evaluations) if self.evaluations else 0.0

    @property
    def model_seconds(self) -> float:
        return sum(e.seconds for e in self.evaluations)

    def estimated_seconds_saved(self) -> float:
        """Reused evaluations times the mean time of a computed one (reused ones cost almost nothing)."""
        computed = [e.seconds for e in self.evaluations if e.computed]
        if not computed:
            return 0.0
        return self.reused * sum(computed) / len(computed)

    def why_nothing_was_reused(self) -> str | None:
        """When no evaluation was reused: the most likely cause, in words a user can act on."""
        if not self.evaluations or self.reused:
            return None
        reasons = [b.reason for e in self.evaluations for b in e.branches]
        if self.disabled is not None:
            return f"caching was disabled for this run, so every step is computed: {self.disabled}"
        if self.threshold <= 0:
            return "threshold is 0, so every step is computed"
        forced = (FIRST, FORCED, WINDOW, RETENTION, LARGE_STEP_REASON)  # steps a policy computes whatever changed
        few_step_note = self.rule_note(FEW_STEP_REASON)
        if few_step_note is not None and all(
                r in (*forced, CALIBRATE, FEW_STEP_REASON, THRESHOLD, MAX_SKIPS) for r in reasons) \
                and FEW_STEP_REASON in reasons:
            return few_step_note
        if MODEL_CACHE in reasons and all(r in (*forced, FEW_STEP_REASON, SHAPE, MODEL_CACHE) for r in reasons):
            return ("the model filled its own key/value cache on every call (a prompt or reference image it had not "
                    "seen), and such calls are always computed")
        if all(r in (*forced, CALIBRATE) for r in reasons):
            return ("every step was forced (first/last steps, retention steps, large sigma steps or outside start/end "
                    "percent); use more steps or widen the start/end window")
        if all(r in (*forced, CALIBRATE, MAX_SKIPS) for r in reasons):
            return "the maximum number of consecutive skips (K) allowed none (K = 0 computes every step)"
        if self.stack_shape_mismatch:
            return ("the block stack's output has another shape than its input for this model and input (e.g. "
                    "reference-latent tokens), so its residual cannot be reused")
        if SHAPE in reasons and reasons.count(SHAPE) * 2 >= len(reasons):
            return "the latent shape changed between steps, so no residual could be reused"
        return ("the accumulated change always exceeded the threshold; raise the threshold, or the model may be "
                "few-step/distilled, where caching has little to skip")

    def candidates(self) -> dict[str, int] | None:
        """With a forecast: how many skipped branch evaluations used each candidate (by its name in
        ``forecast.CANDIDATE_NAMES``); None without."""
        used = [b.candidate for e in self.evaluations for b in e.branches if b.candidate is not None]
        if not used:
            return None
        return {name: used.count(key) for key, name in CANDIDATE_NAMES.items() if key in used}

    def summary(self) -> dict[str, Any]:
        total = len(self.evaluations)
        per_branch: dict[str, dict[str, int]] = {}
        for e in self.evaluations:
            for b in e.branches:
                counts = per_branch.setdefault(b.branch, {"computed": 0, "reused": 0})
                counts["computed" if b.computed else "reused"] += 1
        model_seconds = self.model_seconds
        saved = self.estimated_seconds_saved()
        warnings = list(self.warnings)
        non_finite = sum(1 for e in self.evaluations for b in e.branches
                         if b.metric is not None and not math.isfinite(b.metric))
        if non_finite or not math.isfinite(self.threshold):
            what = (f"the measured change was not a finite number in {non_finite} branch evaluation(s)" if non_finite
                    else f"the threshold is {self.threshold}")
            warnings.append(f"{what}: the coefficients or threshold overflow for this model, so every such step is "
                            "computed; calibrate this model again or choose other coefficients")
        nothing = self.why_nothing_was_reused()
        if nothing:
            warnings.append(f"nothing was reused: {nothing}")
        return {
            "kind": self.kind,
            "model": self.model,
            "threshold": self.threshold,
            "evaluations": total,
            "computed": self.computed,
            "reused": self.reused,
            "hit_rate": self.hit_rate,
            "branches": per_branch,
            "model_seconds": model_seconds,
            "estimated_seconds_saved": saved,
            "estimated_speedup": (model_seconds + saved) / model_seconds if model_seconds > 0 else 1.0,
            "cache_bytes": self.cache_bytes,
            "warnings": warnings,
            "notes": list(self.config.notes) + [n for n in (*(rule.note() for rule in self.rules),
                                                            self.forecast_note(), self.correction_note()) if n]
                     + self.host_notes,
            "candidates": self.candidates(),
            "budget": self.rule_summary(BUDGET_REASON),
        }

    def correction_note(self) -> str | None:
        """In words, what skip correction did (None: it was off)."""
        if self.skip_correction_note is not None or not self.config.skip_correction:
            return self.skip_correction_note
        weighed = " (weighed by the sampler's step weights)" if self.corrected_by_weights else ""
        return (f"skip correction {self.config.skip_correction:g}{weighed}: {self.corrected_steps} computed step(s) "
                "also corrected the skipped steps before them")

    def rule_note(self, name: str) -> str | None:
        """What the run's step rule ``name`` did, in words (None: the run has no such rule, or it did nothing)."""
        return next((rule.note() for rule in self.rules if rule.name == name), None)

    def rule_summary(self, name: str) -> dict[str, Any] | None:
        """The figures of the run's step rule ``name`` (None: the run has no such rule, or it has none)."""
        return next((rule.summary() for rule in self.rules if rule.name == name), None)

    def log_line(self) -> str:
        s = self.summary()
        branches = ", ".join(f"{name} {c['reused']}/{c['computed'] + c['reused']}"
                             for name, c in sorted(s["branches"].items()))
        line = (f"{self.kind} ({self.model}, threshold {self.threshold:g}): reused {s['reused']}/{s['evaluations']} "
                f"model evaluations ({branches}); ~{s['estimated_speedup']:.2f}x in the model")
        if s["candidates"]:
            line += "; skipped branches from " + ", ".join(f"{name} {n}" for name, n in s["candidates"].items())
        if s["warnings"]:
            line += "; " + "; ".join(s["warnings"])
        return line

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: the summary and every evaluation."""
        return json_safe({"summary": self.summary(), "evaluations": [asdict(e) for e in self.evaluations]})

    def timeline(self, max_bins: int) -> dict[str, Any]:
        """The evaluations in at most ``max_bins`` consecutive bins of equal size, for runs too long to keep each.

        ``{"bin_size": n, "bins": [{first_step, last_step, evaluations, computed, seconds, branches: {name:
        {computed, reused, reasons: {reason: count}, candidates: {candidate: count}, metric_max, threshold}}}]}``
        (``candidates``: the skipped evaluations' ``candidate`` keys, empty without a forecast); JSON-safe.
        ``metric_max`` is the largest finite metric of the bin (None when none), so the plot keeps its peaks.
        """
        size = max(1, math.ceil(len(self.evaluations) / max(max_bins, 1)))
        bins = []
        for start in range(0, len(self.evaluations), size):
            chunk = self.evaluations[start:start + size]
            steps = [e.step for e in chunk if e.step is not None]
            branches: dict[str, dict[str, Any]] = {}
            for e in chunk:
                for b in e.branches:
                    agg = branches.setdefault(b.branch, {"computed": 0, "reused": 0, "reasons": {}, "candidates": {},
                                                         "metric_max": None, "threshold": b.threshold})
                    agg["computed" if b.computed else "reused"] += 1
                    if b.candidate is not None:
                        agg["candidates"][b.candidate] = agg["candidates"].get(b.candidate, 0) + 1
                    agg["reasons"][b.reason] = agg["reasons"].get(b.reason, 0) + 1
                    if b.metric is not None and math.isfinite(b.metric):
                        agg["metric_max"] = b.metric if agg["metric_max"] is None else max(agg["metric_max"], b.metric)
                    agg["threshold"] = b.threshold
            bins.append({"first_step": min(steps) if steps else None, "last_step": max(steps) if steps else None,
                         "evaluations": len(chunk), "computed": sum(1 for e in chunk if e.computed),
                         "seconds": sum(e.seconds for e in chunk), "branches": branches})
        return json_safe({"bin_size": size, "bins": bins})
