"""A stranger who reaches a Sequence Parallel group's address can neither stall it nor make a stopped rank look alive.

On a live group (rank 0 in this process, workers over gloo on loopback) a second process: floods the store with
garbage and deletes its keys while a worker is busy for 10 s (the group serves on); plants a garbage or deeply nested
group record where a remote worker waits (it waits on, and joins the next valid group); holds 50 slow connections
open during the start (the start does not wait on them, and no thread is added). (A stopped worker whose beats a
stranger replays is named within the stall time: test_sp_faults_host.py.) Below the live group: handshakes beyond
the cap are closed at once, one deadline bounds a whole handshake, and a heartbeat that is replayed, unsigned or
signed for another rank never counts. A local group's listeners are all on loopback, checked from the sockets the
processes hold.
"""
from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from omnitest.processes import LOOPBACK, deadline, free_port
from omnitest.quality import psnr_db
from omnitest.sp_group import join_client, with_sequence_parallel
from omnitest.sp_stranger import Stranger

pytestmark = pytest.mark.host

MIN_PSNR_DB = 60.0
TEST_DEADLINE_S = 300.0  # a worker's start (importing ComfyUI) takes tens of seconds on a busy 2-core machine
BUSY_S = 10.0
TIMEOUTS = {"OMNIHOOKS_SP_COLLECTIVE_TIMEOUT_S": "20", "OMNIHOOKS_SP_ACK_TIMEOUT_S": "60",
            "OMNIHOOKS_SP_JOIN_TIMEOUT_S": "150"}
HARNESS = Path(__file__).resolve().parents[2] / "omnitest" / "sp_busy_worker.py"
KEY = b"k" * 32


@pytest.fixture(scope="module")
def sp():
    from omnitest.pack import pack_module

    with pytest.MonkeyPatch.context() as mp:
        for name, value in TIMEOUTS.items():
            mp.setenv(name, value)
        mods = {name: pack_module(f"nodes.sequence_parallel.{name}")
                for name in ("node", "group", "protocol", "control", "trust", "network")}
        yield mods
        mods["group"].close_group()


# -- on a live group ------------------------------------------------------------------------------------------------

def test_a_garbage_flood_and_deleted_keys_do_not_end_a_group_whose_worker_is_busy_for_10_s(
        sp, wan, ports_before, monkeypatch, tmp_path):
    from omnitest.tiny_models import sample

    group = sp["group"]
    case, reference = wan
    flag = tmp_path / "busy"
    monkeypatch.setattr(group, "WORKER_SCRIPT", HARNESS)
    monkeypatch.setenv("OMNIHOOKS_TEST_BUSY_S", str(BUSY_S))
    monkeypatch.setenv("OMNIHOOKS_TEST_BUSY_FLAG", str(flag))
    model = with_sequence_parallel(case)
    with deadline(TEST_DEADLINE_S, "a garbage flood on a busy worker's group"):
        sample(case, model)
        first = group.active_group()
        stranger = Stranger("flood", first.port)
        try:
            flag.touch()  # the worker checks the next call for BUSY_S seconds, beating all along
            started = time.monotonic()
            got = sample(case, model)
            took = time.monotonic() - started
        finally:
            flooded = stranger.stop()
        assert not flag.exists() and took >= BUSY_S, took  # the worker was busy, and rank 0 waited for it
        assert flooded["writes"] > 1000 and flooded["deletes"] > 0, flooded
        assert psnr_db(got, reference) >= MIN_PSNR_DB
        assert group.active_group() is first and first.alive()  # the same group serves on


def _wait_for_line(path: Path, text: str, count: int, process: subprocess.Popen, timeout_s: float) -> str:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        log = path.read_text(errors="replace")
        if log.count(text) >= count:
            return log
        assert process.poll() is None, f"the worker exited ({process.returncode}):\n{log}"
        time.sleep(0.2)
    raise AssertionError(f"the worker did not log {text!r} {count} time(s) within {timeout_s:.0f} s:\n"
                         f"{path.read_text(errors='replace')}")


def test_a_remote_worker_ignores_a_garbage_or_nested_group_record_and_joins_the_next_valid_group(
        sp, wan, ports_before, monkeypatch, tmp_path):
    import datetime

    import torch.distributed as dist
    from omnitest.comfy_path import comfyui_path
    from omnitest.tiny_models import sample

    group, protocol = sp["group"], sp["protocol"]
    case, reference = wan
    secret = "8c1f0a6b3e5d47f29a0b6c3d8e1f2a4b"  # 32 hexadecimal characters
    monkeypatch.setenv("OMNIHOOKS_SP_SECRET", secret)
    port = free_port()
    stranger_store = dist.TCPStore(LOOPBACK, port, world_size=None, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=5))  # a stranger's store at the join address
    commands = protocol.command_store(stranger_store)
    commands.set("group", b"\xff not a group")
    log = tmp_path / "worker.log"
    command = [sys.executable, str(group.WORKER_SCRIPT), "--join", f"{LOOPBACK}:{port}", "--rank", "1",
               "--world-size", "2", "--device", "cpu", "--comfyui", str(comfyui_path())]
    ignored = "ignored the group record"
    with deadline(TEST_DEADLINE_S, "a remote worker and a stranger's group records"), open(log, "wb") as out:
        worker = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                  env={**os.environ, **TIMEOUTS, "OMNIHOOKS_SP_SECRET": secret})
        try:
            _wait_for_line(log, ignored, 1, worker, 150)
            commands.set("group", b"[" * 60000)  # within the size a record may have, nested 60000 deep
            text = _wait_for_line(log, ignored, 2, worker, 30)
            assert "nested more than" in text and "RecursionError" not in text and "Traceback" not in text, text
            time.sleep(2)
            assert worker.poll() is None  # still waiting
            del commands, stranger_store  # the stranger leaves; rank 0 starts its group at that address
            gc.collect()
            model = with_sequence_parallel(case, devices=("cpu",), port=port)
            assert psnr_db(sample(case, model), reference) >= MIN_PSNR_DB  # rank 1 joined the valid group
            assert group.active_group().processes == []
            group.close_group()
        finally:
            worker.terminate()
            worker.wait(timeout=30)


def test_fifty_slow_connections_during_the_start_neither_delay_it_nor_add_threads(
        sp, wan, ports_before, monkeypatch):
    """Each slow connection sends a byte a second, so that no per-read timeout would end it; the handshake's one
    deadline is set beyond the test, so that only not waiting on them lets the start go on."""
    from omnitest.tiny_models import sample

    control = sp["control"]
    case, reference = wan
    monkeypatch.setattr(control, "HELLO_S", 600.0)
    accept = control.ControlServer.accept_waiting
    seen, strangers = {"threads": []}, []
    baseline = threading.active_count()

    def accept_with_slow_strangers(self):
        if not strangers:
            strangers.append(Stranger("slow", self.port, 50))
            end = time.monotonic() + 60
            while len(self._handshakes) < 50 and time.monotonic() < end:  # each one challenged as it connects
                accept(self)
                time.sleep(0.01)
            seen["challenged"] = strangers[0].first_line()["challenged"]
            seen["strangers_in"] = time.monotonic()
        seen["threads"].append(threading.active_count())
        return accept(self)

    monkeypatch.setattr(control.ControlServer, "accept_waiting", accept_with_slow_strangers)
    model = with_sequence_parallel(case)
    try:
        with deadline(TEST_DEADLINE_S, "a start with 50 slow connections"):
            got = sample(case, model)
            started = time.monotonic() - seen["strangers_in"]
            assert psnr_db(got, reference) >= MIN_PSNR_DB
    finally:
        report = strangers[0].stop() if strangers else {}
    assert seen["challenged"] == 50, seen  # under the cap: each one got its challenge and held a handshake
    assert started < 120, started  # the start went on with them open (their deadline was 600 s)
    # no thread per handshake (beyond the baseline: the test's deadline timer, a joined worker's reader)
    assert max(seen["threads"]) <= baseline + 2, (baseline, max(seen["threads"]))
    assert report["closed"] == 50, report  # the start closed every handshake still running


# -- below the live group: the control server and its connections ------------------------------------------------------

def test_handshakes_beyond_the_cap_are_closed_at_once_and_one_deadline_bounds_a_whole_handshake(
        sp, monkeypatch, caplog):
    control = sp["control"]
    monkeypatch.setattr(control, "HANDSHAKES", 4)
    monkeypatch.setattr(control, "HELLO_S", 1.5)
    threads = threading.active_count()
    server = control.ControlServer(socket.create_server((LOOPBACK, 0)), KEY, 3)
    strangers = [socket.create_connection((LOOPBACK, server.port), timeout=5) for _ in range(6)]
    try:
        time.sleep(0.2)
        server.accept_waiting()
        outcomes = []
        for sock in strangers:
            got = b""
            while len(got) < 40:
                chunk = sock.recv(40 - len(got))
                if not chunk:
                    break
                got += chunk
            outcomes.append(len(got))
        assert sorted(outcomes) == [0, 0, 40, 40, 40, 40], outcomes  # 4 handshakes; 2 closed at once
        assert any("closed 2 control connection(s)" in r.getMessage() and "4 handshakes" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
        # a handshake that dribbles a byte every 0.2 s is closed at its one deadline all the same
        dribbler = strangers[outcomes.index(40)]
        started, closed_after = time.monotonic(), None
        while closed_after is None and time.monotonic() - started < 10:
            try:
                dribbler.sendall(b"x")
            except OSError:
                closed_after = time.monotonic() - started
            server.accept_waiting()
            dribbler.settimeout(0.2)
            try:
                if dribbler.recv(1) == b"":
                    closed_after = time.monotonic() - started
            except socket.timeout:
                pass
            except OSError:  # reset: closed with bytes unread
                closed_after = time.monotonic() - started
        assert closed_after is not None and closed_after < 1.5 + 3, closed_after
        assert any("did not finish its handshake within" in r.getMessage() for r in caplog.records)
        assert threading.active_count() == threads  # no thread for any of it
        client = join_client(control, server, 1, KEY)  # the slots are free again: a worker joins
        assert sorted(server.links) == [1] and threading.active_count() == threads + 1  # its reader
        client.close()
    finally:
        for sock in strangers:
            sock.close()
        server.close()


def test_a_heartbeat_replayed_unsigned_or_signed_for_another_rank_never_counts(sp, caplog):
    """On the connection itself (as if someone on the path replayed what it saw): only a signed count that rises
    refreshes a rank; replays of its earlier beats, garbage and another rank's beats are no information, so a worker
    that stopped beating is stalled after the stall time whatever is replayed."""
    control = sp["control"]
    server = control.ControlServer(socket.create_server((LOOPBACK, 0)), KEY, 3)
    client = join_client(control, server, 1, KEY)
    try:
        server.stop_listening()
        client.start_heartbeat()
        time.sleep(1.0)
        assert not server.stalled(1, time.monotonic() - 10, 0.8)
        client._stopped.set()  # the worker stops beating: only what follows comes, for 2 s
        client._heart.join(5)
        seen = server.links[1].count
        assert seen >= 2
        replays = [control.beat_frame(KEY, 1, c) for c in range(1, seen + 1)]  # counts it sent already
        replays += [os.urandom(40), control.beat_frame(KEY, 2, seen + 5), control.beat_frame(b"x" * 32, 1, seen + 5)]
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            for frame in replays:
                client._send(control.BEAT, frame)
            time.sleep(0.05)
        assert server.links[1].count == seen and server.ended(1) is None
        assert server.stalled(1, time.monotonic() - 10, 1.5)  # 2 s without a fresh beat
        assert any("ignored a heartbeat of rank 1" in r.getMessage() for r in caplog.records)
        client._send(control.BEAT, control.beat_frame(KEY, 1, seen + 1))  # a fresh one counts at once
        end = time.monotonic() + 5
        while server.links[1].count == seen and time.monotonic() < end:
            time.sleep(0.01)
        assert not server.stalled(1, time.monotonic() - 10, 1.5)
        client.report("Traceback ...\nRuntimeError: boom\n")  # a failed command's traceback comes the same way
        end = time.monotonic() + 5
        while server.reported_error(1) is None and time.monotonic() < end:
            time.sleep(0.01)
        assert server.reported_error(1) == "RuntimeError: boom"
    finally:
        client.close()
        server.close()


# -- the network interface ---------------------------------------------------------------------------------------

def _other_interface():
    """A network interface of this machine that is not loopback (name, address), None when there is none."""
    import ipaddress

    import psutil

    for name, entries in psutil.net_if_addrs().items():
        for entry in entries:
            if entry.family == socket.AF_INET and not ipaddress.ip_address(entry.address).is_loopback:
                return name, entry.address
    return None


def _is_loopback(ip: str) -> bool:
    import ipaddress

    address = ipaddress.ip_address(ip.split("%")[0])
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback  # ::ffff:127.0.0.1 too


def test_a_local_groups_listeners_are_all_on_loopback_checked_from_the_sockets_its_processes_hold(
        sp, wan, ports_before, monkeypatch):
    """Even where gloo would pick another interface (``GLOO_SOCKET_IFNAME`` set to the LAN's, as a host name that
    resolves there would): every listening socket of rank 0's group and of its worker is on loopback."""
    import psutil
    from omnitest.pack import pack_module
    from omnitest.tiny_models import sample

    group, network = sp["group"], sp["network"]
    case, reference = wan
    other = _other_interface()
    if other is not None:
        monkeypatch.setenv(network.GLOO_ENV, other[0])
    before = {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="inet")
              if c.status == psutil.CONN_LISTEN}
    model = with_sequence_parallel(case)
    with deadline(TEST_DEADLINE_S, "a local group's sockets"):
        assert psnr_db(sample(case, model), reference) >= MIN_PSNR_DB
        active = group.active_group()
        held = {"rank 0": [c for c in psutil.Process().net_connections(kind="inet")
                           if (c.laddr.ip, c.laddr.port) not in before],
                "rank 1": psutil.Process(active.processes[0].pid).net_connections(kind="inet")}
        listening = {who: [c.laddr for c in conns if c.status == psutil.CONN_LISTEN] for who, conns in held.items()}
        assert listening["rank 0"] and listening["rank 1"], listening  # the store, gloo's listeners
        for who, conns in held.items():
            for c in conns:
                addresses = [c.laddr.ip] + ([c.raddr.ip] if c.raddr else [])
                assert all(_is_loopback(a) for a in addresses), (who, c)
        assert str(active.interface).endswith("(127.0.0.1)") and os.environ[network.GLOO_ENV] == active.interface.name
        run = pack_module("nodes.stats_store").recent_runs(1)[0]  # the card names the interface
        (card,) = [f["summary"] for f in run["features"] if f["kind"] == "sequence_parallel"]
        assert card["interface"] == str(active.interface), card
        group.close_group()
    assert os.environ.get(network.GLOO_ENV) == (other[0] if other else None)  # given back when the group closed


def test_the_interface_is_the_one_holding_the_address_and_nccl_keeps_its_first(sp, monkeypatch):
    network = sp["network"]
    monkeypatch.delenv(network.GLOO_ENV, raising=False)
    monkeypatch.delenv(network.NCCL_ENV, raising=False)
    monkeypatch.setattr(network, "_nccl_interface", None)
    loopback = network.interface_of("127.0.0.1")
    assert loopback.address == "127.0.0.1" and network.interface_of("localhost").name == loopback.name
    assert network.bind("127.0.0.1", "nccl") == loopback
    assert os.environ[network.GLOO_ENV] == loopback.name and os.environ[network.NCCL_ENV] == "=" + loopback.name
    network.unbind()
    assert network.GLOO_ENV not in os.environ
    other = _other_interface()
    if other is not None:
        assert network.interface_of(other[1]).name == other[0]
        assert network.bind(other[1], "gloo").name == other[0]  # gloo: any interface, per group
        network.unbind()
        with pytest.raises(ValueError, match="NCCL in this process already uses .*Restart ComfyUI"):
            network.bind(other[1], "nccl")
    with pytest.raises(ValueError, match="on none of this machine's network interfaces.*127.0.0.1"):
        network.interface_of("0.0.0.0")
