"""What a run's sampler does with the model's outputs: whether it takes plain Euler steps (``takes_euler_steps``:
``CallContext.euler_steps``), whether a speed-up's skip correction weighs its gaps by its step weights
(``corrects_by_weights``: ``CallContext.weighted_correction``), which step a call belongs to (``step_index``), and how
much each step's output moves the final latent (``step_weights``: ``CallContext.step_weights``), measured on the run's
own sampler.

A cache that skips step j gives the sampler an output that errs by some ``e_j`` (per unit of the model's output
``(x - denoised) / sigma``, through which both EPS and flow models' residuals reach the sampler). The samplers are
linear in what the model returns, so, the outputs of the other steps held fixed, the final latent moves by
``w_j * e_j``: ``w_j`` is the step's weight (``CallContext.step_weights``). Plain Euler moves the latent by each
step's sigma step, so there ``w_j`` is exactly ``sigma_j - sigma_(j+1)``; a multistep sampler (uni_pc, dpmpp_2m,
res_multistep) also feeds the output into its later steps' history, so its weights differ, the most at the last
steps (with ``dpmpp_2m`` the penultimate step weighs about twice its sigma step).

``step_weights`` measures them by running the sampler's own function on a batch of one-element latents and a
stand-in model whose output is 1 everywhere except that batch element ``j + 1`` gets 2 at step j: the difference of
element ``j + 1``'s final latent from element 0's is ``-w_j``, less what the same run without the 2s gives (the noise
a stochastic sampler draws, the same for the same seed, differs between batch elements). Steps are told apart as the
run tells its calls apart (``step_index``), so a sampler that evaluates twice per step (heun) credits both calls where
the run will. Nothing of the model or the run's random state is touched. A sampler this cannot run (not one of
ComfyUI's ``KSAMPLER``, one that needs more of the model than its ``model_sampling``, or whose result is not finite)
gets None: a measured plan (``omni_hooks.caching.budget.measured_plan``) then weighs each step by its sigma step, as
for Euler.
"""
from __future__ import annotations

import logging
import math
import types
import warnings

import comfy.extra_samplers.uni_pc
import comfy.k_diffusion.sampling
import comfy.model_sampling
import comfy.samplers
import torch

log = logging.getLogger("OmniHooks")


def takes_euler_steps(sampler, model_sampling) -> bool:
    """True when each step of ``sampler`` moves the latent by ``(next sigma - sigma) * model output``: ComfyUI's
    'euler' without churn, on a model whose denoised is ``x - sigma * output`` (EPS and flow models; not
    v-prediction or x0 models)."""
    plain = (getattr(sampler, "sampler_function", None) is comfy.k_diffusion.sampling.sample_euler
             and not (getattr(sampler, "extra_options", None) or {}).get("s_churn", 0))
    denoised = getattr(type(model_sampling), "calculate_denoised", None)
    return plain and denoised in (comfy.model_sampling.EPS.calculate_denoised,
                                  comfy.model_sampling.CONST.calculate_denoised)


#: the sampler functions whose skip correction, under a speed-up, weighs a gap by their step weights
#: (``omni_hooks.caching.skip_correction``): ComfyUI's multistep samplers, one model call per step, measured to gain on
#: the benchmark models (docs/benchmarks.md, "A skip correction for the multistep samplers")
WEIGHTED_CORRECTION = (comfy.extra_samplers.uni_pc.sample_unipc, comfy.k_diffusion.sampling.sample_dpmpp_2m,
                       comfy.k_diffusion.sampling.sample_res_multistep)


def corrects_by_weights(sampler) -> bool:
    """True for ComfyUI's 'uni_pc', 'dpmpp_2m' and 'res_multistep' (``WEIGHTED_CORRECTION``), as KSAMPLERs with their
    own function and no extra options."""
    return (isinstance(sampler, comfy.samplers.KSAMPLER) and not sampler.extra_options
            and any(sampler.sampler_function is f for f in WEIGHTED_CORRECTION))


def skip_corrected(sampler_name: str, model_sampling) -> bool:
    """Whether a speed-up's skip correction reaches a run of ComfyUI's sampler ``sampler_name`` at all: one that takes
    plain Euler steps, or one of ``WEIGHTED_CORRECTION``."""
    sampler = comfy.samplers.sampler_object(sampler_name)
    return takes_euler_steps(sampler, model_sampling) or corrects_by_weights(sampler)


def step_index(values: tuple[float, ...], sigma: float) -> int | None:
    """The step of schedule ``values`` (its sigmas, the last one after the final step) a model call at ``sigma``
    belongs to: the step that starts at ``sigma``, else the interval that holds it (samplers that evaluate between
    schedule points: heun, dpm_2); None outside the schedule."""
    for i, s in enumerate(values[:-1]):
        if s == sigma:
            return i
    for i in range(len(values) - 1):
        if min(values[i], values[i + 1]) <= sigma <= max(values[i], values[i + 1]):
            return i
    return None


class _StandIn:
    """The model a k-diffusion sampler function calls (``KSamplerX0Inpaint``'s place): denoised ``x - sigma * out``,
    with ``out`` 1, or 2 in batch element ``j + 1`` at step j. Samplers that read the model's ``model_sampling``
    find the run's own."""

    def __init__(self, values: tuple[float, ...], model_sampling, patcher, perturbed: bool) -> None:
        self.values, self.perturbed = values, perturbed
        self.inner_model = types.SimpleNamespace(model_patcher=patcher, model_sampling=model_sampling,
                                                 inner_model=types.SimpleNamespace(model_sampling=model_sampling))

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, **kwargs) -> torch.Tensor:
        out = torch.ones_like(x)
        step = step_index(self.values, float(sigma.flatten()[0])) if self.perturbed else None
        if step is not None and step + 1 < x.shape[0]:
            out[step + 1] = 2.0
        return x - sigma.reshape(-1, *([1] * (x.ndim - 1))).to(x.dtype) * out


def step_weights(sampler, sigmas: torch.Tensor | None, model_sampling, patcher) -> tuple[float, ...] | None:
    """The weight of each step of the run (``len(sigmas) - 1`` of them; module docstring), or None where the
    sampler's cannot be measured."""
    if sigmas is None or len(sigmas) < 2 or not isinstance(sampler, comfy.samplers.KSAMPLER):
        return None
    values = tuple(float(s) for s in sigmas.tolist())
    steps = len(values) - 1
    schedule = sigmas.detach().to("cpu", torch.float32).clone()

    def final(perturbed: bool) -> torch.Tensor:
        x = torch.full((steps + 1, 1, 1, 1), values[0], dtype=torch.float32)
        with torch.random.fork_rng(devices=[]), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. torchsde on the float32 schedule
            out = sampler.sampler_function(_StandIn(values, model_sampling, patcher, perturbed), x, schedule.clone(),
                                           extra_args={"seed": 0}, callback=None, disable=True,
                                           **(sampler.extra_options or {}))
        out = out.double().flatten()
        return out - out[0]

    try:
        moved = final(False) - final(True)
        weights = tuple(float(moved[j + 1]) for j in range(steps))
    except Exception as error:  # a sampler that needs more of the model: the plan weighs by sigma steps
        log.debug("OmniHooks: the sampler's step weights could not be measured (%s)", error)
        return None
    return weights if all(math.isfinite(w) for w in weights) else None
