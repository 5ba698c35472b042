"""The run lifecycle of every feature on a real ComfyUI: a toy feature that acts at model load and
per run, in a defined order with a cache, undone on success, error and interrupt; compatibility refusals name both
nodes; a session factory that raises leaves the guider as it was; the input MODEL stays bit-identical."""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.host

TOY = "toy-load-marker"
MARKER = "_omni_toy_loaded"


@pytest.fixture(scope="module")
def env(user_dir):
    from omnitest import tiny_models
    from omnitest.pack import pack_module, run_node

    features = pack_module("nodes.features")
    files = pack_module("nodes.caches.calibration_files")
    files.save("teacache", "features-identity", {"coefficients": [0, 0, 0, 1, 0], "family": "wan"})
    teacache = pack_module("nodes.caches.teacache").ApplyTeaCache
    omni = pack_module("omni_hooks")

    @dataclasses.dataclass(frozen=True)
    class ToySettings:
        fail_at_call: int | None = None      # raise inside the model call with this index
        interrupt_at_call: int | None = None
        fail_in_factory: bool = False

    class ToySession(features.FeatureSession):
        """Marks the diffusion model at load, counts calls through a placement hook on every block."""

        log: list[str] = []
        instances: list["ToySession"] = []

        def __init__(self, patcher, feature, detected):
            if feature.config.fail_in_factory:
                raise RuntimeError("toy factory failed")
            super().__init__(patcher, feature, detected)
            self.calls = 0
            self.block_runs = 0
            self.blocks: list[torch.nn.Module] = []
            ToySession.instances.append(self)

        def after_load(self, patcher):
            setattr(patcher.model.diffusion_model, MARKER, True)
            ToySession.log.append("load")

        def install(self, dm):
            session = self

            class CountBlock(omni.ModelHook):
                phase = omni.HookPhase.PLACEMENT

                def pre_forward(self, module, *args, **kwargs):
                    session.block_runs += 1
                    return args, kwargs

            self.blocks = list(dm.blocks)
            for block in self.blocks:
                omni.HookRegistry.get_or_create(block).register_hook("toy_count", CountBlock())
            ToySession.log.append("install")

        def remove(self):
            for block in self.blocks:
                registry = omni.HookRegistry.get_or_create(block)
                registry.remove_hook("toy_count")
                if not omni.module_has_active_hooks(block):
                    registry.reset()
            self.blocks = []

        def begin_call(self, context):
            ToySession.log.append("begin toy")
            settings = self.feature.config
            if settings.fail_at_call == self.calls:
                raise RuntimeError("toy failure inside the run")
            if settings.interrupt_at_call == self.calls:
                import comfy.model_management
                raise comfy.model_management.InterruptProcessingException()
            self.calls += 1

        def end_call(self, context):
            ToySession.log.append(f"end toy blocks_run={context.blocks_run}")

        def summary(self):
            return {"calls": self.calls, "block_runs": self.block_runs}

        def close(self, status):
            super().close(status)
            dm = self.patcher.model.diffusion_model
            if hasattr(dm, MARKER):
                delattr(dm, MARKER)
            ToySession.log.append(f"close {status}")

    class Env:
        tiny = tiny_models
        case = tiny_models.build_case("wan21_t2v")
        module = features
        store = pack_module("nodes.stats_store")
        Session = ToySession
        Settings = ToySettings

        @staticmethod
        def toy(model, node_id="t1", **settings):
            feature = features.AppliedFeature(kind=TOY, category=features.Category.OFFLOAD, node_title="Toy Feature",
                                              node_id=node_id, config=ToySettings(**settings))
            return features.attach_feature(model, feature)

        @staticmethod
        def teacache(model, threshold=0.0):
            return run_node(teacache, model=model, rel_l1_thresh=threshold, start_percent=0.0, end_percent=1.0,
                            cache_device="compute device", model_variant="calibration: features-identity")[0]

    ToySession.log.clear()
    ToySession.instances.clear()
    with pytest.MonkeyPatch.context() as patch:  # the pack's feature list, with the toy for this module's tests
        patch.setitem(features.feature_specs(), TOY, features.FeatureSpec(kind=TOY, category=features.Category.OFFLOAD,
                                                                          session_factory=ToySession))
        yield Env


def module_state(dm: torch.nn.Module):
    return {name: (sorted(m.__dict__), type(m).forward) for name, m in dm.named_modules()}


@pytest.fixture
def baseline(env):
    out = env.tiny.sample(env.case, steps=4, cfg=3.0)
    env.Session.log.clear()
    env.Session.instances.clear()
    return out, module_state(env.case.diffusion_model)


def test_a_toy_feature_acts_at_load_and_per_call_and_is_undone(env, baseline):
    out_before, state_before = baseline
    out = env.tiny.sample(env.case, model=env.toy(env.case.patcher), steps=4, cfg=3.0)
    assert torch.equal(out, out_before)
    log = env.Session.log
    assert log[0] == "load" and log[1] == "install" and log[-1] == "close success"
    assert log.count("begin toy") == 4
    (session,) = env.Session.instances
    assert session.calls == 4 and session.block_runs == 4 * len(env.case.diffusion_model.blocks)
    assert module_state(env.case.diffusion_model) == state_before
    assert torch.equal(env.tiny.sample(env.case, steps=4, cfg=3.0), out_before)


@pytest.mark.parametrize("failure", ["error", "interrupt"])
def test_errors_and_interrupts_undo_load_time_and_run_actions(env, baseline, failure):
    import comfy.model_management

    out_before, state_before = baseline
    kwargs = {"fail_at_call": 2} if failure == "error" else {"interrupt_at_call": 2}
    expected = RuntimeError if failure == "error" else comfy.model_management.InterruptProcessingException
    patched = env.toy(env.case.patcher, **kwargs)
    with pytest.raises(expected):
        env.tiny.sample(env.case, model=patched, steps=4, cfg=3.0)
    assert env.Session.log[-1] == ("close error" if failure == "error" else "close interrupted")
    entry = env.store.recent_runs(1)[0]  # the failed run has its entry too
    assert (entry["kind"], entry["status"]) == (TOY, "error" if failure == "error" else "interrupted")
    assert entry["features"][0]["summary"]["calls"] == 2
    assert module_state(env.case.diffusion_model) == state_before
    assert not hasattr(env.case.diffusion_model, MARKER)
    assert torch.equal(env.tiny.sample(env.case, steps=4, cfg=3.0), out_before)


def test_sessions_run_in_the_defined_order_whatever_the_node_order(env, baseline):
    """A cache applied first and the toy (offload category) after: the toy's session still begins first, ends last;
    and its placement hook runs only on the calls the cache computes."""
    out_before, state_before = baseline
    both = env.toy(env.teacache(env.case.patcher, threshold=1e9))
    env.tiny.sample(env.case, model=both, steps=6, cfg=3.0)
    log = env.Session.log
    ends = [entry for entry in log if entry.startswith("end toy")]
    (session,) = env.Session.instances
    computed = sum(1 for e in ends if e.endswith("True"))
    assert 0 < computed < len(ends) == 6  # first and last computed, the rest reused
    assert session.block_runs == computed * len(env.case.diffusion_model.blocks)
    assert module_state(env.case.diffusion_model) == state_before


def test_every_run_publishes_one_entry_made_of_its_features_reports(env, baseline):
    """A run without a cache is the entry of its feature (its node, its card); with a cache, the entry is the cache's
    (its node, numbers and steps) with the other feature's card beside them."""
    env.tiny.sample(env.case, model=env.toy(env.case.patcher), steps=4, cfg=3.0)
    (session,) = env.Session.instances
    entry = env.store.recent_runs(1)[0]
    assert {k: entry[k] for k in ("kind", "node_id", "node_title", "status", "summary", "threshold", "evaluations")} \
        == {"kind": TOY, "node_id": "t1", "node_title": "Toy Feature", "status": "success", "summary": None,
            "threshold": None, "evaluations": []}
    assert entry["features"] == [{"kind": TOY, "node_id": "t1", "node_title": "Toy Feature",
                                  "summary": {"calls": 4, "block_runs": session.block_runs}}]
    env.tiny.sample(env.case, model=env.toy(env.teacache(env.case.patcher, threshold=1e9), node_id="t2"), steps=6,
                    cfg=3.0)
    entry = env.store.recent_runs(1)[0]
    assert (entry["kind"], entry["node_title"], entry["summary"]["evaluations"]) == ("teacache", "Apply TeaCache", 6)
    assert len(entry["evaluations"]) == 6 and entry["threshold"] == 1e9
    assert [(f["kind"], f["node_id"], f["summary"]["calls"]) for f in entry["features"]] == [(TOY, "t2", 6)]


def test_one_pair_of_wrappers_drives_every_feature(env):
    import comfy.patcher_extension as pe

    both = env.teacache(env.toy(env.case.patcher))
    for kind in (pe.WrappersMP.OUTER_SAMPLE, pe.WrappersMP.PREPARE_SAMPLING, pe.WrappersMP.DIFFUSION_MODEL):
        assert len(both.get_wrappers(kind, env.module.WRAPPER_KEY)) == 1
    assert [f.kind for f in env.module.applied_features(both)] == ["toy-load-marker", "teacache"]
    assert env.module.applied_features(env.case.patcher) == ()


def test_refused_pairs_name_both_nodes(env):
    toy = env.toy(env.case.patcher, node_id="3")
    with pytest.raises(env.module.FeatureConflictError, match=r"Toy Feature \(node #4\).*Toy Feature \(node #3\)"):
        env.toy(toy, node_id="4")
    cached = env.teacache(env.case.patcher)
    with pytest.raises(env.module.FeatureConflictError, match="Apply TeaCache.*Only one cache"):
        env.teacache(cached)


def test_a_session_factory_that_raises_leaves_the_guider_and_model_as_they_were(env, baseline):
    out_before, state_before = baseline
    patched = env.teacache(env.toy(env.case.patcher, fail_in_factory=True))
    seen = {}

    import comfy.patcher_extension as pe

    def spy(executor, *args, **kwargs):  # outermost: sees the guider's options before and after our wrapper
        guider = executor.class_obj
        seen["before"] = guider.model_options
        try:
            return executor(*args, **kwargs)
        finally:
            seen["after"] = guider.model_options

    spied = patched.clone()
    spied.wrappers[pe.WrappersMP.OUTER_SAMPLE] = {"test.spy": [spy], **spied.wrappers[pe.WrappersMP.OUTER_SAMPLE]}
    with pytest.raises(RuntimeError, match="toy factory failed"):
        env.tiny.sample(env.case, model=spied, steps=4, cfg=3.0)
    assert seen["after"] is seen["before"]
    assert env.module.RUN_KEY not in seen["after"]["transformer_options"]
    assert module_state(env.case.diffusion_model) == state_before
    assert torch.equal(env.tiny.sample(env.case, steps=4, cfg=3.0), out_before)
