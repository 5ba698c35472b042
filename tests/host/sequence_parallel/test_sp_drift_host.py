"""Drift checked before a run on 2 ranks (rank 0 in this process, one local worker over gloo on CPU): a block that
gained an argument, or a sequence plan input whose type changed, stops the run on rank 0 with an error naming the
node, before the group is asked for anything (no weights sent, no call, no rank waiting); the group then runs the next
run as before. Every test runs under a deadline that fails it and kills the children."""
from __future__ import annotations

import pytest

from omnitest.cache_nodes import apply_teacache, save_identity_calibrations
from omnitest.processes import Snapshot, assert_nothing_left, deadline
from omnitest.quality import psnr_db

pytestmark = pytest.mark.host

STEPS = 6
MIN_PSNR_DB = 60.0
TEST_DEADLINE_S = 240.0  # a worker's start (importing ComfyUI) takes tens of seconds on a busy 2-core machine
IDENTITY = "sp-drift-identity"


@pytest.fixture(scope="module")
def env(user_dir):
    from omnitest import tiny_models
    from omnitest.pack import pack_module, run_node

    save_identity_calibrations(IDENTITY, STEPS)
    node = pack_module("nodes.sequence_parallel.node")
    group = pack_module("nodes.sequence_parallel.group")
    before = Snapshot.now()

    class Env:
        tiny = tiny_models
        drift = pack_module("nodes.families.drift")
        group_module = group

        @staticmethod
        def sequence_parallel(model):
            return run_node(node.SequenceParallel, node_id="30", model=model, world_size=2, ulysses_degree="auto",
                            ring_degree="auto", devices="cpu,cpu", backend="gloo", master_address="127.0.0.1",
                            master_port=0, cfg_parallel=False)[0]

    yield Env
    group.close_group()
    assert_nothing_left(before)


@pytest.fixture(scope="module")
def wan(env):
    case = env.tiny.build_case("wan21_t2v")
    return case, env.tiny.sample(case, steps=STEPS)


@pytest.fixture
def exchanges(env, monkeypatch):
    """Everything rank 0 asks of the group during the test: joining it, sending weights, commands."""
    seen = []
    group = env.group_module
    for owner, name in ((group, "current_group"), (group.SequenceParallelGroup, "command"),
                        (group.SequenceParallelGroup, "sync_weights")):
        original = getattr(owner, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            seen.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, spy)
    return seen


def run_parallel_and_check(env, case, alone, what: str) -> None:
    """A run of Sequence Parallel that must work (the group answers; no rank is stuck in an earlier run)."""
    with deadline(TEST_DEADLINE_S, what):
        got = env.tiny.sample(case, model=env.sequence_parallel(case.patcher), steps=STEPS)
    assert psnr_db(got, alone) >= MIN_PSNR_DB


def test_a_block_that_gained_an_argument_stops_the_run_before_any_rank_exchanges_anything(env, wan, exchanges,
                                                                                          monkeypatch):
    from omnitest.drift_models import gain_required_argument

    case, alone = wan
    run_parallel_and_check(env, case, alone, "a first parallel run")  # the group exists: a later run would reuse it
    exchanges.clear()
    gain_required_argument(monkeypatch)
    model = apply_teacache(env.sequence_parallel(case.patcher), IDENTITY)
    with deadline(TEST_DEADLINE_S, "the drifted run"), pytest.raises(env.drift.ModelDriftError) as raised:
        env.tiny.sample(case, model=model, steps=STEPS)
    message = str(raised.value)
    assert message.startswith("Sequence Parallel (node #30), Apply TeaCache (node #21): ")
    assert "gained a required parameter 'gate'" in message and "Wan 2.1/2.2" in message
    assert exchanges == []
    monkeypatch.undo()
    run_parallel_and_check(env, case, alone, "the run after the drifted one")


def test_a_plan_input_whose_type_changed_stops_the_run_naming_the_sequence_parallel_node(env, wan, exchanges,
                                                                                         monkeypatch):
    from omnitest.drift_models import rope_table_as_pair

    case, alone = wan
    rope_table_as_pair(monkeypatch)
    model = env.sequence_parallel(apply_teacache(case.patcher, IDENTITY))
    with deadline(TEST_DEADLINE_S, "the drifted run"), pytest.raises(env.drift.ModelDriftError) as raised:
        env.tiny.sample(case, model=model, steps=STEPS)
    message = str(raised.value)
    assert message.startswith("Sequence Parallel (node #30): ")  # the cache does not rely on the plan
    assert "'freqs' at 'blocks.*' is a tuple of 2, the plan has one spec for a tensor" in message
    assert exchanges == []
    monkeypatch.undo()
    run_parallel_and_check(env, case, alone, "the run after the drifted one")
