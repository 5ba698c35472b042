"""A sequence-parallel worker rank's state and what it does with each command of rank 0 (``worker.py`` is the
process around it: joining, the command loop, exit).

The worker builds the model class from rank 0's config into a ComfyUI ``ModelPatcher`` of its own (loaded the way
ComfyUI loads it on rank 0, lowvram included) and mirrors rank 0's run: a ``SamplingRun`` with the same caches and
offload (their kinds from the one list rank 0 uses, ``features.FEATURE_MODULES``), where rank 0 has its Sequence
Parallel session a ``WorkerShardSession``, and every call through ``features.run_call``, so the caches decide on the
same ``CallContext`` (step, branches, the group's ``RankView``).
"""
from __future__ import annotations

import importlib

import comfy.model_management
import comfy.model_patcher
import comfy.supported_models_base
import torch

from ...omni_hooks.sequence_parallel import SequenceParallelConfig, SequenceParallelMesh
from ..families import DetectedModel, detect, family_named
from ..features import AppliedFeature, SamplingRun, run_call
from .shard import KIND, ShardSession
from .protocol import OPTIONS_SLOT, Command, broadcast_tensors, tensor_signature, to_device


class WorkerRank:
    """One worker rank. Each command is ``prepare``d (checks; may refuse, before the ack) then ``execute``d (its
    collectives, in step with every other rank)."""

    def __init__(self, device: str):
        self.device = torch.device(device)
        self.patcher: comfy.model_patcher.ModelPatcher | None = None
        self.family = None
        self.meshes: dict[tuple[int, int, int], SequenceParallelMesh] = {}  # (ulysses, ring, cfg)
        self.weights_serial: int | None = None
        self.degrees: tuple[int, int, int] | None = None  # of the call being run
        self.sampling_run: SamplingRun | None = None
        self.run_id: str | None = None

    def prepare(self, command: Command) -> None:
        if command.op == "load":
            self.end_run("success")
            self._build(command)
        elif command.op == "call":
            args, kwargs, _, applied = command.payload
            if tensor_signature((args, kwargs)) != command.header["signature"]:
                raise ValueError("Sequence Parallel worker: the call's tensors do not match its header")
            if self.patcher is None or command.header["weights"] != self.weights_serial:
                raise ValueError("Sequence Parallel worker: no model loaded for this call")
            if tuple(command.header["degrees"]) not in self.meshes:
                raise ValueError(f"Sequence Parallel worker: no mesh for degrees {command.header['degrees']}")
            if command.header["run"] != self.run_id:
                if applied is None:
                    raise ValueError("Sequence Parallel worker: a call of a run whose first call it did not take")
                self._open_run(command.header["run"], applied)

    def execute(self, command: Command) -> None:
        if command.op == "mesh":
            key = (command.header["ulysses"], command.header["ring"], command.header["cfg"])
            self.meshes[key] = SequenceParallelMesh.from_config(SequenceParallelConfig(*key))
        elif command.op == "load":
            broadcast_tensors(list(self.patcher.model.diffusion_model.state_dict().values()))
            self.weights_serial = command.serial
        elif command.op == "call":
            if command.broadcast:
                broadcast_tensors(list(command.broadcast))  # the call's large tensors, received in place
            self.degrees = tuple(command.header["degrees"])
            payload = command.payload if self.device.type == "cpu" else to_device(command.payload, self.device)
            args, kwargs, options, _ = payload
            args = tuple(options if _is_options_slot(a) else a for a in args)
            kwargs = {k: options if _is_options_slot(v) else v for k, v in kwargs.items()}
            dm = self.patcher.model.diffusion_model
            with torch.inference_mode():
                run_call(self.sampling_run, dm, dm.forward, args, kwargs, options)
        elif command.op == "end":
            if command.header["run"] == self.run_id:
                self.end_run(command.header["status"])

    def _open_run(self, run_id: str, applied: tuple[AppliedFeature, ...]) -> None:
        self.end_run("success")
        comfy.model_management.load_models_gpu([self.patcher])
        sampling_run = SamplingRun(patcher=self.patcher, detected=detect(self.patcher))
        self.sampling_run, self.run_id = sampling_run, run_id
        sampling_run.open(applied, factories={KIND: lambda patcher, feature, detected: WorkerShardSession(
            self, patcher, feature, detected)})
        sampling_run.after_load(self.patcher, None)

    def end_run(self, status: str) -> None:
        """Close the current run's sessions (hooks removed, offload restored)."""
        sampling_run, self.sampling_run, self.run_id = self.sampling_run, None, None
        if sampling_run is not None:
            sampling_run.close(status)

    def _build(self, command: Command) -> None:
        payload = command.payload
        self.patcher = None
        module, qualname = payload["config_class"]
        if not isinstance(module, str) or module.split(".")[0] != "comfy":
            raise ValueError(f"Sequence Parallel worker: {module!r} is not a module of ComfyUI")
        config_class = getattr(importlib.import_module(module), qualname, None)
        if not (isinstance(config_class, type) and issubclass(config_class, comfy.supported_models_base.BASE)):
            raise ValueError(f"Sequence Parallel worker: {module}.{qualname} is not a ComfyUI model config")
        config = config_class(payload["unet_config"])
        config.set_inference_dtype(payload["unet_dtype"], payload["manual_cast_dtype"])
        base_model = config.get_model({}, "", device=torch.device("cpu")).eval()
        names = [(name, tuple(t.shape), str(t.dtype)) for name, t in base_model.diffusion_model.state_dict().items()]
        if names != command.header["names"]:
            raise ValueError("Sequence Parallel worker: the model built from the config has other weights than rank "
                             "0's (the two ComfyUI versions differ?)")
        self.family = family_named(payload["family"])
        self.patcher = comfy.model_patcher.ModelPatcher(base_model, load_device=self.device,
                                                        offload_device=torch.device("cpu"))


def _is_options_slot(value) -> bool:
    return isinstance(value, str) and value == OPTIONS_SLOT  # never compared with a tensor (an element-wise op)


class WorkerShardSession(ShardSession):
    """A worker's side of the Sequence Parallel feature in a run: installed with the degrees and mesh of the call
    rank 0 sent."""

    def __init__(self, worker: WorkerRank, patcher, feature: AppliedFeature, detected: DetectedModel):
        super().__init__(patcher, feature, detected)
        self.worker = worker

    def install(self, diffusion_model: torch.nn.Module) -> None:
        degrees = self.worker.degrees
        self.install_shard(diffusion_model, self.worker.family, SequenceParallelConfig(*degrees),
                           self.worker.meshes[degrees])
