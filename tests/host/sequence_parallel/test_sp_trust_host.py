"""Nothing a Sequence Parallel rank receives runs as code, and nobody joins a group without its secret.

Anyone who reaches rank 0's address can write to the rendezvous store and connect to the control port. A pickle
planted under every key the pack reads from the store never runs (the file it would create never appears), and the
run carries on or fails with a clear error; connections with a wrong secret, a rank taken or outside the group, a
negative or huge length, or nothing at all are refused and logged while the group keeps working; a platform
without torch.distributed refuses at once, naming the platform.
"""
from __future__ import annotations

import os
import pickle
import socket
import struct
import threading
import time

import pytest

from omnitest.processes import LOOPBACK, Snapshot, assert_nothing_left, deadline
from omnitest.quality import psnr_db

pytestmark = pytest.mark.host

MIN_PSNR_DB = 60.0
KEY = b"k" * 32
TEST_DEADLINE_S = 240.0


class _Planted:
    """Unpickled, it creates ``path``."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def planted(path) -> bytes:
    return pickle.dumps(_Planted(str(path)))


@pytest.fixture(scope="module")
def sp():
    from omnitest.pack import pack_module

    mods = {name: pack_module(f"nodes.sequence_parallel.{name}")
            for name in ("node", "group", "protocol", "control", "trust", "plain")}
    yield mods
    mods["group"].close_group()


@pytest.fixture
def store():
    import datetime

    import torch.distributed as dist

    master = dist.TCPStore(LOOPBACK, 0, world_size=None, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=5))
    yield master
    del master


def test_what_a_stranger_plants_in_the_store_never_runs_and_no_decoder_recurses_without_bound(sp, store, tmp_path):
    """The one key the pack reads from the store (``group``) holding a pickle, garbage, JSON nested 100000 deep or a
    record of a megabyte: each is refused with the pack's own error (never a RecursionError), and nothing runs."""
    protocol, trust = sp["protocol"], sp["trust"]
    commands = protocol.command_store(store)
    target = tmp_path / "ran"
    import json

    secret, group_id = b"s" * 32, "0" * 32
    nested = "[" * 100000  # signed with the group's key: its body is read after the signature holds
    signed_nested = json.dumps({"group_id": group_id, "body": nested,
                                "mac": trust.mac(trust.group_key(secret, group_id), "group", nested.encode()).hex()})
    for planted_value in (planted(target), b"\xff\xfe garbage", b"[" * 100000, b'{"a":' * 100000,
                          signed_nested.encode(), b" " * (2 << 20) + trust.seal(KEY, "group", {}, group_id=group_id)):
        commands.set("group", planted_value)
        with pytest.raises(protocol.UnjoinableGroup, match="not one this worker can join"):
            protocol.read_group(commands, secret)
    for bad in (b"[" * 100000, b"x" * (trust.RECORD_BYTES + 1)):
        with pytest.raises(trust.TrustError):
            trust.opened(bad)
    assert not target.exists()


def test_the_group_rank_0_signs_is_read_back_and_one_another_key_signed_is_not(sp, store):
    protocol, trust = sp["protocol"], sp["trust"]
    commands = protocol.command_store(store)
    secret, group_id = b"s" * 32, "0123456789abcdef" * 2
    info = protocol.GroupInfo(3, "gloo", protocol.Timeouts(7.0, 8.0, 9.0), group_id, 1234)
    key = trust.group_key(secret, group_id)
    protocol.publish_group(commands, info, key)
    assert protocol.read_group(commands, secret) == (info, key)
    with pytest.raises(protocol.UnjoinableGroup, match="same secret"):
        protocol.read_group(commands, b"t" * 32)
    # signed with the group's key, but a field out of range: refused all the same
    for field, value in (("world_size", 1), ("control_port", 70000), ("backend", "mpi"), ("timeouts", {"join_s": -1})):
        body = {"world_size": 3, "backend": "gloo", "timeouts": {"join_s": 7.0, "collective_s": 8.0, "ack_s": 9.0},
                "control_port": 1234, field: value}
        commands.set("group", trust.seal(key, "group", body, group_id=group_id))
        with pytest.raises(protocol.UnjoinableGroup):
            protocol.read_group(commands, secret)


def test_a_command_holds_plain_data_only_and_a_malformed_one_is_refused(sp):
    import torch

    protocol, plain = sp["protocol"], sp["plain"]
    features = __import__("omnitest.pack").pack.pack_module("nodes.features")
    node = sp["node"]
    config = node.resolve_degrees(sp["group"].GroupSettings(2, "gloo", ("cpu", "cpu")), 1, None, True, heads=2)
    applied = features.AppliedFeature(node.KIND, features.Category.SEQUENCE_PARALLEL, node.NODE_TITLE, "3", config)
    payload = {"features": (applied,), "dtype": torch.bfloat16, "uuid": __import__("uuid").uuid4(),
               "keys": {1: "a", (2, 3): None}, "values": [float("inf"), -0.0, 2 ** 70, b"\x00"]}
    data, _ = protocol.encode(protocol.Command("call", 1, {"degrees": (2, 1, 2)}, payload))
    assert b"pickle" not in data and data[8:9] == b"{"
    got = protocol.decode(data)
    assert got.payload == payload and got.header == {"degrees": (2, 1, 2)}
    assert type(got.payload["features"][0].config.group) is sp["group"].GroupSettings
    with pytest.raises(plain.PlainDataError, match="cannot be sent"):
        protocol.encode(protocol.Command("call", 1, {}, {"x": object()}))
    body = b'{"op":"call","serial":1,"header":{"$":"dict","items":[]},"payload":%s}'
    for bad in (b'{"$":"dataclass","class":"subprocess:Popen","fields":{}}',
                b'{"$":"dataclass","class":"nodes.sequence_parallel.group:SequenceParallelGroup","fields":{}}',
                b'{"$":"enum","class":"os:sep","value":1}',
                b'{"$":"tensor","dtype":"float32","shape":[1000000],"inline":0}',
                b'{"$":"tensor","dtype":"object","shape":[1],"inline":0}',
                b'{"$":"tensor","dtype":"float32","shape":[-1],"inline":0}'):
        document = body % bad
        with pytest.raises(plain.PlainDataError):
            protocol.decode(len(document).to_bytes(8, "little") + document)
    with pytest.raises(plain.PlainDataError, match="malformed command"):
        protocol.decode((1 << 62).to_bytes(8, "little") + b"{}")
    deep = b'{"op":"call","serial":1,"header":' + b"[" * 100000  # never a RecursionError
    with pytest.raises(plain.PlainDataError, match=f"nested more than {protocol.DOCUMENT_DEPTH} deep"):
        protocol.decode(len(deep).to_bytes(8, "little") + deep)
    nested: list = []
    for _ in range(protocol.DOCUMENT_DEPTH):
        nested = [nested]
    with pytest.raises(plain.PlainDataError, match="nested more than"):  # refused before anything is sent
        protocol.encode(protocol.Command("call", 1, {}, nested))
    with pytest.raises(ValueError, match="option 'deep'.*nested too deeply"):
        protocol.check_sendable({"deep": nested}, "Sequence Parallel")


# -- control connections ------------------------------------------------------------------------------------------

def _connect_in_background(control, port: int, rank: int, key: bytes) -> tuple[threading.Thread, list]:
    result: list = []

    def connect():
        try:
            result.append(control.ControlClient(LOOPBACK, port, rank, timeout_s=5, key=key))
        except BaseException as exc:  # the test reads it
            result.append(exc)

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    return thread, result


def _serve_until(server, done, timeout_s: float = 10) -> None:
    end = time.monotonic() + timeout_s
    while not done() and time.monotonic() < end:
        server.accept_waiting()
        time.sleep(0.01)


def _stranger(port: int, first: bytes, then_wait_s: float = 5) -> bool:
    """Connect, send ``first`` after the challenge, and say whether rank 0 closed the connection (read its end)."""
    with socket.create_connection((LOOPBACK, port), timeout=then_wait_s) as sock:
        sock.recv(64)  # the challenge
        try:
            sock.sendall(first)
            return sock.recv(64) == b""
        except (ConnectionResetError, BrokenPipeError):
            return True


def test_strangers_are_refused_and_logged_while_the_group_keeps_working(sp, caplog):
    control = sp["control"]
    listener = socket.create_server((LOOPBACK, 0))
    server = control.ControlServer(listener, KEY, 3)
    outcomes = {}
    try:
        silent = socket.create_connection((LOOPBACK, server.port))  # says nothing: must not hold anyone up
        stranger_threads = []
        hello = struct.Struct("<q32s32s")
        for name, first in [("wrong secret", hello.pack(1, b"n" * 32, b"m" * 32)),
                            ("negative length", struct.pack("<qq", 1, -5) + bytes(56)),
                            ("huge length", struct.pack("<qq", 1, 1 << 62) + bytes(56))]:
            def go(name=name, first=first):
                outcomes[name] = _stranger(server.port, first)
            stranger_threads.append(threading.Thread(target=go, daemon=True))
        for thread in stranger_threads:
            thread.start()
        _serve_until(server, lambda: len(outcomes) == 3)
        joined = {}
        for rank in (1, 2):
            thread, result = _connect_in_background(control, server.port, rank, KEY)
            _serve_until(server, lambda: not thread.is_alive())
            joined[rank] = result[0]
        assert all(isinstance(c, control.ControlClient) for c in joined.values()), joined
        # a second process claiming rank 1 (it holds the secret): refused with the reason; rank 5: outside the group
        for rank, why in ((1, "rank 1 has already joined"), (5, "rank 5 is outside 1..2")):
            thread, result = _connect_in_background(control, server.port, rank, KEY)
            _serve_until(server, lambda: not thread.is_alive())
            assert isinstance(result[0], control.RefusedRank) and why in str(result[0]), result
        thread, result = _connect_in_background(control, server.port, 2, b"x" * 32)  # rank 2, another secret
        _serve_until(server, lambda: not thread.is_alive())
        assert isinstance(result[0], ConnectionError), result
        server.stop_listening()
        assert outcomes == {"wrong secret": True, "negative length": True, "huge length": True}
        assert sorted(server.links) == [1, 2]
        # the group works: a command reaches both workers and their answers come back
        server.send(1, b"call", timeout_s=5)
        for rank, client in joined.items():
            assert client.receive(give_up=lambda: False) == (1, bytearray(b"call"))
            client.answer(1, None)
        assert server.answers(1, timeout_s=5) == {}
        refused = [r.getMessage() for r in caplog.records if "refused a control connection" in r.getMessage()]
        assert len(refused) >= 6 and any("does not prove" in m for m in refused), refused
        silent.close()
        for client in joined.values():
            client.close()
    finally:
        server.close()


def test_a_frame_of_a_negative_or_huge_length_is_refused_without_reading_it(sp):
    control = sp["control"]
    for size in (-1, control.ANSWER_LIMIT + 1, 1 << 62):
        left, right = socket.socketpair()
        with left, right:
            left.sendall(struct.pack("<qq", 1, size))
            right.settimeout(5)
            with pytest.raises(control.FrameError, match=f"a frame of {size} bytes"):
                control.receive_frame(right)


def test_a_group_starts_and_computes_while_strangers_knock_and_a_pickle_sits_in_its_store(sp, tmp_path, monkeypatch):
    """The shipped path, with a stranger at each door: wrong-secret and malformed hellos while the workers join,
    pickles under every key the pack reads once the group runs. The run equals one process; nothing planted runs."""
    from omnitest.tiny_models import build_case, sample

    node, group, control = sp["node"], sp["group"], sp["control"]
    group.close_group()
    before = Snapshot.now()
    target = tmp_path / "ran"
    knocked = []
    accept = control.ControlServer.accept_waiting

    def accept_with_strangers(self):
        if not knocked:
            hello = struct.Struct("<q32s32s")
            for first in (hello.pack(1, b"n" * 32, b"m" * 32), struct.pack("<qq", 1, -1) + bytes(56)):
                thread = threading.Thread(target=lambda f=first: knocked.append(_stranger(self.port, f)), daemon=True)
                thread.start()
            knocked.append("started")
        return accept(self)

    monkeypatch.setattr(control.ControlServer, "accept_waiting", accept_with_strangers)
    case = build_case("wan21_t2v")
    reference = sample(case)
    config = node.config_for(case.patcher, group.GroupSettings(2, "gloo", ("cpu", "cpu")), None, None)
    features = __import__("omnitest.pack").pack.pack_module("nodes.features")
    feature = features.AppliedFeature(node.KIND, features.Category.SEQUENCE_PARALLEL, node.NODE_TITLE, "1", config)
    model = features.attach_feature(case.patcher, feature)
    try:
        with deadline(TEST_DEADLINE_S, "a group with strangers"):
            assert psnr_db(sample(case, model), reference) >= MIN_PSNR_DB
            assert knocked.count(True) == 2, knocked  # both strangers were closed
            for key in ("group", "error/1", "error/0", "beat/1"):
                group.active_group().commands.set(key, planted(target))
            try:
                got = sample(case, model)
            except sp["protocol"].SequenceParallelError as exc:  # a clear error is allowed
                assert "rank 1" in str(exc), exc
                got = sample(case, model)  # and the next run starts a fresh group
            assert psnr_db(got, reference) >= MIN_PSNR_DB
            assert not target.exists()
    finally:
        group.close_group()
        import gc

        gc.collect()  # a failed run's traceback held the closed group's store (and its port)
    assert_nothing_left(before)


def test_a_platform_without_torch_distributed_or_the_backend_is_refused_at_the_node_naming_it(sp, monkeypatch):
    import sys

    import torch.distributed as dist
    from omnitest import tiny_models
    from omnitest.pack import run_node

    node, group = sp["node"], sp["group"]
    case = tiny_models.build_case("wan21_t2v")
    inputs = dict(world_size=2, ulysses_degree="auto", ring_degree="auto", devices="cpu,cpu", backend="gloo",
                  master_address="127.0.0.1", master_port=0)
    with monkeypatch.context() as patch:
        patch.setattr(dist, "is_gloo_available", lambda: False)
        with pytest.raises(sp["protocol"].SequenceParallelError) as failure:
            run_node(node.SequenceParallel, node_id="4", model=case.patcher, **inputs)
        assert f"cannot run on this platform ({sys.platform}" in str(failure.value)
        assert "no gloo backend" in str(failure.value)
    with monkeypatch.context() as patch:
        patch.setattr(dist, "is_available", lambda: False)
        with pytest.raises(sp["protocol"].SequenceParallelError, match=r"has no torch\.distributed"):
            run_node(node.SequenceParallel, node_id="4", model=case.patcher, **inputs)
    assert group.active_group() is None


def test_ranks_on_other_machines_need_a_strong_secret_set_by_the_user_in_a_file_only_they_read(
        sp, monkeypatch, tmp_path):
    import secrets

    trust = sp["trust"]
    strong = secrets.token_hex(16)  # 32 hexadecimal characters: 128 bits
    assert trust.user_secret({}) is None
    assert trust.user_secret({trust.SECRET_ENV: f"  {strong} \n"}) == strong.encode()
    path = tmp_path / "secret"
    path.write_text(strong + "\n")
    path.chmod(0o600)
    assert trust.user_secret({trust.SECRET_FILE_ENV: str(path)}) == strong.encode()
    # 16 characters, or any length of repeats, runs and sequences: refused, naming the rule
    for weak in ("aaaaaaaaaaaaaaaa", "password12345678", "0123456789abcdef" * 4, "ab" * 40, "a" * 64):
        with pytest.raises(trust.TrustError, match=f"rule is at least {trust.MIN_SECRET_BITS} bits"):
            trust.user_secret({trust.SECRET_ENV: weak})
    assert trust.secret_bits(strong) >= trust.MIN_SECRET_BITS > trust.secret_bits("aaaaaaaaaaaaaaaa")
    # a secret file others can read (0666) or write: refused, naming the rule and the fix
    for mode in (0o666, 0o640, 0o602):
        path.chmod(mode)
        with pytest.raises(trust.TrustError, match=f"mode {mode:04o}.*readable by its owner only.*chmod 600"):
            trust.user_secret({trust.SECRET_FILE_ENV: str(path)})
    with pytest.raises(trust.TrustError, match="cannot read"):
        trust.user_secret({trust.SECRET_FILE_ENV: str(tmp_path / "missing")})
    assert trust.group_key(b"s" * 20, "a") != trust.group_key(b"s" * 20, "b")  # each group its own key
    # rank 0 with remote ranks: a clear error before it listens, without a secret and with a weak one
    group = sp["group"]
    monkeypatch.delenv(trust.SECRET_ENV, raising=False)
    monkeypatch.delenv(trust.SECRET_FILE_ENV, raising=False)
    settings = group.GroupSettings(2, "gloo", ("cpu",), LOOPBACK, 0)
    with pytest.raises(sp["protocol"].SequenceParallelError, match=f"{trust.SECRET_ENV}.*--new-secret"):
        group.SequenceParallelGroup(settings, tmp_path)
    monkeypatch.setenv(trust.SECRET_ENV, "aaaaaaaaaaaaaaaa")
    with pytest.raises(sp["protocol"].SequenceParallelError, match="rule is at least 128 bits"):
        group.SequenceParallelGroup(settings, tmp_path)
    monkeypatch.delenv(trust.SECRET_ENV)
    path.chmod(0o666)
    monkeypatch.setenv(trust.SECRET_FILE_ENV, str(path))
    with pytest.raises(sp["protocol"].SequenceParallelError, match="readable by its owner only"):
        group.SequenceParallelGroup(settings, tmp_path)
    assert group.active_group() is None


def test_a_worker_prints_a_new_secret_that_passes_the_rule_and_refuses_a_weak_one_naming_it(sp, monkeypatch):
    import subprocess
    import sys

    trust, worker = sp["trust"], __import__("omnitest.pack").pack.pack_module("nodes.sequence_parallel.worker")
    printed = subprocess.run([sys.executable, str(sp["group"].WORKER_SCRIPT), "--new-secret"], capture_output=True,
                             text=True, timeout=60, check=True).stdout.strip()
    assert len(printed) == 64 and trust.secret_bits(printed) >= trust.MIN_SECRET_BITS
    assert printed != subprocess.run([sys.executable, str(sp["group"].WORKER_SCRIPT), "--new-secret"],
                                     capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    monkeypatch.setenv(trust.SECRET_ENV, "password12345678")
    args = worker.parse_args(["--join", "127.0.0.1:1", "--rank", "1", "--world-size", "2", "--device", "cpu"], {})
    with pytest.raises(SystemExit, match="rule is at least 128 bits"):
        worker._secret(args)
