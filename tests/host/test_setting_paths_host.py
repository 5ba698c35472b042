"""A setting's short path: from the node's input to the hook that uses it, one config object all the way (no copy
of the value beside it), and every node input's default is its config field's.

Each test follows one setting with a value no other part of the run has: the node's config holds it, the run's
``AppliedFeature``, the feature's session, the library's run and its statistics, and the hooks on the blocks all
reach that same object, and no attribute of theirs holds the value itself."""
from __future__ import annotations

import dataclasses
import numbers

import pytest
import torch

pytestmark = pytest.mark.host

STEPS = 4


@pytest.fixture(scope="module")
def wan():
    from omnitest import tiny_models
    from omnitest.cache_nodes import save_identity_calibrations

    save_identity_calibrations("path", STEPS)
    return tiny_models.build_case("wan21_t2v")


def holding(value, root, skip: tuple, depth: int = 4, where: str = "", named: str | None = None) -> list[str]:
    """Where, below ``root``, an attribute or item equals ``value`` (of its type; with ``named``, only an attribute
    whose name contains it), not looking into the objects of ``skip`` (identity), tensors, torch modules or more than
    ``depth`` levels down."""
    found: list[str] = []
    seen: set[int] = set()

    def walk(obj, path: str, level: int) -> None:
        if any(obj is s for s in skip) or id(obj) in seen or isinstance(obj, (torch.Tensor, torch.nn.Module)):
            return
        if isinstance(obj, numbers.Number) and not isinstance(obj, bool) and type(obj) is type(value) \
                and obj == value:
            if named is None or named in path.rsplit(".", 1)[-1]:
                found.append(path)
            return
        if level >= depth or isinstance(obj, (str, bytes, numbers.Number, type)) or callable(obj) \
                and not hasattr(obj, "__dict__"):
            return
        seen.add(id(obj))
        if isinstance(obj, dict):
            items = [(f"[{k!r}]", v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            items = [(f"[{i}]", v) for i, v in enumerate(obj)]
        else:
            items = [(f".{k}", v) for k, v in getattr(obj, "__dict__", {}).items()]
        for key, item in items:
            walk(item, path + key, level + 1)

    walk(root, where, 0)
    return found


def stops_of(monkeypatch, module, factory: str) -> list:
    """The runs ``module.<factory>`` makes during the test, each with the hooks on its blocks (read at install)."""
    from omnitest.pack import pack_module

    registry = pack_module("omni_hooks.base")
    made = []
    real = getattr(module, factory)

    def recording(*args, **kwargs):
        run = real(*args, **kwargs)
        hooks = [h for m in run.stack.blocks + [t for t, _ in run.stack.tails()]
                 for h in m.__dict__[registry.REGISTRY_ATTR]._hooks.values() if getattr(h, "run", None) is run]
        made.append((run, hooks))
        return run

    monkeypatch.setattr(module, factory, recording)
    return made


def sessions_of(monkeypatch, cache) -> list:
    """The sessions ``cache`` makes during the test."""
    made = []
    real = cache.session

    def recording(patcher, feature, detected):
        made.append(real(patcher, feature, detected))
        return made[-1]

    monkeypatch.setattr(cache, "session", recording)
    from omnitest.pack import pack_module

    features = pack_module("nodes.features")
    spec = features.feature_specs()[cache.kind]
    monkeypatch.setitem(features.feature_specs(), cache.kind, dataclasses.replace(spec, session_factory=recording))
    return made


# the inputs of the two Apply nodes besides the one a test follows (which it sets over these)
TEACACHE_INPUTS = dict(rel_l1_thresh=0.2, start_percent=0.0, end_percent=1.0, cache_device="compute device",
                       model_variant="calibration: path")
MAGCACHE_INPUTS = dict(threshold=0.3, max_skip_steps=2, retention_ratio=0.0, start_percent=0.0, end_percent=1.0,
                       cache_device="compute device", curve="calibration: path")
CACHE_SETTINGS = [
    # (cache module, node class, the input, the config field it sets, a value nothing else in the run has, the rest)
    ("teacache", "ApplyTeaCache", "rel_l1_thresh", "threshold", 0.4321, TEACACHE_INPUTS),
    ("magcache", "ApplyMagCache", "max_skip_steps", "max_skip_steps", 13, MAGCACHE_INPUTS),
    # the forward budget's plan and the skip correction read their cache's config too (a budget above the run's
    # steps: every step computes, and the plan, the steps and their counts hold no 11; a threshold that skips, so
    # that a computed step corrects)
    ("teacache", "ApplyTeaCache", "forward_budget", "forward_budget", 11, TEACACHE_INPUTS),
    ("magcache", "ApplyMagCache", "forward_budget", "forward_budget", 11, MAGCACHE_INPUTS),
    ("teacache", "ApplyTeaCache", "skip_correction", "skip_correction", 0.4375,
     {**TEACACHE_INPUTS, "rel_l1_thresh": 2.0}),
    ("magcache", "ApplyMagCache", "skip_correction", "skip_correction", 0.4375, MAGCACHE_INPUTS),
]


@pytest.mark.parametrize("kind, node_class, input_name, field, value, rest", CACHE_SETTINGS,
                         ids=[f"{c[0]}-{c[2]}" for c in CACHE_SETTINGS])
def test_a_cache_setting_reaches_its_hook_in_one_config(monkeypatch, wan, kind, node_class, input_name, field, value,
                                                        rest):
    from omnitest import tiny_models
    from omnitest.pack import pack_module, run_node

    module = pack_module(f"nodes.caches.{kind}")
    cache = getattr(module, kind.upper())
    sessions = sessions_of(monkeypatch, cache)
    runs = stops_of(monkeypatch, module, "apply_teacache_hook" if kind == "teacache" else "apply_mag_cache_hook")
    patched = run_node(getattr(module, node_class), model=wan.patcher, **{**rest, input_name: value})[0]
    (feature,) = pack_module("nodes.features").applied_features(patched)
    config = feature.config
    assert getattr(config, field) == value
    tiny_models.sample(wan, model=patched, steps=STEPS)
    assert sessions and runs
    for session in sessions:
        assert session.feature.config is config and session.config is config and session.stats.config is config
    for run, hooks in runs:
        assert run.config is config and run.stats is sessions[0].stats
        assert hooks and all(hook.run is run for hook in hooks)
    stops = {"feature": feature, "session": sessions[0], "run": runs[0][0], "hooks": runs[0][1]}
    copies = [path for name, stop in stops.items()
              for path in holding(value, stop, skip=(config, sessions[0].stats.evaluations, wan.patcher, patched),
                                  depth=6, where=name)]
    assert not copies, f"{input_name}={value} is held beside the config at {copies}"


def test_cpu_offloads_prefetch_blocks_reaches_its_hook_in_one_config(monkeypatch):
    """On the real path, its target forced onto the CPU: the node's config is the one the library's run, its
    statistics and its hooks read (a block count being a small number too, only an attribute named like the
    setting counts as a copy)."""
    from omnitest import tiny_models
    from omnitest.pack import pack_module, run_node

    node, session_module = pack_module("nodes.offload.node"), pack_module("nodes.offload.session")
    registry = pack_module("omni_hooks.base")
    monkeypatch.setattr(pack_module("nodes.offload.host"), "offload_target", lambda patcher: torch.device("cpu"))
    runs, sessions = [], []
    real_run, real_session = session_module.LayerwiseOffloadRun, session_module.OffloadSession.__init__

    def recording_run(*args, **kwargs):
        runs.append(real_run(*args, **kwargs))
        return runs[-1]

    def recording_session(session, *args, **kwargs):
        real_session(session, *args, **kwargs)
        sessions.append(session)

    hooks = []
    real_apply = real_run.apply

    def applying(run):
        applied = real_apply(run)
        hooks.extend(h for b in run.blocks for h in b.__dict__[registry.REGISTRY_ATTR]._hooks.values()
                     if getattr(h, "run", None) is run)
        return applied

    monkeypatch.setattr(session_module, "LayerwiseOffloadRun", recording_run)
    monkeypatch.setattr(real_run, "apply", applying)
    monkeypatch.setattr(session_module.OffloadSession, "__init__", recording_session)
    wan = tiny_models.build_case("wan21_t2v", unet_overrides={"num_layers": 6})
    patched = run_node(node.CPUOffload, model=wan.patcher, blocks_to_offload=4, prefetch_blocks=3, pin_memory="auto",
                       vram_budget_gb=0.0)[0]
    (feature,) = pack_module("nodes.features").applied_features(patched)
    config = feature.config
    assert config.prefetch_blocks == 3
    tiny_models.sample(wan, model=patched, steps=STEPS)
    assert sessions and runs
    (session,) = sessions
    (run,) = runs
    assert session.config is config and run.config is config and run.stats.config is config
    assert len(hooks) == 4 and all(hook.run is run for hook in hooks)
    stops = {"feature": feature, "session": session, "run": run, "hooks": hooks}
    copies = [path for name, stop in stops.items()
              for path in holding(3, stop, skip=(config, wan.patcher, patched), where=name, named="prefetch")]
    assert not copies, f"prefetch_blocks=3 is held beside the config at {copies}"
    assert run.stats.summary()["prefetch_blocks"] == 3


def node_defaults(node_class) -> dict:
    """Each input of a V3 node's schema: its declared default, or for an input a workflow saved without it sets to
    another value (the caches' speed-up: ``inputs.SAVED_WITHOUT``), that value."""
    from omnitest.pack import pack_module

    saved_without = pack_module("nodes.caches.inputs").SAVED_WITHOUT
    schema = node_class.define_schema()
    return {i.id: i.extra_dict.get(saved_without, i.default) for i in schema.inputs
            if getattr(i, "default", None) is not None}


def field_default(config_cls, name: str):
    (found,) = [f for f in dataclasses.fields(config_cls) if f.name == name]
    assert found.default is not dataclasses.MISSING, f"{config_cls.__name__}.{name} has no default"
    return found.default


def every_node_and_its_config_inputs():
    """Each node of the pack whose inputs set config fields, and its ``ConfigInputs`` (the one mapping)."""
    from omnitest.pack import pack_module

    for kind, node_class in (("teacache", "ApplyTeaCache"), ("magcache", "ApplyMagCache")):
        module = pack_module(f"nodes.caches.{kind}")
        cache = getattr(module, kind.upper())
        yield getattr(module, node_class), cache.config_inputs, {cache.variant_input}
    offload = pack_module("nodes.offload.node")
    yield offload.CPUOffload, offload.CONFIG_INPUTS, set()
    sp = pack_module("nodes.sequence_parallel.node")  # its group settings: the inputs the degrees do not decide
    yield sp.SequenceParallel, sp.GROUP_INPUTS, {"world_size", "ulysses_degree", "ring_degree", "devices", "backend",
                                                 "cfg_parallel"}


def test_every_nodes_inputs_default_to_their_config_fields_default_through_one_mapping(wan):
    """Each input's widget default is its config field's default, in the node's form, and back: the default is
    written once, in the config (``ConfigInputs``), for the caches, CPU Offload and Sequence Parallel alike. The one
    input a fresh node sets to more than its config's default (the speed-up) has the config's default as the value a
    workflow saved without it keeps."""
    checked = 0
    for node_class, config_inputs, not_fields in every_node_and_its_config_inputs():
        for name, default in node_defaults(node_class).items():
            if name in not_fields:
                continue
            spec = config_inputs.input(name)
            expected = field_default(config_inputs.config_cls, spec.field)
            assert spec.to_config(default, wan.patcher) == expected, (node_class.__name__, name, default)
            assert config_inputs.default(name) == default, (node_class.__name__, name)
            checked += 1
    assert checked >= 20, checked  # 9 inputs per cache, 3 of CPU Offload, 2 of Sequence Parallel


def test_a_config_error_reaches_the_user_in_the_nodes_words(wan):
    """The config checks a value once; the node's error names the node, its input and the value the user gave, and
    the node's form of 'auto' (-1 blocks, 0 GiB) where the config says None."""
    from omnitest.pack import pack_module

    node = pack_module("nodes.offload.node")
    inputs = dict(blocks_to_offload=-2, prefetch_blocks=1, pin_memory="auto", vram_budget_gb=0.0)
    with pytest.raises(ValueError, match=r"^CPU Offload: blocks_to_offload must be an integer >= 0 or -1 \(auto\), "
                                         r"got -2$"):
        node.config_for(wan.patcher, **inputs)
    with pytest.raises(ValueError, match=r"^CPU Offload: vram_budget_gb must be a finite number >= 0 or 0.0 "
                                         r"\(auto\), got -1.5$"):
        node.config_for(wan.patcher, **{**inputs, "blocks_to_offload": -1, "vram_budget_gb": -1.5})
    from omnitest.pack import run_node

    tea = pack_module("nodes.caches.teacache")
    applied = dict(model=wan.patcher, rel_l1_thresh=0.1, start_percent=0.0, end_percent=1.0,
                   cache_device="compute device", model_variant="wan2.1_t2v_1.3B")
    with pytest.raises(ValueError, match=r"^Apply TeaCache: unknown forecast 'third'"):
        run_node(tea.ApplyTeaCache, **applied, forecast="third")
    with pytest.raises(ValueError, match=r"^Apply TeaCache: forward_budget must be a whole number"):
        run_node(tea.ApplyTeaCache, **applied, forward_budget=-3)


