"""The Sequence Parallel node's inputs: what it refuses, and how it says so (node title, the value, the fix): at the
node, before any worker process starts."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.host


@pytest.fixture(scope="module")
def env():
    from omnitest import tiny_models
    from omnitest.pack import pack_module, run_node

    node = pack_module("nodes.sequence_parallel.node")
    group = pack_module("nodes.sequence_parallel.group")

    class Env:
        tiny = tiny_models
        module = node

        @staticmethod
        def apply(model, **inputs):
            settings = dict(world_size=2, ulysses_degree="auto", ring_degree="auto", devices="auto", backend="auto",
                            master_address="127.0.0.1", master_port=0, cfg_parallel=False)
            settings.update(inputs)
            return run_node(node.SequenceParallel, node_id="30", model=model, **settings)[0]

    Env.group = group
    yield Env
    group.close_group()


def test_a_family_without_a_sequence_plan_is_refused_with_the_supported_ones(env):
    case = env.tiny.build_case("lumina2")
    with pytest.raises(ValueError) as error:
        env.apply(case.patcher)
    message = str(error.value)
    assert message.startswith("Sequence Parallel: Lumina") and "supported: " in message and "Wan" in message


@pytest.fixture
def no_worker(env, monkeypatch):
    """Fails the test if a worker process is started; the list of those that were asked for."""
    started = []

    def popen(*args, **kwargs):
        started.append(args)
        raise AssertionError("a worker process was started")

    env.group.close_group()
    monkeypatch.setattr(env.group.subprocess, "Popen", popen)
    yield started
    assert started == [] and env.group.active_group() is None


def _there() -> str:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ", ".join(["cpu"] + [f"cuda:{i}" for i in range(count)])


@pytest.mark.parametrize("inputs, expected", [
    (dict(devices="nonsense"), "devices entry 'nonsense' is not a device of this machine, which has: {there}"),
    (dict(devices="cpu,cuda:7"), "devices entry 'cuda:7' is not a device of this machine, which has: {there}"),
    (dict(world_size=3, devices="cpu,cpu,cpu", cfg_parallel=True), "cfg_parallel splits the ranks into two halves, "
     "so it needs an even world_size, got 3; set world_size to 4 or 2, or turn cfg_parallel off"),
    (dict(world_size=4, devices="cpu,cpu,cpu,cpu", ring_degree="8"), "ring_degree 8 does not divide world_size 4"),
    (dict(ulysses_degree="2", ring_degree="2"), "ulysses_degree 2 x ring_degree 2 must equal world_size 2; set one of "
     "them to 'auto'"),
    (dict(world_size=4, devices="cpu,cpu,cpu,cpu", ulysses_degree="4", cfg_parallel=True),
     "ulysses_degree 4 does not divide world_size / 2 (cfg_parallel) 2"),
    (dict(devices="cpu,cpu,cpu"), "lists 3 devices for world_size 2: give 1 to 2 devices"),
    (dict(devices="cpu"), "leaves 1 rank(s) to other machines, but master_address '127.0.0.1' is loopback"),
    (dict(devices="cpu", master_address="10.0.0.1"), "set master_port"),
    (dict(devices="cpu,cpu", backend="nccl"), "backend nccl needs a GPU for every rank"),
])
def test_inputs_the_machine_or_the_world_cannot_take_are_refused_at_the_node_before_any_worker_starts(
        env, no_worker, inputs, expected):
    import re
    import time

    case = env.tiny.build_case("wan21_t2v")
    started = time.monotonic()
    with pytest.raises(ValueError) as error:
        env.apply(case.patcher, **inputs)
    assert time.monotonic() - started < 1.0
    message = str(error.value)
    assert message.startswith("Sequence Parallel: ") and expected.format(there=_there()) in message, message
    assert re.search(r"set |give |raise |turn |lower |list ", message), message  # it says what to do


def test_a_head_count_ulysses_cannot_split_is_refused_at_the_node(env, no_worker):
    case = env.tiny.build_case("wan21_t2v", unet_overrides={"num_heads": 1})
    with pytest.raises(ValueError, match="the model has 1 attention heads, which ulysses_degree 2 does not divide; "
                                         "set ulysses_degree to a divisor or 'auto'"):
        env.apply(case.patcher, ulysses_degree="2")
    assert (env.tiny.sample(case, steps=2) == env.tiny.sample(case, steps=2)).all()


def test_a_transformer_option_that_cannot_be_sent_is_named(env):
    case = env.tiny.build_case("wan21_t2v")
    model = env.apply(case.patcher)
    model.model_options["transformer_options"]["another_pack"] = lambda: None
    with pytest.raises(ValueError) as error:
        env.tiny.sample(case, model=model, steps=2)
    message = str(error.value)
    assert message.startswith("Sequence Parallel (node #30): transformer option 'another_pack' (function)"), message
