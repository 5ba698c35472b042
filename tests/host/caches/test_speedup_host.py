"""The speed-up through Apply TeaCache and Apply MagCache on this ComfyUI, on the quality benchmark's small trained
model (``benchmarks/cache_quality_model.py``, calibrated as the benchmark calibrates it): a fresh node (only its
speed-up set) runs the recipe (``omni_hooks.caching.speedup``) and says so, its forecast the one the calibration's
trial favours; an input the speed-up chooses but the user changed is refused in the node's words; and prompts saved
before the input existed compute the same steps and give the same latent as in the release that saved them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from omnitest.cache_nodes import last_summary
from omnitest.pack import pack_module, run_node
from omnitest.quality import benchmark_modules

pytestmark = pytest.mark.host

STEPS = 30
PROMPT = 1
SAVED = Path(__file__).parent / "data" / "saved_prompts_ba9cd4b.json"


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    import folder_paths

    before = folder_paths.get_user_directory()
    bench, models = benchmark_modules()
    spec = models.MODELS["small"]
    cases = {}

    def case_for(sampler: str):
        """The model calibrated with ``sampler``, its calibrations the ones "calibration: quality" names."""
        if sampler not in cases:
            case = bench.calibrated_case(spec, STEPS, sampler)  # in a user directory of its own
            cases[sampler] = case, folder_paths.get_user_directory()
        case, directory = cases[sampler]
        folder_paths.set_user_directory(directory)
        return case

    yield bench, spec, case_for
    folder_paths.set_user_directory(before)


def sample(bench, spec, case, counter, model, sampler: str = "euler") -> tuple[torch.Tensor, int]:
    (latent,), (computed,) = bench.sample_all(spec, case, model, counter, STEPS, classes=[PROMPT], sampler=sampler)
    return latent, computed


def captured_step_weights(monkeypatch) -> list:
    """The (sigmas, step weights) of each run from now on, as the run gets them (``nodes.features.step_weights``
    wrapped)."""
    features = pack_module("nodes.features")
    step_weights, seen = features.step_weights, []

    def measured(sampler, sigmas, model_sampling, patcher):
        weights = step_weights(sampler, sigmas, model_sampling, patcher)
        seen.append((sigmas.tolist(), weights))
        return weights

    monkeypatch.setattr(features, "step_weights", measured)
    return seen


@pytest.mark.parametrize("cache", ["tea", "mag"])
def test_a_fresh_node_with_a_speedup_is_its_budget_with_first_order_and_the_skip_correction(small, cache, monkeypatch):
    """With euler (a sampler that takes Euler steps) a speed-up is its forward budget with '1st order' and skip
    correction 0.5, its steps the step profile's plan with the tail the calibration's measured trajectory favours
    (``tail_plan``, the correction modelled, the step weights as the run gets them): where that is the profile's own
    plan, the same run bit for bit as those inputs set by hand; on this model at 5x it is not."""
    budget, calibration_files = pack_module("omni_hooks.caching.budget"), pack_module("nodes.caches.calibration_files")
    seen = captured_step_weights(monkeypatch)
    bench, spec, case_for = small
    case, counter = case_for("euler")
    profile = budget.StepProfile.from_data(
        calibration_files.load("teacache" if cache == "tea" else "magcache", "quality")["step_profile"])
    tails = 0
    for speedup in (2.0, 3.0, 3.75, 5.0):
        seen.clear()
        latent, computed = sample(bench, spec, case, counter, bench.fresh(case, speedup, cache))
        notes, summary = last_summary()["notes"], last_summary()["budget"]
        count = round(STEPS / speedup)
        (sigmas, weights), *_ = seen
        expected = budget.tail_plan(count, profile, sigmas, weights, correction=0.5)
        assert computed == count and summary["placement"] == "tail"
        assert summary["planned"] == summary["computed"] == expected
        assert any(n.startswith(f"speed-up {speedup:g}x: computes 1 in {speedup:g} steps") for n in notes), notes
        assert any(n.startswith(f"forward budget {count}: computed {count} of {STEPS}") and
                   n.endswith("placed by the calibration's step profile, with as many of the last steps as its "
                              "measured trajectory favours") for n in notes), notes
        assert any(n.startswith("skip correction 0.5: ") for n in notes), notes
        if expected == budget.plan_steps(count, profile.changes_for(sigmas), budget.sigma_steps(sigmas)):
            recipe = bench.tea(case, 0.0, "1st order", count, 0.5)
            expected_latent, expected_computed = sample(bench, spec, case, counter, recipe)
            assert expected_computed == count and last_summary()["budget"]["computed"] == expected
            assert torch.equal(latent, expected_latent), f"{cache} {speedup}x is not its recipe"
        else:
            tails += 1
    assert tails  # the measured trajectory moved a plan here


@pytest.mark.parametrize("cache", ["tea", "mag"])
def test_with_another_sampler_a_speedup_places_its_steps_by_the_measured_trajectory(small, cache, monkeypatch):
    """With uni_pc a speed-up computes the steps ``measured_or_tail`` chooses from the calibration's sketches and the
    sampler's step weights as this ComfyUI's uni_pc gives them (captured on their way into the run), the skip
    correction modelled, not the step profile's plan; the correction weighs each gap by those weights, and the notes
    say so."""
    budget, calibration_files = pack_module("omni_hooks.caching.budget"), pack_module("nodes.caches.calibration_files")
    seen = captured_step_weights(monkeypatch)
    bench, spec, case_for = small
    case, counter = case_for("uni_pc")
    kind = "teacache" if cache == "tea" else "magcache"
    profile = budget.StepProfile.from_data(calibration_files.load(kind, "quality")["step_profile"])
    assert profile.sketches is not None and len(profile.sketches) == STEPS
    differs = 0
    for speedup in (2.0, 3.0, 3.75):
        seen.clear()
        _, computed = sample(bench, spec, case, counter, bench.fresh(case, speedup, cache), "uni_pc")
        notes, summary = last_summary()["notes"], last_summary()["budget"]
        count = round(STEPS / speedup)
        ((sigmas, weights),) = seen
        assert weights is not None and len(weights) == STEPS
        expected, how = budget.measured_or_tail(count, profile, sigmas, weights, correction=0.5)
        assert computed == count and summary["placement"] == how
        assert summary["planned"] == summary["computed"] == expected
        assert any(n.endswith(f"placed by {budget.PLACEMENTS[how]}") for n in notes), notes
        (note,) = [n for n in notes if n.startswith("skip correction")]
        assert note.startswith("skip correction 0.5 (weighed by the sampler's step weights): "), note
        assert int(note.split(": ")[1].split(" ")[0]) >= 1, note
        differs += expected != budget.plan_steps(count, profile.changes_for(sigmas), budget.sigma_steps(sigmas))
    assert differs  # the measured plan is not the step profile's here


@pytest.mark.parametrize("cache", ["tea", "mag"])
def test_the_calibrations_trial_is_the_speedups_own_runs_and_the_speedup_takes_the_pair_it_favours(
        small, cache, monkeypatch):
    """A Calibrate node with ``try_speedups`` (a fresh node's default, as the benchmark calibrates) saves the speed-up's
    trial: at each tried speed-up, forecast and skip correction, the PSNR of the fresh Apply node's run at that
    speed-up with that pair, on the calibration's own inputs, against the calibration's own run. A speed-up on the
    calibration takes the pair ``SpeedupTrials.choice_for`` names and its notes say why; on this model with uni_pc
    that is another pair than the recipe's at one speed-up at least."""
    speedup = pack_module("omni_hooks.caching.speedup")
    from omnitest import tiny_models

    calibration_files = pack_module("nodes.caches.calibration_files")
    bench, spec, case_for = small
    case, counter = case_for("uni_pc")
    trials = speedup.SpeedupTrials.from_data(
        calibration_files.load("teacache" if cache == "tea" else "magcache", "quality")["speedup_trials"])
    assert (trials.steps, trials.speedups, trials.orders, trials.corrections) == (
        STEPS, speedup.TRIAL_SPEEDUPS, speedup.TRIAL_ORDERS, speedup.TRIAL_CORRECTIONS)

    def calibration_inputs(model) -> torch.Tensor:  # bench.calibrated_case's: class 0, seed 100
        case.positive, case.negative = spec.conditioning(0), spec.conditioning(None)
        return tiny_models.sample(case, model=model, steps=STEPS, cfg=bench.CFG, seed=100, sampler_name="uni_pc")

    reference = calibration_inputs(case.patcher)
    chose_another = False
    for i, rate in enumerate(trials.speedups):
        order, correction, why = trials.choice_for(rate)
        chosen = calibration_inputs(bench.fresh(case, rate, cache))
        words = f"forecast '{speedup.CANDIDATE_NAMES[order]}' and skip correction {correction:g} "
        assert any(words in n and f"as {why};" in n for n in last_summary()["notes"])
        for j, tried in enumerate(trials.pairs):
            with monkeypatch.context() as forced:
                forced.setattr(speedup.SpeedupTrials, "choice_for", lambda self, s, tried=tried: (*tried, "forced"))
                latent = calibration_inputs(bench.fresh(case, rate, cache))
            assert round(speedup.psnr_db(latent, reference), 3) == trials.psnr[i][j], (rate, tried)
            if tried == (order, correction):
                assert torch.equal(latent, chosen)
        chose_another |= (order, correction) != (speedup.FORECAST, speedup.SKIP_CORRECTION)
    assert chose_another


def test_the_trial_drops_the_correction_only_where_the_sampler_takes_one(small):
    """The trial's pair without the skip correction is run only with a sampler the correction reaches (plain Euler
    steps, or 'uni_pc', 'dpmpp_2m', 'res_multistep'); with any other it would be the recipe's run again, so a
    calibration with such a sampler saves the forecasts with the correction alone."""
    speedup, samplers = pack_module("omni_hooks.caching.speedup"), pack_module("nodes.samplers")
    calibration_files = pack_module("nodes.caches.calibration_files")
    bench, spec, case_for = small
    case, _ = case_for("euler_ancestral")
    model_sampling = case.patcher.get_model_object("model_sampling")
    reached = {name: samplers.skip_corrected(name, model_sampling)
               for name in ("euler", "uni_pc", "dpmpp_2m", "res_multistep", "heun", "euler_ancestral", "dpmpp_2m_sde")}
    assert reached == {"euler": True, "uni_pc": True, "dpmpp_2m": True, "res_multistep": True, "heun": False,
                       "euler_ancestral": False, "dpmpp_2m_sde": False}
    for kind in ("teacache", "magcache"):
        trials = speedup.SpeedupTrials.from_data(calibration_files.load(kind, "quality")["speedup_trials"])
        assert trials.pairs == [(1, speedup.SKIP_CORRECTION), (2, speedup.SKIP_CORRECTION)]
        assert all(len(row) == 2 for row in trials.psnr)


def test_a_calibration_without_the_trial_leaves_the_speedup_at_first_order(small):
    """A Calibrate node queued without ``try_speedups`` (an API prompt saved before it) saves the file it did, with
    no trial, and a speed-up on it forecasts '1st order', as before."""
    calibration_files = pack_module("nodes.caches.calibration_files")
    bench, spec, case_for = small
    case, counter = case_for("uni_pc")
    for module, node in (("teacache", "TeaCacheCalibrate"), ("magcache", "MagCacheCalibrate")):
        run_node(getattr(pack_module(f"nodes.caches.{module}"), node), model=case.patcher, seed=100, steps=STEPS,
                 cfg=bench.CFG, sampler_name="uni_pc", scheduler="simple", positive=spec.conditioning(0),
                 negative=spec.conditioning(None), latent_image={"samples": torch.zeros(spec.latent_shape)},
                 name="no-trial")
        assert "speedup_trials" not in calibration_files.load(module, "no-trial")
    model = run_node(pack_module("nodes.caches.teacache").ApplyTeaCache, model=case.patcher,
                     model_variant="calibration: no-trial", speedup=3.75, rel_l1_thresh=-1.0, start_percent=0.0,
                     end_percent=1.0, cache_device="compute device")[0]
    sample(bench, spec, case, counter, model, "uni_pc")
    (note,) = [n for n in last_summary()["notes"] if n.startswith("speed-up 3.75x")]
    assert "forecast '1st order' and skip correction" in note, note


def test_an_interrupted_trial_leaves_the_calibration_saved_without_one(small, monkeypatch):
    """An interrupt (or any error) during the trial's runs reaches the executor as it comes, and the calibration file
    is the one saved before the trial began: complete, without a trial, so a speed-up on it forecasts '1st order'."""
    import comfy.model_management

    calibration_files, inputs = pack_module("nodes.caches.calibration_files"), pack_module("nodes.caches.inputs")
    base = pack_module("nodes.caches.base")
    bench, spec, case_for = small
    case, _ = case_for("euler")
    runs = []

    def interrupted(*args, **kwargs):
        runs.append(args)
        if len(runs) == 2:
            raise comfy.model_management.InterruptProcessingException()
        return inputs.sample_with(*args, **kwargs)

    monkeypatch.setattr(base, "sample_with", interrupted)
    with pytest.raises(comfy.model_management.InterruptProcessingException):
        run_node(pack_module("nodes.caches.teacache").TeaCacheCalibrate, model=case.patcher, seed=100, steps=STEPS,
                 cfg=bench.CFG, sampler_name="euler", scheduler="simple", positive=spec.conditioning(0),
                 negative=spec.conditioning(None), latent_image={"samples": torch.zeros(spec.latent_shape)},
                 name="interrupted", try_speedups=True)
    saved = calibration_files.load("teacache", "interrupted")
    assert len(runs) == 2 and "speedup_trials" not in saved and "step_profile" in saved


def test_the_calibrate_nodes_offer_the_trial_and_a_workflow_saved_without_it_keeps_none():
    inputs = pack_module("nodes.caches.inputs")
    for module, node in (("teacache", "TeaCacheCalibrate"), ("magcache", "MagCacheCalibrate")):
        schema = getattr(pack_module(f"nodes.caches.{module}"), node).define_schema()
        trial = schema.inputs[-1]
        assert trial.id == "try_speedups" and trial.optional and trial.default is True
        assert trial.extra_dict[inputs.SAVED_WITHOUT] is False


@pytest.mark.parametrize("sampler", ["uni_pc", "dpmpp_2m", "res_multistep", "heun", "euler_ancestral"])
def test_the_speedups_correction_weighs_the_multistep_samplers_gaps_and_leaves_the_others_alone(small, sampler,
                                                                                                 monkeypatch):
    """The speed-up's skip correction weighs the gaps by the step weights for the multistep samplers it was measured
    to gain with (uni_pc, dpmpp_2m, res_multistep): their latent differs from the same speed-up without it. With any
    other (one that evaluates twice per step, an ancestral one) it is the same run bit for bit, and the notes say
    why."""
    trials = pack_module("omni_hooks.caching.speedup").SpeedupTrials
    bench, spec, case_for = small
    case, counter = case_for("euler")
    monkeypatch.setattr(trials, "choice_for", lambda self, s: (1, 0.5, "forced"))
    latent, computed = sample(bench, spec, case, counter, bench.fresh(case, 3.0), sampler)
    (note,) = [n for n in last_summary()["notes"] if n.startswith("skip correction")]
    monkeypatch.setattr(trials, "choice_for", lambda self, s: (1, 0.0, "forced"))
    uncorrected, again = sample(bench, spec, case, counter, bench.fresh(case, 3.0), sampler)
    assert again == computed  # the same steps (heun evaluates twice in most)
    assert not any(n.startswith("skip correction") for n in last_summary()["notes"])
    if sampler in ("uni_pc", "dpmpp_2m", "res_multistep"):
        assert note.startswith("skip correction 0.5 (weighed by the sampler's step weights): "), note
        assert not torch.equal(latent, uncorrected)
    else:
        assert note.startswith("skip correction: not applied, the sampler does not take plain Euler steps"), note
        assert torch.equal(latent, uncorrected)


def test_the_widget_offers_the_fresh_speedup_and_a_prompt_without_it_keeps_the_threshold(small):
    inputs = pack_module("nodes.caches.inputs")
    for module, node in (("teacache", "ApplyTeaCache"), ("magcache", "ApplyMagCache")):
        schema = getattr(pack_module(f"nodes.caches.{module}"), node).define_schema()
        (speedup,) = [i for i in schema.inputs if i.id == "speedup"]
        assert schema.inputs[-1] is speedup and speedup.optional  # last: saved widget values keep their positions
        assert speedup.default == inputs.FRESH_SPEEDUP == 2.0
        assert speedup.extra_dict[inputs.SAVED_WITHOUT] == 0.0  # what the page sets in a workflow saved without it
    bench, spec, case_for = small
    case, counter = case_for("euler")
    old = bench.tea(case, 0.1, "off")  # as a prompt saved before the input: no speedup
    explicit = run_node(pack_module("nodes.caches.teacache").ApplyTeaCache, model=case.patcher, rel_l1_thresh=0.1,
                        start_percent=0.0, end_percent=1.0, cache_device="compute device",
                        model_variant="calibration: quality", speedup=0.0)[0]
    (a, computed), (b, computed_explicit) = (sample(bench, spec, case, counter, m) for m in (old, explicit))
    assert torch.equal(a, b) and computed == computed_explicit < STEPS
    assert not any(n.startswith("speed-up") for n in last_summary()["notes"])


@pytest.mark.parametrize("cache, inputs, named", [
    ("tea", {"rel_l1_thresh": 0.3}, "rel_l1_thresh 0.3 is not used at speedup 2"),
    ("tea", {"forecast": "2nd order"}, "forecast '2nd order' is not used at speedup 2"),
    ("mag", {"threshold": 0.1}, "threshold 0.1 is not used at speedup 2"),
    ("mag", {"skip_correction": 0.25}, "skip_correction 0.25 is not used at speedup 2"),
    ("tea", {"forward_budget": 8}, "forward_budget 8 is not used at speedup 2"),
    ("mag", {"speedup": 0.5}, "speedup must be 0 (off) or a number from 1 to 20, got 0.5"),
])
def test_an_input_the_speedup_chooses_but_the_user_changed_is_refused_in_the_nodes_words(small, cache, inputs, named):
    bench, spec, case_for = small
    case, _ = case_for("euler")
    title = "Apply TeaCache" if cache == "tea" else "Apply MagCache"
    with pytest.raises(ValueError) as error:
        bench.fresh(case, inputs.pop("speedup", 2.0), cache, **inputs)
    message = str(error.value)
    assert message.startswith(f"{title}: ") and named in message, message
    if "not used" in message:
        assert "Set speedup to 0" in message


def test_prompts_saved_before_the_speedup_compute_the_same_steps_and_give_the_same_latent(small):
    """Every prompt of ``saved_prompts.PROMPTS`` (no ``speedup``) as the release that saved them ran it: the same
    computed steps, and the same latent (bit for bit on the machine that made the file; within float32 rounding of
    other matrix kernels on another CPU)."""
    from omnitest.saved_prompts import PROMPTS, node_and_inputs

    bench, spec, case_for = small
    saved = json.loads(SAVED.read_text())["results"]
    assert [[r["cache"], r["sampler"], r["inputs"]] for r in saved] == [list(p) for p in PROMPTS]
    for (cache, sampler, inputs), then in zip(PROMPTS, saved):
        case, counter = case_for(sampler)
        node, full = node_and_inputs(cache, inputs)
        latent, computed = sample(bench, spec, case, counter, run_node(node, model=case.patcher, **full)[0], sampler)
        assert computed == then["computed"], (cache, sampler, inputs)
        before = torch.tensor(then["latent"]).reshape(then["shape"])
        assert torch.allclose(latent, before, rtol=1e-4, atol=1e-5), (cache, sampler, inputs,
                                                                       float((latent - before).abs().max()))
