"""Publishing statistics never breaks a run: a failing server send is logged once and sampling goes on."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.host


def test_failing_publisher_does_not_break_sampling(monkeypatch, caplog):
    from omnitest import tiny_models
    from omnitest.pack import pack_module, run_node

    store = pack_module("nodes.stats_store")
    node = pack_module("nodes.caches.teacache").ApplyTeaCache

    class BrokenServer:
        client_id = "someone"
        calls = 0

        def send_sync(self, *args, **kwargs):
            BrokenServer.calls += 1
            raise ConnectionResetError("client went away")

    monkeypatch.setattr(store, "_server", lambda: BrokenServer())
    monkeypatch.setattr(store, "_send_failed", False)
    case = tiny_models.build_case("wan21_t2v")
    baseline = tiny_models.sample(case, steps=6)
    patched = run_node(node, model=case.patcher, rel_l1_thresh=0.0, start_percent=0.0, end_percent=1.0,
                       cache_device="compute device", model_variant="wan2.1_t2v_1.3B")[0]
    with caplog.at_level("WARNING", logger="OmniHooks"):
        out = tiny_models.sample(case, model=patched, steps=6)
    assert torch.equal(out, baseline)
    assert BrokenServer.calls == 6 + 1  # every step event and the run event were attempted
    assert sum("could not publish" in r.message for r in caplog.records) == 1
    assert store.recent_runs(1)[0]["summary"]["evaluations"] == 6
