"""What rank 0 sends its workers, as bytes: a command is a JSON document and the raw bytes of its tensors, which come
back equal (dtype, shape, values; bfloat16, bool, empty, non-contiguous and 0-dim tensors), in place in lists, tuples
and dicts; what is not a tensor comes back as it was. The control connections that carry them."""
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
    # a sampler's timestep expanded from one value (uni_pc): one element, stride 0, which torch calls contiguous
    options = {"sigmas": torch.randn(7).to(torch.float16)[::2], "uuids": ["a", "b"],
               "timestep": torch.tensor(0.25).expand(1)}
    command = protocol.Command("call", 3, {"serial": 3}, (args, kwargs, options, (1, 2)))
    data, broadcast = protocol.encode(command)
    assert broadcast == []  # every tensor small enough to travel in the command
    assert len(data) < 2000  # the tensors' raw bytes, each described once
    got = protocol.decode(data)
    assert (got.op, got.serial, got.header) == ("call", 3, {"serial": 3})
    sent, received = _tensors(command.payload), _tensors(got.payload)
    assert len(received) == len(sent) == 7
    for a, b in zip(sent, received):
        assert (b.dtype, b.shape) == (a.dtype, a.shape) and torch.equal(a, b), (a, b)
    assert got.payload[0][1] == protocol.OPTIONS_SLOT and got.payload[1]["name"] == "x"
    assert got.payload[2]["uuids"] == ["a", "b"] and got.payload[3] == (1, 2)
    assert isinstance(got.payload[0], tuple) and isinstance(got.payload[1]["context"], list)


def test_a_tensor_too_large_for_the_command_is_left_to_the_broadcast_and_received_in_place(protocol):
    import torch

    large = torch.randn(protocol.BROADCAST_BYTES // 4 + 1)  # one float more than the command carries
    wide = torch.randn(protocol.BROADCAST_BYTES // 2 + 1, dtype=torch.bfloat16)
    small = torch.arange(6).reshape(2, 3)
    data, broadcast = protocol.encode(protocol.Command("call", 1, {}, ((large, small), {"x": wide})))
    assert len(data) < 2000 and len(broadcast) == 2
    # in the payload's order, not copied (broadcast from where they are: a GPU tensor from the GPU)
    assert [t.data_ptr() for t in broadcast] == [large.data_ptr(), wide.data_ptr()]
    got = protocol.decode(data, "cpu")
    (received, received_small), kwargs = got.payload
    assert torch.equal(received_small, small)
    assert [(t.shape, t.dtype) for t in got.broadcast] == [(large.shape, torch.float32), (wide.shape, torch.bfloat16)]
    assert got.broadcast[0] is received and got.broadcast[1] is kwargs["x"]  # filled in place by the broadcast


# -- control connections ------------------------------------------------------------------------------------------

KEY = b"k" * 32


@pytest.fixture
def control():
    """Rank 0's control server with workers 1 and 2 connected (clients in this process); closed after the test."""
    import socket

    from omnitest.pack import pack_module
    from omnitest.sp_group import join_client

    module = pack_module("nodes.sequence_parallel.control")
    listener = socket.create_server(("127.0.0.1", 0))
    server = module.ControlServer(listener, KEY, 3)
    clients = {}
    for rank in (1, 2):
        clients[rank] = join_client(module, server, rank, KEY)
    server.stop_listening()
    yield module, server, clients
    for client in clients.values():
        client.close()
    server.close()


def test_a_command_reaches_every_worker_and_their_answers_come_back_by_rank(control):
    module, server, clients = control
    assert server.missing(3) == [] and sorted(server.links) == [1, 2]
    payload = bytes(range(256)) * 1000  # more than one packet
    server.send(7, payload, timeout_s=5)
    for rank, client in clients.items():
        serial, data = client.receive(give_up=lambda: False)
        assert (serial, bytes(data)) == (7, payload)
        client.answer(7, None if rank == 1 else "Traceback ...\nValueError: no mesh")
    assert server.answers(7, timeout_s=5) == {2: "Traceback ...\nValueError: no mesh"}


def test_a_worker_that_does_not_answer_is_named_after_the_timeout(control):
    import time

    module, server, clients = control
    server.send(1, b"call", timeout_s=5)
    clients[1].receive(give_up=lambda: False)
    clients[1].answer(1, None)  # rank 2 never answers
    started = time.monotonic()
    with pytest.raises(module.ControlError, match="rank 2 did not answer command 1 within") as failure:
        server.answers(1, timeout_s=0.5)
    assert failure.value.rank == 2 and time.monotonic() - started < 5


def test_a_worker_that_left_or_answered_another_command_is_named_at_once(control):
    module, server, clients = control
    server.send(3, b"call", timeout_s=5)
    clients[1].answer(2, None)  # out of step
    with pytest.raises(module.ControlError, match="rank 1 answered command 2 to command 3"):
        server.answers(3, timeout_s=20)
    clients[1].receive(give_up=lambda: False)
    clients[2].close()
    try:
        server.send(4, b"call", timeout_s=5)  # may already fail at rank 2, or be buffered by the kernel
    except module.ControlError as exc:
        assert exc.rank == 2 and "closed its control connection" in str(exc)
        return
    clients[1].receive(give_up=lambda: False)
    clients[1].answer(4, None)
    with pytest.raises(module.ControlError, match="rank 2 closed its control connection"):
        server.answers(4, timeout_s=20)


def test_an_idle_worker_waits_until_told_to_give_up(control):
    import time

    _, _, clients = control
    checks = []
    started = time.monotonic()
    assert clients[1].receive(give_up=lambda: checks.append(1) or len(checks) >= 2) is None
    assert len(checks) == 2 and time.monotonic() - started >= 0.9  # one check every POLL_S (0.5 s)


def test_a_missing_answer_whose_worker_cannot_give_one_fails_in_seconds_whatever_the_timeout(control):
    import time

    module, server, clients = control
    server.send(5, b"call", timeout_s=5)
    clients[1].receive(give_up=lambda: False)
    clients[1].answer(5, None)
    asked = []

    def unresponsive(rank):  # rank 2 "stopped" (its heartbeat stalled) after two checks
        asked.append(rank)
        return "stopped responding before answering" if len(asked) >= 3 else None

    started = time.monotonic()
    with pytest.raises(module.ControlError, match="rank 2 stopped responding before answering"):
        server.answers(5, timeout_s=60, unresponsive=unresponsive)
    assert set(asked) == {2} and time.monotonic() - started < 5
