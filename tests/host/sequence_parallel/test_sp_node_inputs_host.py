"""The Sequence Parallel node's inputs: what it refuses, and how it says so (node title, the value, the fix)."""
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
                            master_address="127.0.0.1", master_port=0)
            settings.update(inputs)
            return run_node(node.SequenceParallel, node_id="30", model=model, **settings)[0]

    yield Env
    group.close_group()


def test_a_family_without_a_sequence_plan_is_refused_with_the_supported_ones(env):
    case = env.tiny.build_case("lumina2")
    with pytest.raises(ValueError) as error:
        env.apply(case.patcher)
    message = str(error.value)
    assert message.startswith("Sequence Parallel: Lumina") and "supported: " in message and "Wan" in message


@pytest.mark.parametrize("inputs, expected", [
    (dict(devices="cpu,cpu,cpu"), "give 1 to 2 devices"),
    (dict(devices="cpu"), "set master_port"),
])
def test_devices_and_remote_ranks_are_checked_at_the_node(env, inputs, expected):
    case = env.tiny.build_case("wan21_t2v")
    with pytest.raises(ValueError, match=expected):
        env.apply(case.patcher, **inputs)


@pytest.mark.parametrize("inputs, expected", [
    (dict(ulysses_degree="2"), "ulysses_degree 2 does not divide"),
    (dict(ulysses_degree="2", ring_degree="2"), "ulysses_degree 2 x ring_degree 2 must equal world_size 2"),
])
def test_degrees_the_model_cannot_take_are_an_error_at_the_run(env, inputs, expected):
    case = env.tiny.build_case("wan21_t2v", unet_overrides={"num_heads": 1})
    model = env.apply(case.patcher, **inputs)
    with pytest.raises(ValueError, match=expected):
        env.tiny.sample(case, model=model, steps=2)
    assert (env.tiny.sample(case, steps=2) == env.tiny.sample(case, steps=2)).all()


def test_a_transformer_option_that_cannot_be_sent_is_named(env):
    case = env.tiny.build_case("wan21_t2v")
    model = env.apply(case.patcher)
    model.model_options["transformer_options"]["another_pack"] = lambda: None
    with pytest.raises(ValueError) as error:
        env.tiny.sample(case, model=model, steps=2)
    message = str(error.value)
    assert message.startswith("Sequence Parallel (node #30): transformer option 'another_pack' (function)"), message
