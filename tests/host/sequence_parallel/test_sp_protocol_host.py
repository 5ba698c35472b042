"""What rank 0 sends its workers, as bytes: a command's tensors travel beside its pickle, not through it, and come back
equal (dtype, shape, values; bfloat16, bool, empty, non-contiguous and 0-dim tensors), in place in lists, tuples and
dicts; what is not a tensor is pickled as it was."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.host


@pytest.fixture(scope="module")
def protocol():
    from omnitest.pack import pack_module

    return pack_module("nodes.sequence_parallel.protocol")


def _tensors(value) -> list:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    return [t for v in value for t in _tensors(v)] if isinstance(value, (list, tuple)) else []


def test_a_commands_tensors_come_back_equal_and_in_place(protocol):
    import torch

    torch.manual_seed(0)
    args = (torch.randn(2, 3), protocol.OPTIONS_SLOT, torch.tensor(3.5, dtype=torch.bfloat16))
    kwargs = {"context": [torch.arange(5), torch.zeros(0, 4)], "mask": torch.tensor([True, False]), "name": "x"}
    options = {"sigmas": torch.randn(7).to(torch.float16)[::2], "uuids": ["a", "b"]}
    command = protocol.Command("call", 3, {"serial": 3}, (args, kwargs, options, (1, 2)))
    data = protocol.encode(command)
    assert len(data) < 2000  # the tensors' bytes are not pickled (pickled, six tensors take about 2,500)
    got = protocol.decode(data)
    assert (got.op, got.serial, got.header) == ("call", 3, {"serial": 3})
    sent, received = _tensors(command.payload), _tensors(got.payload)
    assert len(received) == len(sent) == 6
    for a, b in zip(sent, received):
        assert (b.dtype, b.shape) == (a.dtype, a.shape) and torch.equal(a, b), (a, b)
    assert got.payload[0][1] == protocol.OPTIONS_SLOT and got.payload[1]["name"] == "x"
    assert got.payload[2]["uuids"] == ["a", "b"] and got.payload[3] == (1, 2)
    assert isinstance(got.payload[0], tuple) and isinstance(got.payload[1]["context"], list)
