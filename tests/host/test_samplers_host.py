"""How far each step's model output moves the final latent, measured on this ComfyUI's own samplers
(``nodes.samplers``): plain Euler's weights are its sigma steps; every consistent sampler's add up to the
sigma it travels (a constant error of the output moves the latent by that much); a multistep sampler's differ from
the sigma steps at its last steps; a stochastic sampler is measured alike twice and leaves the random state as it
was; a sampler that cannot be measured gets None; the speed-up's skip correction weighs the gaps of
uni_pc, dpmpp_2m and res_multistep only."""
from __future__ import annotations

import math

import pytest
import torch

from omnitest.pack import pack_module

pytestmark = pytest.mark.host

STEPS = 30


def flow_run(sampler_name: str):
    """A flow model's sampling objects and the sigmas ComfyUI gives ``sampler_name`` at 30 'simple' steps, shift 5."""
    import comfy.model_sampling
    import comfy.samplers

    class Flow(comfy.model_sampling.ModelSamplingDiscreteFlow, comfy.model_sampling.CONST):
        pass

    model_sampling = Flow(None)
    model_sampling.set_parameters(shift=5.0)
    discard = sampler_name in comfy.samplers.KSampler.DISCARD_PENULTIMATE_SIGMA_SAMPLERS
    sigmas = comfy.samplers.calculate_sigmas(model_sampling, "simple", STEPS + discard)
    if discard:
        sigmas = torch.cat([sigmas[:-2], sigmas[-1:]])

    class Patcher:
        @staticmethod
        def get_model_object(name):
            assert name == "model_sampling"
            return model_sampling

    return comfy.samplers.sampler_object(sampler_name), sigmas, model_sampling, Patcher()


def weights_of(sampler_name: str):
    sampler, sigmas, model_sampling, patcher = flow_run(sampler_name)
    return pack_module("nodes.samplers").step_weights(sampler, sigmas, model_sampling, patcher), sigmas


def test_euler_weighs_each_step_by_its_sigma_step():
    weights, sigmas = weights_of("euler")
    steps = (sigmas[:-1] - sigmas[1:]).tolist()
    assert len(weights) == STEPS
    assert weights == pytest.approx(steps, rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("sampler_name", ["euler", "heun", "uni_pc", "dpmpp_2m", "res_multistep", "deis",
                                          "euler_ancestral", "dpmpp_2m_sde"])
def test_every_consistent_samplers_weights_add_up_to_the_sigma_it_travels(sampler_name):
    weights, sigmas = weights_of(sampler_name)
    assert weights is not None and len(weights) == len(sigmas) - 1
    assert sum(weights) == pytest.approx(float(sigmas[0] - sigmas[-1]), rel=2e-3)


@pytest.mark.parametrize("sampler_name", ["uni_pc", "dpmpp_2m", "res_multistep"])
def test_a_multistep_sampler_weighs_its_last_steps_otherwise_than_their_sigma_steps(sampler_name):
    weights, sigmas = weights_of(sampler_name)
    steps = (sigmas[:-1] - sigmas[1:]).tolist()
    # the penultimate step's output also enters the final step's history: it weighs far more than its sigma step
    assert weights[-2] > 1.5 * steps[-2], (weights[-4:], steps[-4:])
    assert all(abs(w - s) < 0.01 for w, s in zip(weights[:10], steps[:10]))  # the early steps hardly differ


def test_a_stochastic_sampler_is_measured_alike_twice_and_leaves_the_random_state_as_it_was():
    torch.manual_seed(1234)
    state = torch.random.get_rng_state()
    first, _ = weights_of("euler_ancestral")
    assert torch.equal(torch.random.get_rng_state(), state)
    second, _ = weights_of("euler_ancestral")
    assert first == second


def test_a_sampler_that_cannot_be_measured_gets_none():
    import comfy.samplers

    step_weights = pack_module("nodes.samplers").step_weights
    _, sigmas, model_sampling, patcher = flow_run("euler")

    def needs_a_real_model(model, x, sigmas, extra_args=None, callback=None, disable=None):
        return model.inner_model.inner_model.diffusion_model(x)  # what the stand-in does not have

    assert step_weights(comfy.samplers.KSAMPLER(needs_a_real_model), sigmas, model_sampling, patcher) is None
    assert step_weights(object(), sigmas, model_sampling, patcher) is None  # not a KSAMPLER (another pack's)
    assert step_weights(comfy.samplers.sampler_object("euler"), None, model_sampling, patcher) is None

    def nan(model, x, sigmas, extra_args=None, callback=None, disable=None):
        return x * math.nan

    assert step_weights(comfy.samplers.KSAMPLER(nan), sigmas, model_sampling, patcher) is None


def test_the_speedups_correction_weighs_the_gaps_of_comfyuis_multistep_samplers_only():
    import comfy.samplers

    corrects_by_weights = pack_module("nodes.samplers").corrects_by_weights
    for name in ("uni_pc", "dpmpp_2m", "res_multistep"):
        assert corrects_by_weights(comfy.samplers.sampler_object(name)), name
    for name in ("euler", "heun", "uni_pc_bh2", "euler_ancestral", "dpmpp_2m_sde", "res_multistep_ancestral", "ddim"):
        assert not corrects_by_weights(comfy.samplers.sampler_object(name)), name
    assert not corrects_by_weights(None)
