"""The one list of feature kinds (``nodes.features.FEATURE_MODULES``): every module that defines a feature's
``FEATURE`` is in it, every node of the pack that attaches a feature to a MODEL attaches a kind of it (with the
category its spec says), and an unknown kind is refused. Rank 0's lifecycle and every sequence-parallel worker open
their sessions from it (``SamplingRun.open``); the workers' side runs in ``tests/host/sequence_parallel/``."""
from __future__ import annotations

import asyncio
import re

import pytest

pytestmark = pytest.mark.host

# what each node of the extension that returns a MODEL is given besides ``model`` (a node missing here fails)
NODE_INPUTS = {
    "OmniHooks.ApplyTeaCache": dict(rel_l1_thresh=0.2, start_percent=0.0, end_percent=1.0,
                                    cache_device="compute device", model_variant="calibration: feature-list"),
    "OmniHooks.ApplyMagCache": dict(threshold=0.3, max_skip_steps=2, retention_ratio=0.0, start_percent=0.0,
                                    end_percent=1.0, cache_device="compute device", curve="calibration: feature-list"),
    "OmniHooks.CPUOffload": dict(blocks_to_offload=1, prefetch_blocks=1, pin_memory="auto", vram_budget_gb=0.0),
    "OmniHooks.SequenceParallel": dict(world_size=2, ulysses_degree="auto", ring_degree="auto", devices="auto",
                                       backend="auto", master_address="127.0.0.1", master_port=0, cfg_parallel=False),
}


@pytest.fixture(scope="module")
def features():
    from omnitest.pack import pack_module

    return pack_module("nodes.features")


def test_every_module_defining_a_feature_is_in_the_list_once(features):
    from omnitest.comfy_path import PACK_ROOT

    nodes = PACK_ROOT / "nodes"
    defining = sorted("." + p.relative_to(nodes).with_suffix("").as_posix().replace("/", ".")
                      for p in nodes.rglob("*.py") if re.search(r"^FEATURE = ", p.read_text(), re.M))
    assert sorted(features.FEATURE_MODULES) == defining
    specs = features.feature_specs()
    assert len(specs) == len(features.FEATURE_MODULES)
    assert all(kind == spec.kind for kind, spec in specs.items())


def test_every_node_that_attaches_a_feature_attaches_a_kind_of_the_list(features, user_dir):
    from omnitest import tiny_models
    from omnitest.cache_nodes import save_identity_calibrations
    from omnitest.pack import pack_module, run_node

    save_identity_calibrations("feature-list", 4)
    wan = tiny_models.build_case("wan21_t2v")
    node_list = asyncio.run(pack_module("nodes.extension").OmniHooksExtension().get_node_list())
    attaching = [n for n in node_list if [o.get_io_type() for o in n.define_schema().outputs] == ["MODEL"]]
    assert sorted(n.define_schema().node_id for n in attaching) == sorted(NODE_INPUTS)
    attached = {}
    for node in attaching:
        patched = run_node(node, model=wan.patcher, **NODE_INPUTS[node.define_schema().node_id])[0]
        (feature,) = features.applied_features(patched)
        assert features.feature_specs()[feature.kind].category == feature.category
        attached[feature.kind] = node
    assert set(attached) == set(features.feature_specs())


def test_an_unknown_kind_is_refused_naming_the_list(features):
    from omnitest import tiny_models

    feature = features.AppliedFeature(kind="no-such-kind", category=features.Category.CACHE, node_title="Nothing",
                                      node_id="1", config=None)
    with pytest.raises(ValueError, match=r"unknown feature kind 'no-such-kind'; list the module defining its FEATURE "
                                         r"in FEATURE_MODULES"):
        features.attach_feature(tiny_models.build_case("wan21_t2v").patcher, feature)
