"""Rank 0's side of a sequence-parallel group: the ComfyUI process hosts the rendezvous, starts its local worker
processes (one per extra local device, kept alive between prompts), waits for remote ranks, and sends commands.

One group lives per process (``current_group``); a run asking for other settings (world size, backend, devices,
address) closes it and starts another, so no server restart is needed. A failure closes the group (local workers
killed, the process group destroyed) and the next run starts a fresh one. ``atexit`` closes it when ComfyUI exits.
"""
from __future__ import annotations

import atexit
import datetime
import logging
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..omni_hooks.sequence_parallel import SequenceParallelConfig, SequenceParallelMesh
from .sp_protocol import (
    ACK_TIMEOUT_S,
    JOIN_TIMEOUT_S,
    POLL_S,
    Command,
    SequenceParallelError,
    broadcast_tensors,
    encode,
    join_group,
    wait_for,
)

log = logging.getLogger("OmniHooks")

WORKER_SCRIPT = Path(__file__).with_name("sp_worker.py")


@dataclass(frozen=True)
class GroupSettings:
    """Everything that identifies a group: changing any of it starts another one.

    ``devices``: the device of each LOCAL rank, rank 0 first; ranks ``len(devices)..world_size-1`` are remote and join
    by hand (README: "Sequence Parallel on several machines"). ``host``/``port``: where rank 0 listens (port 0: any
    free port, local workers only).
    """

    world_size: int
    backend: str
    devices: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 0

    @property
    def remote_ranks(self) -> int:
        return self.world_size - len(self.devices)


class SequenceParallelGroup:
    def __init__(self, settings: GroupSettings, comfyui_root: Path):
        self.settings = settings
        self.processes: list[subprocess.Popen] = []
        self.serial = 0
        self.weights_key: tuple | None = None
        self.serial_of_weights: int | None = None  # the "load" command whose weights the workers hold
        self._meshes: dict[tuple[int, int, int], SequenceParallelMesh] = {}  # (ulysses, ring, cfg)
        self._start(comfyui_root)

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def _start(self, comfyui_root: Path) -> None:
        s = self.settings
        if dist.is_initialized():
            raise SequenceParallelError("Sequence Parallel: torch.distributed is already initialised in this process "
                                        "by something else; run ComfyUI without it")
        # rank 0 hosts the store; its port must be known before the workers start
        self._store = dist.TCPStore(s.host, s.port, world_size=None, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
        self.port = self._store.port
        for rank in range(1, len(s.devices)):
            command = [sys.executable, str(WORKER_SCRIPT), "--master", f"{s.host}:{self.port}", "--rank", str(rank),
                       "--world-size", str(s.world_size), "--backend", s.backend, "--device", s.devices[rank],
                       "--comfyui", str(comfyui_root), "--parent-pid", str(os.getpid())]
            self.processes.append(subprocess.Popen(command, stdin=subprocess.DEVNULL))
        if s.remote_ranks:
            log.warning("OmniHooks Sequence Parallel: waiting %.0f s for %d remote rank(s) at %s:%d", JOIN_TIMEOUT_S,
                        s.remote_ranks, s.host, self.port)
        try:
            self.commands = join_group(self._store, 0, s.world_size, s.backend)
        except Exception as exc:
            self.close()
            raise SequenceParallelError(
                f"Sequence Parallel: the {s.world_size - 1} other rank(s) did not join at {s.host}:{self.port} within "
                f"{JOIN_TIMEOUT_S:.0f} s ({exc}); local workers: {self._exit_codes()}") from exc

    def close(self) -> None:
        """Stop the workers (exit command, then terminate, then kill) and destroy the process group."""
        if dist.is_initialized() and self.alive():
            try:
                self.command("exit", {}, wait=False)
            except Exception:
                pass
        deadline = time.monotonic() + 5
        for p in self.processes:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        self.processes = []
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                log.exception("OmniHooks Sequence Parallel: destroying the process group failed")
        self._meshes.clear()
        self._store = None
        self.weights_key = None

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.processes)

    def _exit_codes(self) -> str:
        return ", ".join(f"rank {i + 1}: {'running' if p.poll() is None else f'exit code {p.returncode}'}"
                         for i, p in enumerate(self.processes)) or "none"

    # -- commands -------------------------------------------------------------------------------------------------

    def command(self, op: str, header: dict, payload=None, wait: bool = True) -> None:
        """Send command ``op`` to every worker and wait until each accepted it (header checked, data prepared)."""
        if not self.alive():
            raise SequenceParallelError(f"Sequence Parallel: a worker process died ({self._exit_codes()}); it is "
                                        "restarted on the next run")
        self.serial += 1
        command = Command(op, self.serial, dict(header, op=op, serial=self.serial), payload)
        self.commands.set(f"cmd/{self.serial}", encode(command))
        if self.serial > 1:
            self.commands.delete_key(f"cmd/{self.serial - 1}")
        if not wait:
            return
        deadline = time.monotonic() + ACK_TIMEOUT_S
        for rank in range(1, self.settings.world_size):
            key = f"ack/{self.serial}/{rank}"
            while not wait_for(self.commands, key, POLL_S):
                if not self.alive() or time.monotonic() > deadline:
                    raise SequenceParallelError(
                        f"Sequence Parallel: rank {rank} did not accept command {op!r} within "
                        f"{ACK_TIMEOUT_S:.0f} s (local workers: {self._exit_codes()})")
            answer = self.commands.get(key).decode()
            self.commands.delete_key(key)
            if answer != "ok":
                raise SequenceParallelError(f"Sequence Parallel: rank {rank} refused {op!r}:\n{answer}")

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


def close_group() -> None:
    global _current
    group, _current = _current, None
    if group is not None:
        try:
            group.close()
        except Exception:
            log.error("OmniHooks Sequence Parallel: closing the group failed:\n%s", traceback.format_exc())


atexit.register(close_group)
