"""Sequence Parallel when things go wrong, and the remote-join path, with rank 0 in this process (ComfyUI's KSampler
on the tiny Wan) and real worker processes over gloo on loopback.

A worker killed or stopped in the middle of a model call gives a clear error within the collective timeout, no
process or port is left and the next run works; an interrupt leaves every rank idle; a rank started by torchrun on
"another machine" (a separate process tree on loopback) joins and the result equals one process; a rank that never
joins fails the start within the join timeout. Every test runs under a deadline that fails it and kills the children.
"""
from __future__ import annotations

import gc
import json
import os
import signal
import struct
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

from omnitest.processes import LOOPBACK, deadline, free_port, listening_ports
from omnitest.quality import psnr_db
from omnitest.sp_group import with_sequence_parallel

pytestmark = pytest.mark.host

MIN_PSNR_DB = 60.0
COLLECTIVE_TIMEOUT_S = 5.0
TEST_DEADLINE_S = 240.0  # a worker's start (importing ComfyUI) takes tens of seconds on a busy 2-core machine
# the environment of rank 0 and of the workers it starts; torchrun's worker reads the join timeout itself
TIMEOUTS = {"OMNIHOOKS_SP_COLLECTIVE_TIMEOUT_S": str(COLLECTIVE_TIMEOUT_S), "OMNIHOOKS_SP_ACK_TIMEOUT_S": "20",
            "OMNIHOOKS_SP_JOIN_TIMEOUT_S": "150"}
#: the secret the user sets on every machine for remote ranks (rank 0's environment and the remote worker's)
REMOTE_SECRET = {"OMNIHOOKS_SP_SECRET": "a-test-secret-of-enough-length"}


@pytest.fixture(scope="module")
def sp():
    from omnitest.pack import pack_module

    with pytest.MonkeyPatch.context() as mp:
        for name, value in TIMEOUTS.items():
            mp.setenv(name, value)
        node = pack_module("nodes.sequence_parallel.node")
        group = pack_module("nodes.sequence_parallel.group")
        protocol = pack_module("nodes.sequence_parallel.protocol")
        yield node, group, protocol
        group.close_group()


@contextmanager
def _during_model_call(case, call: int, action):
    """Run ``action`` inside rank 0's ``call``-th model call (1-based), as its first block starts: the workers have
    accepted the call and are computing or exchanging attention. Yields the time the action ran (list, filled)."""
    block = case.patcher.model.diffusion_model.blocks[0]
    seen, fired_at = [0], []

    def pre_hook(module, args):
        seen[0] += 1
        if seen[0] == call:
            fired_at.append(time.monotonic())
            action()

    handle = block.register_forward_pre_hook(pre_hook)
    try:
        yield fired_at
    finally:
        handle.remove()


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_a_worker_killed_or_hung_mid_call_gives_a_clear_error_in_bounded_time_and_the_next_run_works(
        sp, wan, ports_before, fault):
    from omnitest.tiny_models import sample

    node, group, protocol = sp
    case, reference = wan
    model = with_sequence_parallel(case)
    with deadline(TEST_DEADLINE_S, f"worker {fault} mid-call"):
        sample(case, model)  # the group is up and the weights sent
        first = group.active_group()
        worker = first.processes[0]
        with _during_model_call(case, 2, lambda: os.kill(worker.pid, getattr(signal, fault))) as fired_at:
            with pytest.raises(protocol.SequenceParallelError) as failure:
                sample(case, model)
        waited = time.monotonic() - fired_at[0]
        message = str(failure.value)
        assert "Sequence Parallel" in message and "rank 1:" in message, message
        assert "the next run restarts the workers" in message, message
        assert ("killed by SIGKILL" if fault == "SIGKILL" else "stopped responding") in message, message
        # bounded: the collective timeout (a hung peer), the diagnosis and the kill, never the default 60 s
        assert waited < COLLECTIVE_TIMEOUT_S + protocol.STALL_S + 15, waited
        assert worker.poll() is not None  # the stopped worker too was killed
        assert group.active_group() is None
        del failure  # the error's frames hold the closed group's process groups (and so its port) until collected
        gc.collect()
        assert first.port not in listening_ports()
        assert psnr_db(sample(case, model), reference) >= MIN_PSNR_DB  # a fresh group
        assert group.active_group() is not first


def test_a_worker_stopped_before_it_answers_a_call_is_named_within_the_stall_time_while_a_stranger_replays_its_beats(
        sp, wan, ports_before, monkeypatch, tmp_path):
    """Rank 0 computes while the workers check a call; a worker stopped (SIGSTOP) before it answers is found by its
    stalled heartbeat while rank 0 waits at its first exchange, not after ``OMNIHOOKS_SP_ACK_TIMEOUT_S``. Meanwhile a
    stranger in another process replays heartbeats signed with the group's key (as if captured): in the store where
    heartbeats once were, and as frames on fresh connections to the control port. None counts."""
    from omnitest.pack import pack_module
    from omnitest.sp_stranger import Stranger
    from omnitest.tiny_models import sample

    _, group, protocol = sp
    control, trust = pack_module("nodes.sequence_parallel.control"), pack_module("nodes.sequence_parallel.trust")
    case, reference = wan
    model = with_sequence_parallel(case)
    with deadline(TEST_DEADLINE_S, "worker stopped before answering"):
        sample(case, model)
        first = group.active_group()
        worker = first.processes[0]
        captured = tmp_path / "captured.json"
        captured.write_text(json.dumps({
            "store": {"omnihooks_sp/beat/1": f"399:{trust.mac(first.key, 'beat/1', b'399').hex()}".encode().hex(),
                      "omnihooks_sp//beat/1": control.beat_frame(first.key, 1, 399).hex()},
            "frames": [(struct.pack("<qq", control.BEAT, 40) + control.beat_frame(first.key, 1, count)).hex()
                       for count in (397, 398, 399)]}))
        stranger = Stranger("replay", first.port, first.control.port, captured)
        send, calls, fired_at = group.SequenceParallelGroup.send_command, [0], []

        def stopping_the_worker_first(self, op, header, payload=None):
            calls[0] += 1 if op == "call" else 0
            if op == "call" and calls[0] == 2:
                os.kill(worker.pid, signal.SIGSTOP)
                fired_at.append(time.monotonic())
            return send(self, op, header, payload)

        try:
            monkeypatch.setattr(group.SequenceParallelGroup, "send_command", stopping_the_worker_first)
            with pytest.raises(protocol.SequenceParallelError) as failure:
                sample(case, model)
            waited = time.monotonic() - fired_at[0]
            monkeypatch.undo()
        finally:
            replayed = stranger.stop()
        message = str(failure.value)
        assert "rank 1:" in message and "stopped responding" in message, message
        # the stall time, with room for a loaded machine; not the answer timeout
        assert waited < protocol.ANSWER_STALL_S + 7 < float(TIMEOUTS["OMNIHOOKS_SP_ACK_TIMEOUT_S"]), waited
        assert replayed["writes"] > 10 and replayed["connections_refused"] == replayed["connections_tried"] > 0
        assert worker.poll() is not None and group.active_group() is None
        del failure
        gc.collect()
        assert psnr_db(sample(case, model), reference) >= MIN_PSNR_DB


def test_a_header_a_worker_refuses_on_its_control_connection_is_an_error_on_rank_0_not_a_hang(
        sp, wan, ports_before, monkeypatch):
    """The run's second model call announces a tensor the call does not carry: the worker refuses it before any
    collective, and rank 0, which went on computing while the worker checked, raises at its first exchange at once
    (not after the ack or collective timeout); the workers leave on the "exit" and the next run works."""
    from omnitest.tiny_models import sample

    node, group, protocol = sp
    case, reference = wan
    model = with_sequence_parallel(case)
    real_signature, calls = node.tensor_signature, [0]

    def announcing_one_tensor_more(value):
        calls[0] += 1
        if calls[0] == 2:
            return real_signature(value) + [((1,), "torch.float32")]
        return real_signature(value)

    with deadline(TEST_DEADLINE_S, "a refused header"):
        sample(case, model)
        first = group.active_group()
        workers = list(first.processes)
        monkeypatch.setattr(node, "tensor_signature", announcing_one_tensor_more)
        started = time.monotonic()
        with pytest.raises(protocol.CommandRefused) as failure:
            sample(case, model)
        waited = time.monotonic() - started
        monkeypatch.undo()
        assert calls[0] == 2
        message = str(failure.value)
        assert "rank 1 refused 'call'" in message and "do not match its header" in message, message
        assert waited < float(TIMEOUTS["OMNIHOOKS_SP_ACK_TIMEOUT_S"]) / 2, waited  # answered, not timed out
        assert group.active_group() is None  # a failed run closes the group: the workers took "exit" and left
        assert [w.wait(timeout=30) for w in workers] == [0]
        assert psnr_db(sample(case, model), reference) >= MIN_PSNR_DB


def test_workers_idle_between_prompts_longer_than_every_timeout_and_serve_the_next_run(
        sp, wan, ports_before, monkeypatch):
    """Between prompts a worker waits for rank 0's next command with no timeout: a pause longer than the collective
    and answer timeouts leaves the same group serving."""
    from omnitest.tiny_models import sample

    node, group, _ = sp
    case, reference = wan
    monkeypatch.setenv("OMNIHOOKS_SP_ACK_TIMEOUT_S", "2")
    model = with_sequence_parallel(case)
    with deadline(TEST_DEADLINE_S, "idle between prompts"):
        sample(case, model)
        first = group.active_group()
        time.sleep(COLLECTIVE_TIMEOUT_S + 1)
        assert first.alive()
        assert psnr_db(sample(case, model), reference) >= MIN_PSNR_DB
        assert group.active_group() is first and first.alive()


def test_an_interrupt_between_steps_leaves_the_workers_idle_and_the_group_serving(sp, wan, ports_before):
    import comfy.model_management as mm
    from omnitest.tiny_models import sample

    node, group, _ = sp
    case, reference = wan
    model = with_sequence_parallel(case)

    def progress(step, x0, x, total_steps):  # what ComfyUI's progress hook does after each step
        if step == 0:
            mm.interrupt_current_processing(True)
        mm.throw_exception_if_processing_interrupted()

    with deadline(TEST_DEADLINE_S, "interrupt between steps"):
        sample(case, model)
        first = group.active_group()
        with pytest.raises(mm.InterruptProcessingException):
            sample(case, model, callback=progress)
        assert group.active_group() is first and first.alive()
        assert psnr_db(sample(case, model), reference) >= MIN_PSNR_DB  # the same workers answer the next run
        assert group.active_group() is first


def test_an_interrupt_inside_a_model_call_unblocks_the_workers_at_once(sp, wan, ports_before):
    import comfy.model_management as mm
    from omnitest.tiny_models import sample

    node, group, _ = sp
    case, reference = wan
    model = with_sequence_parallel(case)

    def interrupt():  # as ComfyUI's own loops check for it (comfy/sd.py): inside the work
        mm.interrupt_current_processing(True)
        mm.throw_exception_if_processing_interrupted()

    with deadline(TEST_DEADLINE_S, "interrupt inside a model call"):
        sample(case, model)
        first = group.active_group()
        workers = list(first.processes)
        with _during_model_call(case, 2, interrupt) as fired_at:
            with pytest.raises(mm.InterruptProcessingException):
                sample(case, model)
        # the workers were blocked in the call's collectives: ended at once, not after the collective timeout
        assert time.monotonic() - fired_at[0] < COLLECTIVE_TIMEOUT_S
        assert all(w.poll() is not None for w in workers)
        assert group.active_group() is None
        assert psnr_db(sample(case, model), reference) >= MIN_PSNR_DB


def test_a_remote_rank_started_by_torchrun_joins_equals_one_process_and_rejoins_the_next_group(
        sp, wan, ports_before, monkeypatch, tmp_path):
    from omnitest.comfy_path import comfyui_path
    from omnitest.tiny_models import sample

    node, group, _ = sp
    case, reference = wan
    monkeypatch.setenv("OMNIHOOKS_SP_SECRET", REMOTE_SECRET["OMNIHOOKS_SP_SECRET"])
    port = free_port()
    model = with_sequence_parallel(case, devices=("cpu",), port=port)  # rank 1 is remote
    logs = tmp_path / "torchrun"  # torchrun's own logs: by default a directory in the temp directory, never removed
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               "--log-dir", str(logs), str(group.WORKER_SCRIPT), "--join", f"{LOOPBACK}:{port}", "--first-rank", "1",
               "--world-size", "2", "--comfyui", str(comfyui_path())]
    worker_join_s = 30  # how long the remote rank waits for rank 0's next group
    with deadline(TEST_DEADLINE_S, "torchrun remote rank"):
        torchrun = subprocess.Popen(command, stdin=subprocess.DEVNULL,
                                    env={**os.environ, **TIMEOUTS, **REMOTE_SECRET,
                                         "OMNIHOOKS_SP_JOIN_TIMEOUT_S": str(worker_join_s)})
        try:
            assert psnr_db(sample(case, model), reference) >= MIN_PSNR_DB
            first = group.active_group()
            assert first.processes == []  # no local worker: rank 1 came from torchrun
            group.close_group()  # as after a failure or a changed setting: the remote rank waits for the next group
            assert psnr_db(sample(case, model), reference) >= MIN_PSNR_DB
            assert group.active_group() is not first and group.active_group().port == port
            group.close_group()
            assert torchrun.wait(timeout=worker_join_s + 60) == 0  # no next group: the remote rank and torchrun end
            assert any(logs.iterdir())
        finally:
            if torchrun.poll() is None:
                torchrun.kill()
                torchrun.wait(timeout=10)


def test_a_remote_rank_that_never_joins_fails_the_start_within_the_join_timeout(sp, wan, ports_before, monkeypatch):
    from omnitest.tiny_models import sample

    node, group, protocol = sp
    case, _ = wan
    monkeypatch.setenv("OMNIHOOKS_SP_JOIN_TIMEOUT_S", "3")
    monkeypatch.setenv("OMNIHOOKS_SP_SECRET", REMOTE_SECRET["OMNIHOOKS_SP_SECRET"])
    port = free_port()
    model = with_sequence_parallel(case, devices=("cpu",), port=port)
    with deadline(60, "a start without the remote rank"):
        started = time.monotonic()
        with pytest.raises(protocol.SequenceParallelError) as failure:
            sample(case, model)
        assert time.monotonic() - started < 3 + 10
    message = str(failure.value)
    assert "rank(s) [1] did not join" in message and f"{LOOPBACK}:{port}" in message, message
    assert "torchrun --nproc-per-node 1" in message and "--first-rank 1 --world-size 2" in message, message
    assert group.active_group() is None


@pytest.mark.parametrize("argv, env, rank, device", [
    (["--rank", "3", "--world-size", "4"], {}, 3, "auto:0"),
    (["--first-rank", "2", "--world-size", "4"], {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}, 3, "auto:1"),
    (["--first-rank", "1", "--world-size", "4", "--device", "cuda:5"], {"RANK": "0", "LOCAL_RANK": "0"}, 1, "cuda:5"),
])
def test_worker_rank_and_device_come_from_first_rank_plus_torchruns_rank(sp, argv, env, rank, device):
    import torch
    from omnitest.pack import pack_module

    if device.startswith("auto:"):  # cuda:LOCAL_RANK, or cpu without CUDA
        device = f"cuda:{device[5:]}" if torch.cuda.is_available() else "cpu"
    args = pack_module("nodes.sequence_parallel.worker").parse_args(["--join", "127.0.0.1:1", *argv], env)
    assert (args.rank, args.device) == (rank, device)


def test_worker_under_torchrun_refuses_a_fixed_rank(sp):
    from omnitest.pack import pack_module

    with pytest.raises(SystemExit):
        pack_module("nodes.sequence_parallel.worker").parse_args(
            ["--join", "127.0.0.1:1", "--rank", "1", "--world-size", "3"], {"RANK": "0", "WORLD_SIZE": "2"})


def test_timeouts_come_from_the_environment_and_a_bad_value_names_its_variable(sp):
    _, _, protocol = sp
    timeouts = protocol.Timeouts.from_env({"OMNIHOOKS_SP_COLLECTIVE_TIMEOUT_S": "2.5",
                                           "OMNIHOOKS_SP_JOIN_TIMEOUT_S": "7"})
    assert (timeouts.collective_s, timeouts.join_s, timeouts.ack_s) == (2.5, 7.0, protocol.Timeouts().ack_s)
    for bad in ("soon", "0", "-1"):
        with pytest.raises(ValueError, match="OMNIHOOKS_SP_ACK_TIMEOUT_S"):
            protocol.Timeouts.from_env({"OMNIHOOKS_SP_ACK_TIMEOUT_S": bad})
