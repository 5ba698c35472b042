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
