"""One config from the node to the hook: the object a node builds (and leaves on its MODEL clone, in its
``AppliedFeature``) is the very object the feature's hooks read during the run, not a copy or a rebuilt one."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.host

STEPS = 4


def applied_config(model):
    from omnitest.pack import pack_module

    (feature,) = pack_module("nodes.features").applied_features(model)
    return feature.config


@pytest.fixture(scope="module")
def wan():
    from omnitest import tiny_models
    from omnitest.cache_nodes import save_identity_calibrations

    save_identity_calibrations("carrier", STEPS)
    return tiny_models.build_case("wan21_t2v")


def spy(monkeypatch, module, name: str) -> list:
    """Every object ``module.name`` (a hook factory) returns while the test runs."""
    made = []
    real = getattr(module, name)

    def recording(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(module, name, recording)
    return made


@pytest.mark.parametrize("kind", ["teacache", "magcache"])
def test_the_cache_hook_reads_the_nodes_config(monkeypatch, wan, kind):
    from omnitest import tiny_models
    from omnitest.cache_nodes import apply_magcache, apply_teacache
    from omnitest.pack import pack_module

    module = pack_module(f"nodes.caches.{kind}")
    runs = spy(monkeypatch, module, "apply_teacache_hook" if kind == "teacache" else "apply_mag_cache_hook")
    patched = (apply_teacache if kind == "teacache" else apply_magcache)(wan.patcher, "carrier")
    config = applied_config(patched)
    tiny_models.sample(wan, model=patched, steps=STEPS)
    assert runs and all(run.config is config for run in runs)


def test_the_offload_run_reads_the_nodes_config(monkeypatch, wan):
    import torch
    from omnitest import tiny_models
    from omnitest.pack import pack_module, run_node

    node, session = pack_module("nodes.offload.node"), pack_module("nodes.offload.session")
    # the real path, on the CPU
    monkeypatch.setattr(pack_module("nodes.offload.host"), "offload_target", lambda patcher: torch.device("cpu"))
    runs = spy(monkeypatch, session, "LayerwiseOffloadRun")
    patched = run_node(node.CPUOffload, model=wan.patcher, blocks_to_offload=1, prefetch_blocks=1, pin_memory="auto",
                       vram_budget_gb=0.0)[0]
    config = applied_config(patched)
    tiny_models.sample(wan, model=patched, steps=STEPS)
    assert runs and all(run.config is config for run in runs)


def test_the_sequence_parallel_run_reads_the_nodes_config(monkeypatch, wan):
    """Rank 0's side (one local worker, gloo on the CPU): the worker rebuilds the config from the command's plain
    data in its own process, so only rank 0 can hold the node's very object."""
    from omnitest import tiny_models
    from omnitest.pack import pack_module, run_node

    node = pack_module("nodes.sequence_parallel.node")
    group = pack_module("nodes.sequence_parallel.group")
    runs = spy(monkeypatch, pack_module("nodes.sequence_parallel.shard"), "apply_sequence_parallel")
    patched = run_node(node.SequenceParallel, node_id="30", model=wan.patcher, world_size=2, ulysses_degree="auto",
                       ring_degree="auto", devices="auto", backend="auto", master_address="127.0.0.1", master_port=0,
                       cfg_parallel=False)[0]
    config = applied_config(patched)
    try:
        tiny_models.sample(wan, model=patched, steps=2)
    finally:
        group.close_group()
    assert runs and all(run.config is config for run in runs)
