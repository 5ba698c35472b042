"""Correcting a run of skipped steps once the step after them is computed.

A skipped step k gives the sampler the block stack's output built from a residual the cache reused or forecast
(``used_k``), from computed steps before the gap. Once the step n after the gap is computed, both ends of the gap are
known, and the residual each skipped step should have had is better estimated by interpolating between them, linearly
in sigma, than by what was extrapolated from before the gap: an interpolation's error is bounded by the gap's
curvature, an extrapolation's grows with its distance.

With a sampler whose step moves the latent by ``(sigma_{k+1} - sigma_k) * output`` (plain Euler on a model whose
denoised is ``x - sigma * output``: ``CallContext.euler_steps``), the skipped steps moved the latent by
``sum_k h_k * used_k`` through the model's head (``h_k``: step k's sigma step) where the interpolation says
``sum_k h_k * interp_k``. Step n's output can carry the difference: adding

    strength * (sigma_{n+1} / sigma_n) * sum_k h_k * (interp_k - used_k) / h_n

to step n's stack output makes its Euler step also move the latent by that much (to first order: the head is
linearised around step n). ``sigma_{n+1} / sigma_n`` is how much of a latent error step n itself keeps where the
model's prediction of the clean latent does not depend on the error (at high noise): the rest, step n removes on its
own, so the final step (to sigma 0, which lands on that prediction) corrects nothing. ``strength`` below 1 damps the
rest, since the residual computed at n has already seen the latent the skips moved, so part of the difference is in
it.

A multistep sampler (``CallContext.weighted_correction``: uni_pc, dpmpp_2m, res_multistep) moves the latent by a
combination of this and earlier steps' outputs, so a skipped step's error reaches the final latent by the step's
weight ``w_k`` (``CallContext.step_weights``: measured on the sampler, the model's output held fixed), not by its
sigma step; the same holds for what step n's output adds (``w_n``). With ``h`` replaced by ``w`` the correction above
cancels the gap's error in the final latent to first order, with the same damping. A weight may be negative (uni_pc's
corrector gives one of its last steps a weight of the opposite sign): the correction then adds the opposite, as the
first-order model says. A step whose own weight is below ``WEIGHT_FLOOR`` of the gap's largest (in magnitude) would
blow the gap's error up: it corrects nothing, and the gap is forgotten. A speed-up applies the correction so
(``StackCacheConfig.speedup``: a workflow saved with the skip correction set and such a sampler corrected nothing and
keeps doing so). On the benchmark models, against no correction at 2x to 3.75x: uni_pc gained 2.3 dB
on average (-1.0 to +6.6), dpmpp_2m and res_multistep 0.8 to 0.9 (-2.0 to +3.8;
docs/benchmarks.md, "A skip correction for the multistep samplers").

``SkipCorrection`` (one per branch) keeps what a gap's skips used as running sums, ``sum h_k * used_k`` (one tensor, in
float32 or the residual's wider dtype), ``sum h_k`` and ``sum h_k * sigma_k`` (``w`` for ``h`` with a multistep
sampler), so its memory does not grow with the gap:
``sum_k h_k * interp_k = H * previous + (M - sigma_p * H) / (sigma_n - sigma_p) * (computed - previous)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: a computed step corrects a gap by its step weight only where that weight is at least this fraction of the gap's
#: largest (both in magnitude): the correction divides by it
WEIGHT_FLOOR = 0.25


def wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype the sums are kept in: float32, or ``dtype`` where it is wider (float64)."""
    return torch.promote_types(dtype, torch.float32)


@dataclass
class SkipCorrection:
    """One branch's skipped steps since its last computed one, as running sums (see the module's docstring)."""

    used: torch.Tensor | None = None  # sum over the gap's skipped steps of h_k * the residual each used (``wide``)
    steps: float = 0.0                # sum of the gap's sigma steps h_k (or weights w_k)
    moments: float = 0.0              # sum of h_k * sigma_k
    largest: float = 0.0              # the largest |w_k| of the gap (step weights only)

    def skipped(self, residual: torch.Tensor, sigma: float, next_sigma: float, weight: float | None = None) -> None:
        """Record a skipped step from ``sigma`` to ``next_sigma`` that used ``residual``; ``weight``: the step's weight
        on a multistep sampler (None: its sigma step)."""
        step_size = abs(sigma - next_sigma) if weight is None else weight
        self.largest = max(self.largest, 0.0 if weight is None else abs(weight))
        weighted = residual.to(wide(residual.dtype)) * step_size
        self.used = weighted if self.used is None or self.used.shape != weighted.shape else self.used + weighted
        self.steps += step_size
        self.moments += step_size * sigma

    def correction(self, previous: torch.Tensor | None, previous_sigma: float | None, computed: torch.Tensor,
                   sigma: float, next_sigma: float, strength: float, weight: float | None = None
                   ) -> torch.Tensor | None:
        """What to add to the computed step's stack output (``computed``'s shape, ``wide`` dtype), then forget the gap.

        ``previous`` / ``previous_sigma``: the residual of the branch's last computed step and its sigma;
        ``computed`` / ``sigma``: this computed step's, whose step goes on to ``next_sigma``; ``weight``: its weight on
        a multistep sampler (None: its sigma step; the gap's steps were recorded alike). None (nothing to add)
        when no step was skipped since the last computed one, or the gap cannot be interpolated (no previous residual,
        another shape, equal sigmas, a step that does not lower sigma, the final step to sigma 0 (it corrects nothing:
        see the module), a ``weight`` below ``WEIGHT_FLOOR`` of the gap's largest, a sum that is not finite)."""
        used, steps, moments, largest = self.used, self.steps, self.moments, self.largest
        self.reset()
        own = sigma - next_sigma if weight is None else weight
        if (used is None or previous is None or previous_sigma is None or previous.shape != computed.shape
                or used.shape != computed.shape or sigma == previous_sigma or not 0 < next_sigma < sigma
                or strength <= 0 or (weight is not None and not abs(weight) >= WEIGHT_FLOOR * largest > 0)):
            return None
        dtype = wide(computed.dtype)
        previous = previous.to(device=computed.device, dtype=dtype)
        used = used.to(device=computed.device, dtype=dtype)
        along = (moments - previous_sigma * steps) / (sigma - previous_sigma)
        interpolated = previous * steps + (computed.to(dtype) - previous) * along
        delta = (interpolated - used) * (strength * (next_sigma / sigma) / own)
        return delta if math.isfinite(float(delta.abs().max())) else None

    def reset(self) -> None:
        self.used, self.steps, self.moments, self.largest = None, 0.0, 0.0, 0.0
