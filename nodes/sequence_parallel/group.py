"""Rank 0's side of a sequence-parallel group: the ComfyUI process hosts the rendezvous, starts its local worker
processes (one per extra local device, kept alive between prompts), waits for remote ranks, and sends commands.

One group lives per process (``current_group``); a run asking for other settings (world size, backend, devices,
address) closes it and starts another, so no server restart is needed. A failure closes the group (local workers
killed, the process group destroyed, the rendezvous port released) and the next run starts a fresh one. ``atexit``
closes it when ComfyUI exits. Every wait is bounded (``Timeouts``, configurable by environment variables).
"""
from __future__ import annotations

import atexit
import datetime
import functools
import logging
import os
import subprocess
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NoReturn

import torch
import torch.distributed as dist

from ...omni_hooks.sequence_parallel import SequenceParallelConfig, SequenceParallelMesh
from . import network, rendezvous
from .control import ControlError, ControlServer
from .protocol import (
    ANSWER_STALL_S,
    Command,
    CommandRefused,
    GroupInfo,
    SequenceParallelError,
    Timeouts,
    broadcast_tensors,
    command_store,
    describe_exit,
    diagnose,
    encode,
    init_group,
    is_collective_failure,
    publish_group,
)
from . import trust
from .trust import group_key, new_secret, user_secret

log = logging.getLogger("OmniHooks")

WORKER_SCRIPT = Path(__file__).with_name("worker.py")
#: how long idle workers get to leave after the "exit" command before they are killed
EXIT_GRACE_S = 5.0
#: while rank 0 waits for its ranks it writes the group to the store again this often (anyone may overwrite it)
REPUBLISH_S = 0.5


@dataclass(frozen=True)
class GroupSettings:
    """Everything that identifies a group: changing any of it starts another one.

    ``devices``: the device of each LOCAL rank, rank 0 first; ranks ``len(devices)..world_size-1`` are remote and join
    with ``remote_worker_command`` (README, 'Sequence Parallel on several machines'). ``host``/``port``: where rank 0
    listens, and only there (port 0: any free port, local workers only).
    """

    world_size: int
    backend: str
    devices: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 0

    @property
    def remote_ranks(self) -> int:
        return self.world_size - len(self.devices)


def remote_worker_command(settings: GroupSettings, port: int, comfyui: str = "<ComfyUI folder>") -> str:
    """The command that starts this group's remote ranks on one other machine (all of them there; with several
    machines, each starts its share with its own ``--first-rank``). They rejoin rank 0's later groups by themselves."""
    first = len(settings.devices)
    return (f"torchrun --nproc-per-node {settings.remote_ranks} "
            "<ComfyUI-OmniHooks folder>/nodes/sequence_parallel/worker.py "
            f"--join {settings.host}:{port} --first-rank {first} --world-size {settings.world_size} "
            f"--comfyui {comfyui}")


def _destroy_process_group(backend: str, broken: bool, timeout_s: float) -> None:
    """Destroy the default process group without hanging on a peer that is gone: an aborted NCCL communicator
    when the group is broken, and in any case at most ``timeout_s`` of waiting (then an error in the log)."""
    if not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    target = abort if (broken and backend == "nccl" and abort is not None) else dist.destroy_process_group
    failure: list[BaseException] = []

    def run() -> None:
        try:
            target()
        except BaseException as exc:  # reported below, in the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="omnihooks-sp-destroy", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        log.error("OmniHooks Sequence Parallel: destroying the process group did not finish within %.0f s; restart "
                  "ComfyUI if the next run says torch.distributed is already initialised", timeout_s)
    elif failure:
        log.error("OmniHooks Sequence Parallel: destroying the process group failed: %r", failure[0])


class SequenceParallelGroup:
    def __init__(self, settings: GroupSettings, comfyui_root: Path):
        self.settings = settings
        self.timeouts = Timeouts.from_env()
        self.processes: list[subprocess.Popen] = []
        self.commands: dist.PrefixStore | None = None
        self.control: ControlServer | None = None
        self.serial = 0
        self._unanswered: functools.partial | None = None  # the wait for the answers to the last command, until run
        self.weights_key: tuple | None = None
        self.serial_of_weights: int | None = None  # the "load" command whose weights the workers hold
        self._meshes: dict[tuple[int, int, int], SequenceParallelMesh] = {}  # (ulysses, ring, cfg)
        self.interface: network.Interface | None = None  # the process group's network interface, once it is made
        self._start(comfyui_root)

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def _start(self, comfyui_root: Path) -> None:
        s = self.settings
        if dist.is_initialized():
            raise SequenceParallelError("Sequence Parallel: torch.distributed is already initialised in this process "
                                        "by something else; run ComfyUI without it")
        rendezvous.check_platform(s.backend)
        # the group's key: from a fresh secret when every rank is here, else from the one the user set everywhere
        try:
            secret = user_secret() if s.remote_ranks else new_secret()
        except trust.TrustError as exc:
            raise SequenceParallelError(str(exc)) from None
        if secret is None:
            raise SequenceParallelError(
                f"Sequence Parallel: {s.remote_ranks} rank(s) join from other machines, and they must prove they "
                f"belong to this group: set the same secret on this machine and theirs, in the environment variable "
                f"{trust.SECRET_ENV} or in a file named by {trust.SECRET_FILE_ENV} readable by its owner only (at "
                f"least {trust.MIN_SECRET_BITS} bits of entropy: generate it with {trust.NEW_SECRET_COMMAND}; README, "
                "'Sequence Parallel on several machines'), then restart ComfyUI")
        try:  # the interface the process group will use: no worker starts for an address no interface holds
            self.interface = network.interface_of(s.host)
        except ValueError as exc:
            raise SequenceParallelError(str(exc)) from None
        group_id = uuid.uuid4().hex
        self.key = group_key(secret, group_id)
        # rank 0 hosts the store and the control connections; their ports must be known before the workers start
        self.control = ControlServer(rendezvous.listening_socket(s.host, 0), self.key, s.world_size)
        try:
            listener = rendezvous.listening_socket(s.host, s.port)
        except BaseException:
            self.control.close()
            raise
        self.port = listener.getsockname()[1]
        self._store = dist.TCPStore(s.host, self.port, world_size=None, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=self.timeouts.join_s),
                                    master_listen_fd=listener.detach())  # the store owns (and closes) it
        self.commands = command_store(self._store)
        info = GroupInfo(s.world_size, s.backend, self.timeouts, group_id, self.control.port)
        publish_group(self.commands, info, self.key)
        self._info = info
        environment = {k: v for k, v in os.environ.items() if k not in (trust.SECRET_ENV, trust.SECRET_FILE_ENV)}
        for rank in range(1, len(s.devices)):
            command = [sys.executable, str(WORKER_SCRIPT), "--join", f"{s.host}:{self.port}", "--rank", str(rank),
                       "--world-size", str(s.world_size), "--device", s.devices[rank],
                       "--comfyui", str(comfyui_root), "--secret-from-parent"]
            process = subprocess.Popen(command, stdin=subprocess.PIPE, env=environment)
            self.processes.append(process)
            try:  # the secret through the pipe; the pipe stays open while this process lives (the worker's lifeline)
                process.stdin.write(secret.hex().encode() + b"\n")
                process.stdin.flush()
            except OSError:  # it exited at once: _wait_for_ranks says so
                pass
        try:
            self._wait_for_ranks(comfyui_root)
            try:
                self.interface = init_group(self._store, 0, info, s.host)
            except ValueError as exc:  # no interface holds the address (network.bind)
                raise SequenceParallelError(str(exc)) from None
        except BaseException:
            self.close(broken=True)
            raise

    def _wait_for_ranks(self, comfyui_root: Path) -> None:
        """Until every worker rank claimed its rank and connected: a local worker that exits first, or the join timeout,
        fails. The group is written to the store again every ``REPUBLISH_S`` (a stranger may have overwritten it)."""
        s = self.settings
        if s.remote_ranks:
            log.warning("OmniHooks Sequence Parallel: waiting %.0f s for %d remote rank(s) at %s:%d; start them with\n"
                        "  %s", self.timeouts.join_s, s.remote_ranks, s.host, self.port,
                        remote_worker_command(s, self.port, str(comfyui_root)))
        deadline = time.monotonic() + self.timeouts.join_s
        published = time.monotonic()
        while True:
            if time.monotonic() - published >= REPUBLISH_S:
                publish_group(self.commands, self._info, self.key)
                published = time.monotonic()
            self.control.accept_waiting()
            missing = self.control.missing(s.world_size)
            if not missing:
                self.control.stop_listening()
                return
            exited = {rank: code for rank, code in self.exit_codes().items() if code is not None}
            if exited:
                raise SequenceParallelError(
                    "Sequence Parallel: local worker " + ", ".join(
                        f"rank {rank} exited before joining ({describe_exit(code)})" for rank, code in exited.items())
                    + "; its error is in ComfyUI's console")
            if time.monotonic() > deadline:
                remote = [rank for rank in missing if rank >= len(s.devices)]
                hint = (f" Start the remote rank(s) {remote} on their machine with:\n  "
                        f"{remote_worker_command(s, self.port, str(comfyui_root))}" if remote else "")
                raise SequenceParallelError(
                    f"Sequence Parallel: rank(s) {missing} did not join rank 0 at {s.host}:{self.port} within "
                    f"{self.timeouts.join_s:.0f} s.{hint}")
            time.sleep(0.05)

    def close(self, broken: bool = False) -> None:
        """Stop the workers and destroy the process group, bounded whatever they do; the port is released.

        Idle workers get the "exit" command (remote ones leave on it) and ``EXIT_GRACE_S`` before they are killed.
        ``broken``: a call stopped mid-way, so workers may be blocked in a collective or hung: local ones are killed
        at once; remote ones fail their collective when the process group goes and exit."""
        if self.control is not None:
            try:
                self._send_exit()
            except Exception as exc:  # killing below still ends the local workers
                log.warning("OmniHooks Sequence Parallel: could not send exit to the workers: %r", exc)
            self.control.close()  # a worker that did not read the exit reads the connection's end and leaves
        deadline = time.monotonic() + (0.0 if broken else EXIT_GRACE_S)
        for p in self.processes:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()  # also ends a stopped (SIGSTOP) process
                p.wait(timeout=10)
            if p.stdin is not None:
                try:
                    p.stdin.close()
                except OSError:
                    pass
        self.processes = []
        _destroy_process_group(self.settings.backend, broken, self.timeouts.collective_s)
        network.unbind()
        self._meshes.clear()
        self._unanswered = None
        self.control = None
        self.commands = None
        self._store = None
        self.weights_key = None

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.processes)

    def exit_codes(self) -> dict[int, int | None]:
        """Each local worker's rank and exit code (None: running)."""
        return {rank: p.poll() for rank, p in enumerate(self.processes, start=1)}

    def _exit_codes(self) -> str:
        return ", ".join(f"rank {rank}: {'running' if code is None else describe_exit(code)}"
                         for rank, code in self.exit_codes().items()) or "none"

    def explain(self, error: BaseException) -> SequenceParallelError:
        """A clear error for a model call that failed in a collective or on a control connection: which ranks broke it
        and how (waits ``STALL_S`` to tell hung ranks from busy ones)."""
        try:
            found = diagnose(self.control, self.settings.world_size, self.exit_codes) if self.control else {}
        except Exception as exc:  # the diagnosis is a courtesy; the original error stays the cause
            found = {}
            log.warning("OmniHooks Sequence Parallel: could not tell which rank failed: %r", exc)
        if found:
            what = "; ".join(f"rank {rank}: {why}" for rank, why in sorted(found.items()))
        else:
            what = "the exchange between the ranks failed (every worker still looks alive)"
        remote = ("" if not self.settings.remote_ranks else
                  " (remote ranks rejoin it by themselves)")
        return SequenceParallelError(
            f"Sequence Parallel: a model call failed across the {self.settings.world_size} ranks: {what}. The group is "
            f"closed; the next run restarts the workers{remote}. "
            f"{'The control connection' if isinstance(error, ControlError) else 'torch.distributed'} said: {error}")

    # -- commands -------------------------------------------------------------------------------------------------

    def _encode(self, op: str, header: dict, payload) -> tuple[int, bytes, list[torch.Tensor]]:
        serial = self.serial + 1
        return serial, *encode(Command(op, serial, dict(header, op=op, serial=serial), payload))

    def _send_exit(self) -> None:
        """The "exit" command, unanswered, to every worker that takes it (one blocked in a collective of a call that
        broke never reads it: local ones are killed, remote ones leave when the process group goes)."""
        serial, data, _ = self._encode("exit", {}, None)
        self.serial = serial
        self.control.broadcast_quietly(serial, data, timeout_s=1.0)

    def command(self, op: str, header: dict, payload=None) -> None:
        """Send command ``op`` to every worker and wait until each accepted it (``send_command``, then its wait)."""
        self.send_command(op, header, payload)()

    def send_command(self, op: str, header: dict, payload=None) -> Callable[[], None]:
        """Send command ``op`` to every worker; returns the wait for their answers (``await_answers``), which this rank
        calls before its first collective of the command: the workers check the command while it computes. A command
        with tensors too large to travel in it (``protocol.BROADCAST_BYTES``) is waited for at once, and those tensors
        broadcast over the process group (the workers need them before they can compute); the wait returned then
        does nothing.

        A command that cannot be encoded sends nothing. The answers of an earlier command not waited for yet are
        waited for first."""
        if self._unanswered is not None:
            self._unanswered()
        if not self.alive():
            raise SequenceParallelError(f"Sequence Parallel: a worker process died ({self._exit_codes()}); it is "
                                        "restarted on the next run")
        serial, data, broadcast = self._encode(op, header, payload)  # may raise: nothing sent
        self._unanswered = functools.partial(self.await_answers, serial, op)
        try:
            self.control.send(serial, data, self.timeouts.ack_s)
        except ControlError as exc:
            self._fail(exc)
        self.serial = serial
        if not broadcast:
            return self._unanswered
        self._unanswered()
        try:
            broadcast_tensors(broadcast)
        except Exception as exc:
            if not is_collective_failure(exc):
                raise
            self._fail(exc)
        return _answered

    def await_answers(self, serial: int, op: str) -> None:
        """Until every worker accepted command ``serial`` (header checked, data prepared); at most once per command.

        A worker that refuses it fails it with a ``CommandRefused`` (and the group is closed when another worker
        accepted it: that one went on to the command's collectives). A worker that does not answer within ``ack_s``,
        whose connection ended, whose process exited or whose heartbeat stalled (in seconds, whatever ``ack_s``) fails
        it with an error naming the rank, and the group is closed (the next run starts a fresh one)."""
        if self._unanswered is None or self._unanswered.args[0] != serial:
            return
        self._unanswered = None
        since = time.monotonic()

        def unresponsive(rank: int) -> str | None:
            code = self.exit_codes().get(rank)
            if code is not None:
                return f"exited before answering ({describe_exit(code)})"
            if self.control.stalled(rank, since, ANSWER_STALL_S):
                return f"stopped responding before answering (no heartbeat for {ANSWER_STALL_S:.1f} s)"
            return None

        try:
            refusals = self.control.answers(serial, self.timeouts.ack_s, unresponsive)
        except ControlError as exc:
            self._fail(exc)
        if refusals:
            rank = min(refusals)
            every_worker = len(refusals) == self.settings.world_size - 1
            if not every_worker:
                discard(self)
            raise CommandRefused(f"Sequence Parallel: rank {rank} refused {op!r}:\n{refusals[rank]}", every_worker)

    def _fail(self, error: Exception) -> NoReturn:
        """A rank exited, stopped or hung: the group is out of step for good; closed, with an error naming the rank."""
        self._unanswered = None
        explained = self.explain(error)
        discard(self)
        raise explained from error

    def mesh(self, config: SequenceParallelConfig) -> SequenceParallelMesh:
        """The mesh of these degrees, built on every rank at once (the hybrid creates subgroups collectively)."""
        key = (config.ulysses_degree, config.ring_degree, config.cfg_degree)
        if key not in self._meshes:
            self.command("mesh", {"ulysses": key[0], "ring": key[1], "cfg": key[2]})
            self._meshes[key] = SequenceParallelMesh.from_config(config)
        return self._meshes[key]

    def sync_weights(self, patcher, family: str) -> None:
        """Send the diffusion model's weights as ComfyUI computes with them now (``computed_state``) once per model and
        patch version; workers build the same model class from its config first."""
        base_model = patcher.model
        key = (id(base_model), getattr(base_model, "current_weight_patches_uuid", None), family)
        if key == self.weights_key:
            return
        config = base_model.model_config
        state = computed_state(base_model.diffusion_model)
        payload = {"config_class": (type(config).__module__, type(config).__qualname__),
                   "unet_config": dict(config.unet_config),
                   "unet_dtype": config.unet_config.get("dtype", base_model.get_dtype()),
                   "manual_cast_dtype": config.manual_cast_dtype, "family": family}
        header = {"names": [(name, tuple(t.shape), str(t.dtype)) for name, t in state.items()]}
        self.weights_key = None
        self.command("load", header, payload)
        broadcast_tensors(list(state.values()))
        self.weights_key, self.serial_of_weights = key, self.serial


def _answered() -> None:
    """The wait of a command whose answers were waited for already."""


def computed_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state dict as ComfyUI computes with it. Patches (LoRA) applied in place are in the weights
    already; a layer ComfyUI loaded in its lowvram mode keeps them in ``weight_function``/``bias_function``, applied
    at cast time: they are applied here (result in the weight's own dtype)."""
    state = module.state_dict()
    for name, layer in module.named_modules():
        for attr in ("weight", "bias"):
            functions = getattr(layer, f"{attr}_function", None)
            key = f"{name}.{attr}" if name else attr
            if functions and key in state:
                tensor = state[key].clone()  # the functions may patch in place, as on ComfyUI's cast copy
                for function in functions:
                    tensor = function(tensor)
                state[key] = tensor.to(state[key].dtype)
    return state


_current: SequenceParallelGroup | None = None


def current_group(settings: GroupSettings, comfyui_root: Path) -> SequenceParallelGroup:
    """The process's group for ``settings``, started (or restarted after a failure or a change) as needed."""
    global _current
    if _current is not None and (_current.settings != settings or not _current.alive()):
        close_group()
    if _current is None:
        _current = SequenceParallelGroup(settings, comfyui_root)
    return _current


def active_group() -> SequenceParallelGroup | None:
    """The process's group, if one is started."""
    return _current


def discard(group: SequenceParallelGroup) -> None:
    """Close ``group`` as broken, and forget it if it is the process's group (the next run starts a fresh one)."""
    global _current
    if _current is group:
        close_group(broken=True)
    else:
        group.close(broken=True)


def close_group(broken: bool = False) -> None:
    """Close the process's group, if any (``broken``: a call stopped mid-way; see ``SequenceParallelGroup.close``)."""
    global _current
    group, _current = _current, None
    if group is not None:
        try:
            group.close(broken)
        except Exception:
            log.error("OmniHooks Sequence Parallel: closing the group failed:\n%s", traceback.format_exc())


atexit.register(close_group)
