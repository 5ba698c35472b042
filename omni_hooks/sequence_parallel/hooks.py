"""The split, gather and attention-site hooks, and ``apply_sequence_parallel``/``remove_sequence_parallel``.

All three hooks are of the sharding phase (``HookPhase.SHARDING``): on one module they run inside any cache hook and
outside any placement (offload) hook, whatever their names, so a cache always sees this rank's shard and stores its
residual, and a gather sees what the cache produced (docs/design.md, "Which features compose, and why"; diffusers'
context-parallel hooks, vllm-omni's ``SequenceParallelSplitHook``/``GatherHook``). A split or gather the plan marks
``outside_caches`` runs in the observation phase instead, outside any cache hook on its module.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from ..base import REGISTRY_ATTR, HookPhase, HookRegistry, ModelHook, module_has_active_hooks, remove_hook_and_restore
from .config import SequenceParallelConfig
from .mesh import SequenceParallelMesh
from .plan import (
    InputSpec,
    ModuleForwardMetadata,
    ReplicatedTokens,
    SequenceParallelCrossAttention,
    SequenceParallelInput,
    SequenceParallelModelPlan,
    SequenceParallelObjectInput,
    SequenceParallelOutput,
    SequenceParallelPartialInput,
    SequenceParallelRefusedInput,
    SequenceParallelSelfAttention,
    gathers_outside_caches,
    resolve_length,
    resolve_submodules,
    splits_outside_caches,
    validate_sp_plan,
)
from .run import ActiveSite, SequenceParallelRun
from .sharding import PaddingRecord, pad_to, padded_length, shard

log = logging.getLogger("omni_hooks")

GATHER_KIND = "output_all_gather"
SPLIT_PREFIX, GATHER_PREFIX, SITE_PREFIX = "sp_input---", "sp_output---", "sp_attention---"
BATCH_HOOK = "sp_batch---"


def _dims_match(hook: ModelHook, x: torch.Tensor, expected: int | None, what: str) -> bool:
    if expected is None or x.dim() == expected:
        return True
    key = (what, x.dim())
    if key not in hook._warned:
        hook._warned.add(key)
        log.warning("omni_hooks sequence parallel: %s has %d dims, the plan expects %d; left as it is", what,
                    x.dim(), expected)
    return False


class SequenceParallelHook(ModelHook):
    """What the three hooks share: the sharding phase, the run, their plan entry and where it sits."""

    phase = HookPhase.SHARDING

    def __init__(self, run: SequenceParallelRun, spec: Any, module_id: str):
        self.run = run
        self.spec = spec
        self.module_id = module_id
        self.module_forward_metadata: ModuleForwardMetadata | None = None
        self._warned: set = set()


class SequenceParallelSplitHook(SequenceParallelHook):
    """Splits a module's planned inputs before it runs (and ``split_output`` elements of its output after).
    ``spec``: the plan's dict of parameter name / output index -> input spec."""

    def __init__(self, run: SequenceParallelRun, spec: dict, module_id: str):
        super().__init__(run, spec, module_id)
        self._call: tuple[tuple, dict] = ((), {})
        self._recorded: dict[str | None, PaddingRecord] = {}

    def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        self.module_forward_metadata = ModuleForwardMetadata(module)
        for name in self.spec:
            if isinstance(name, str):
                try:
                    self.module_forward_metadata.check(name)
                except ValueError as exc:
                    raise ValueError(f"apply_sequence_parallel: _sp_plan[{self.module_id!r}]: {exc}") from None
        return module

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        metadata = self.module_forward_metadata
        self._call = (args, kwargs)
        self._recorded = {}
        for name, spec in self.spec.items():
            if isinstance(spec, SequenceParallelRefusedInput):
                if metadata.lookup(name, args, kwargs) is not None:
                    raise ValueError(spec.reason)
                continue
            if isinstance(name, int) or (not isinstance(spec, (list, tuple)) and spec.split_output):
                continue
            value = metadata.lookup(name, args, kwargs)
            if value is None:
                for s in (spec if isinstance(spec, (list, tuple)) else [spec]):
                    if s is not None and s.auto_pad:  # not passed this call: no padding of its sequence to remember
                        self.run.padding.pop(s.shard_group, None)
                continue
            if isinstance(spec, SequenceParallelObjectInput):
                new = self._split_object(value, spec, name)
            elif isinstance(value, torch.Tensor):
                if isinstance(spec, (list, tuple)):
                    raise ValueError(f"{self._where(name)}: a tensor was passed, the plan has a list of specs")
                new = self._split(module, value, spec, name)
            elif isinstance(value, (list, tuple)):
                new = self._split_sequence(module, value, spec, name)
            else:
                raise ValueError(f"{self._where(name)}: unsupported input type for sharding: {type(value).__name__}")
            args, kwargs = metadata.argument(name).replace(args, kwargs, new)
        return args, kwargs

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        indices = [i for i in self.spec if isinstance(i, int)]
        if not indices:
            return output
        single = isinstance(output, torch.Tensor)
        outputs = [output] if single else list(output)
        for i in indices:
            if i >= len(outputs):
                raise ValueError(f"{self._where(i)}: index {i} out of bounds for {len(outputs)} output(s)")
            if not isinstance(outputs[i], torch.Tensor):
                raise ValueError(f"{self._where(i)}: output {i} is a {type(outputs[i]).__name__}, not a tensor")
            outputs[i] = self._split(module, outputs[i], self.spec[i], f"output {i}")
        return outputs[0] if single else type(output)(outputs)

    def _where(self, name: str | int) -> str:
        return f"sequence-parallel split of {name!r} at {self.module_id!r}"

    def _split_sequence(self, module: torch.nn.Module, values: list | tuple, spec: Any, name: str) -> list | tuple:
        if not isinstance(spec, (list, tuple)):
            raise ValueError(f"Expected list/tuple of SequenceParallelInput for parameter {name!r} at "
                             f"{self.module_id!r}")
        if len(spec) != len(values):
            raise ValueError(f"Expected {len(spec)} elements for parameter {name!r} at {self.module_id!r}, got "
                             f"{len(values)}")
        out = [self._split(module, v, s, f"{name}[{i}]")
               if s is not None and isinstance(v, torch.Tensor) and not s.split_output else v
               for i, (v, s) in enumerate(zip(values, spec))]
        return type(values)(out)

    def _record(self, spec: InputSpec, length: int, name: str | int) -> PaddingRecord:
        """The padding of an ``auto_pad`` split of ``length`` tokens, recorded for its shard group (ValueError when
        another input of the group held another length in this call)."""
        record = PaddingRecord(length, padded_length(length, self.run.world_size))
        earlier = self._recorded.setdefault(spec.shard_group, record)
        if earlier != record:
            raise ValueError(f"{self._where(name)}: {record.original_len} tokens, but another input of "
                             f"shard_group {spec.shard_group!r} had {earlier.original_len}; tensors of one "
                             "shard group must hold the same sequence")
        self.run.padding[spec.shard_group] = record
        return record

    def _split_object(self, value: Any, spec: SequenceParallelObjectInput, name: str) -> Any:
        length = spec.tokens(value)
        if length is None:
            return value
        record = self._record(spec, length, name)
        size = record.padded_len // self.run.world_size
        return spec.narrow(value, self.run.rank * size, size)

    def _split(self, module: torch.nn.Module, x: torch.Tensor, spec: InputSpec, name: str | int) -> torch.Tensor:
        if not _dims_match(self, x, spec.expected_dims, f"{name!r} at {self.module_id!r}"):
            return x
        dim = spec.split_dim % x.dim()
        if x.shape[dim] == 0:
            return x
        if isinstance(spec, SequenceParallelInput) and spec.broadcast_length_one and x.shape[dim] == 1:
            return x
        text = None
        text_front = True
        if isinstance(spec, SequenceParallelPartialInput):
            args, kwargs = self._call
            text_len = resolve_length(spec.text_len_source, spec.text_len_dim, self.module_forward_metadata, module,
                                      args, kwargs, "text_len_source", self.run.split_length)
            if text_len > x.shape[dim]:
                raise ValueError(f"{self._where(name)}: text length {text_len} exceeds the tensor's {x.shape[dim]}")
            text_front = spec.text_position == "front"
            image_len = x.shape[dim] - text_len
            if text_front:
                text, x = x.narrow(dim, 0, text_len), x.narrow(dim, text_len, image_len)
            else:
                text, x = x.narrow(dim, image_len, text_len), x.narrow(dim, 0, image_len)
        world = self.run.world_size
        if spec.auto_pad:
            x = pad_to(x, dim, self._record(spec, x.shape[dim], name).padded_len)
        part = shard(x, dim, world, self.run.rank, self._where(name))
        if text is not None:
            part = torch.cat([text, part] if text_front else [part, text], dim)
        elif isinstance(spec, SequenceParallelInput) and spec.clone_shard:
            part = part.clone(memory_format=torch.contiguous_format)
        return part


class SequenceParallelSplitOutsideCachesHook(SequenceParallelSplitHook):
    """A split hook in the observation phase, so that cache hooks on the same module see this rank's shard (plan
    input specs with ``outside_caches=True``)."""

    phase = HookPhase.OBSERVATION


class SequenceParallelGatherHook(SequenceParallelHook):
    """Gathers a module's planned output(s) from every rank, dropping padding, after it runs. ``spec``: one
    ``SequenceParallelOutput`` (or None) per output element."""

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        single = isinstance(output, torch.Tensor)
        if not single and not (isinstance(output, (list, tuple))
                               and all(o is None or isinstance(o, torch.Tensor) for o in output)):
            raise ValueError(f"sequence-parallel gather at {self.module_id!r}: the output must be a tensor or a "
                             f"list/tuple of tensors, got {type(output).__name__}")
        outputs = [output] if single else list(output)
        if len(outputs) != len(self.spec):
            raise ValueError(f"sequence-parallel gather at {self.module_id!r}: Expected {len(self.spec)} outputs, "
                             f"got {len(outputs)}.")
        for i, spec in enumerate(self.spec):
            x = outputs[i]
            if spec is None or x is None or not _dims_match(self, x, spec.expected_dims,
                                                            f"output {i} at {self.module_id!r}"):
                continue
            dim = spec.gather_dim % x.dim()
            replicated = None
            if spec.replicated_position is not None:
                shard_len = self.run.split_length(spec.shard_group, "shard")
                text_len = x.shape[dim] - shard_len
                front = spec.replicated_position == "front"
                replicated = x.narrow(dim, 0 if front else shard_len, text_len)
                x = x.narrow(dim, text_len if front else 0, shard_len)
            gathered = self.run.sp_comm.all_gather(x, dim, GATHER_KIND)
            record = self.run.padding.get(spec.shard_group)  # per output: its own sequence's length
            if record is not None and gathered.shape[dim] > record.original_len:
                gathered = gathered.narrow(dim, 0, record.original_len)
            if replicated is not None:
                parts = (replicated, gathered) if spec.replicated_position == "front" else (gathered, replicated)
                gathered = torch.cat(parts, dim)
            outputs[i] = gathered
        return outputs[0] if single else type(output)(outputs)


class SequenceParallelGatherOutsideCachesHook(SequenceParallelGatherHook):
    """A gather hook in the observation phase, so that cache hooks on the same module see and replace this rank's
    shard of the output (plan output specs with ``outside_caches=True``)."""

    phase = HookPhase.OBSERVATION


class SequenceParallelSelfAttentionHook(SequenceParallelHook):
    """Marks the module's forward as an attention site for the run's attention entry. ``spec``: its
    ``SequenceParallelSelfAttention`` or ``SequenceParallelCrossAttention``."""

    def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        self.module_forward_metadata = ModuleForwardMetadata(module)
        joint = getattr(self.spec, "joint_tokens", None)
        if isinstance(joint, (str, ReplicatedTokens)):
            self.module_forward_metadata.check(joint if isinstance(joint, str) else joint.param)
        return module

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        joint = 0
        if getattr(self.spec, "joint_tokens", None) is not None:
            joint = resolve_length(self.spec.joint_tokens, self.spec.joint_tokens_dim, self.module_forward_metadata,
                                   module, args, kwargs, "joint_tokens", self.run.split_length)
        self.run.enter_site(ActiveSite(self.spec, joint, module))
        return args, kwargs

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        self.run.leave_site(module)
        return output

    def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
        self.run.leave_site(module)
        return module


class SequenceParallelBatchHook(ModelHook):
    """CFG parallel, on the plan's root: this rank's part of the call's batch in, every part's output out (see
    ``SequenceParallelRun.split_batch``). Of the observation phase: outside every other hook on the root, so the
    sequence split and any cache there see the part."""

    phase = HookPhase.OBSERVATION

    def __init__(self, run: SequenceParallelRun):
        self.run = run
        self.names: list[str] = []

    def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        metadata = ModuleForwardMetadata(module)
        self.names = [n for n, i in metadata.cached_parameter_indices.items() if i is not None]  # in position order
        return module

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        return self.run.split_batch(args, kwargs, self.names)

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        return self.run.gather_batch(output)


def _hooks_for(module_id: str, spec: Any) -> tuple[str, type, Any]:
    if isinstance(spec, dict):
        split_cls = (SequenceParallelSplitOutsideCachesHook if splits_outside_caches(module_id, spec)
                     else SequenceParallelSplitHook)
        return SPLIT_PREFIX + module_id, split_cls, spec
    if isinstance(spec, (SequenceParallelSelfAttention, SequenceParallelCrossAttention)):
        return SITE_PREFIX + module_id, SequenceParallelSelfAttentionHook, spec
    if isinstance(spec, (SequenceParallelOutput, list, tuple)):
        specs = [spec] if isinstance(spec, SequenceParallelOutput) else list(spec)
        if not all(s is None or isinstance(s, SequenceParallelOutput) for s in specs):
            raise ValueError(f"Expected SequenceParallelOutput elements (or None) for {module_id!r}, got {spec!r}")
        gather_cls = (SequenceParallelGatherOutsideCachesHook if gathers_outside_caches(module_id, specs)
                      else SequenceParallelGatherHook)
        return GATHER_PREFIX + module_id, gather_cls, specs
    raise ValueError(f"Unsupported plan type for {module_id!r}: {type(spec).__name__}")


def apply_sequence_parallel(module: torch.nn.Module, config: SequenceParallelConfig, plan: SequenceParallelModelPlan,
                            *, mesh: SequenceParallelMesh | None = None,
                            batch_hook: bool = True) -> SequenceParallelRun:
    """Register the plan's hooks on ``module`` and return the run that drives them.

    ``mesh`` None builds it from torch.distributed (``SequenceParallelMesh.from_config``: collective, call on every
    rank). Errors (plan, unknown parameter names, a missing submodule, a conflicting hook) leave the model as it was.
    The host then installs ``run.attention`` in its attention-override seam and passes ``run.rank_view()``
    in each call's ``CallContext``. With ``config.cfg_degree`` > 1 a batch hook on ``module`` itself splits each
    call's batch between the cfg halves and gathers the output (``SequenceParallelRun.split_batch``), unless
    ``batch_hook`` is False: a host whose call reaches the module's hooks before it can act (ComfyUI's wrappers run
    inside the root forward) then calls ``split_batch``/``gather_batch`` itself around the forward.
    ``remove_sequence_parallel(module, plan)`` undoes it.
    """
    validate_sp_plan(plan)
    run = SequenceParallelRun(config, mesh)
    planned = []
    if config.cfg_degree > 1 and batch_hook:
        planned.append((module, BATCH_HOOK, lambda rt, spec, module_id: SequenceParallelBatchHook(rt), None, ""))
    for module_id, spec in plan.items():
        name, hook_cls, hook_spec = _hooks_for(module_id, spec)
        planned += [(target, name, hook_cls, hook_spec, module_id) for target in resolve_submodules(module,
                                                                                                    module_id)]
    installed: list[tuple[torch.nn.Module, str]] = []
    try:
        for target, name, hook_cls, hook_spec, module_id in planned:
            registry = HookRegistry.get_or_create(target)
            try:
                registry.register_hook(name, hook_cls(run, hook_spec, module_id))
            finally:
                _drop_empty_registry(target)
            installed.append((target, name))
    except Exception:
        for target, name in reversed(installed):
            remove_hook_and_restore(target, name)
        raise
    return run


def _drop_empty_registry(module: torch.nn.Module) -> None:
    """Undo ``get_or_create`` on a module whose registration failed, if it holds no other hook."""
    registry = module.__dict__.get(REGISTRY_ATTR)
    if registry is not None and not module_has_active_hooks(module):
        registry.reset()


def remove_sequence_parallel(module: torch.nn.Module, plan: SequenceParallelModelPlan) -> None:
    """Remove the hooks ``apply_sequence_parallel(module, config, plan)`` registered; a module left without hooks is
    restored exactly. Modules without a registry are skipped."""
    validate_sp_plan(plan)
    remove_hook_and_restore(module, BATCH_HOOK)
    for module_id, spec in plan.items():
        name = _hooks_for(module_id, spec)[0]
        for target in resolve_submodules(module, module_id):
            remove_hook_and_restore(target, name)
