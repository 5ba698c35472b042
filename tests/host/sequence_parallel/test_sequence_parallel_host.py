"""The Sequence Parallel session end to end in one ComfyUI process (rank 0) with one local worker process (rank 1,
gloo on CPU): ComfyUI's tiny Wan sampled through ComfyUI's KSampler equals the single-process run; a killed worker
between runs is replaced by a fresh group on the next run."""
from __future__ import annotations

import os
import signal

import pytest

from omnitest.quality import psnr_db

pytestmark = pytest.mark.host

MIN_PSNR_DB = 60.0


@pytest.fixture(scope="module")
def sp():
    from omnitest.pack import pack_module

    node = pack_module("nodes.sequence_parallel.node")
    group = pack_module("nodes.sequence_parallel.group")
    yield node, group
    group.close_group()


def _with_sp(node, case, world_size=2):
    from omnitest.pack import pack_module

    group = pack_module("nodes.sequence_parallel.group").GroupSettings(world_size, "gloo", ("cpu",) * world_size)
    config = node.config_for(case.patcher, group, ulysses_degree=None, ring_degree=None)

    features = pack_module("nodes.features")
    feature = features.AppliedFeature(node.KIND, features.Category.SEQUENCE_PARALLEL, node.NODE_TITLE, "1", config)
    return features.attach_feature(case.patcher, feature)


@pytest.mark.parametrize("heads", [2, 1])  # 2: Ulysses, 1: ring
def test_two_ranks_equal_one_process_and_leave_the_input_model_alone(sp, heads):
    from omnitest.tiny_models import build_case, sample
    node, group = sp
    case = build_case("wan21_t2v", unet_overrides={"num_heads": heads})
    reference = sample(case)
    got = sample(case, _with_sp(node, case))
    assert psnr_db(got, reference) >= MIN_PSNR_DB
    assert (sample(case) == reference).all()  # the input MODEL untouched
    assert group._current is not None and group._current.alive()


def test_a_worker_killed_between_runs_is_replaced_by_the_next_run(sp):
    from omnitest.tiny_models import build_case, sample

    node, group = sp
    case = build_case("wan21_t2v")
    reference = sample(case)
    sample(case, _with_sp(node, case))
    first = group._current
    worker = first.processes[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(timeout=10)
    assert psnr_db(sample(case, _with_sp(node, case)), reference) >= MIN_PSNR_DB
    assert group._current is not first and group._current.alive()


def test_tensors_too_large_for_a_command_are_broadcast_and_the_result_is_the_same(sp, monkeypatch):
    """A real call's latent is megabytes: rank 0 broadcasts it over the process group after the workers accepted the
    call. Forced here for every tensor of the tiny model's calls."""
    from omnitest.pack import pack_module
    from omnitest.tiny_models import build_case, sample

    node, group = sp
    protocol = pack_module("nodes.sequence_parallel.protocol")
    case = build_case("wan21_t2v")
    reference = sample(case)
    sent = []
    encode = protocol.encode

    def counting(command):
        data, broadcast = encode(command)
        sent.append(len(broadcast))
        return data, broadcast

    monkeypatch.setattr(protocol, "BROADCAST_BYTES", 0)
    monkeypatch.setattr(group, "encode", counting)
    assert psnr_db(sample(case, _with_sp(node, case)), reference) >= MIN_PSNR_DB
    assert max(sent) >= 3  # each call's latent, timestep and context went by broadcast
