"""The sequence-parallel plan: which module inputs are split, which outputs gathered, which attentions exchange.

A plan maps module ids to specs (after vllm-omni's ``_sp_plan``, diffusers' ``_cp_plan``):

* ``{"param": SequenceParallelInput(...), 2: SequenceParallelInput(..., split_output=True)}``: split the named forward
  inputs before the module runs (or, for an int key, that element of its output afterwards); an input that is a list
  or tuple gets a list of specs, one per element, None to leave one alone (e.g. a flag beside a table);
* ``SequenceParallelOutput(...)`` (or a list of them, one per output element, None to leave one alone): gather the
  module's output(s) from every rank afterwards;
* ``SequenceParallelSelfAttention(...)``: every attention the module calls is self-attention over the split sequence
  (queries and keys are both sharded), so the attention entry exchanges it across ranks;
* ``SequenceParallelCrossAttention(...)``: every attention the module calls has queries every rank holds whole and
  keys/values of a split sequence (e.g. a short stream attending to a long one), exchanged so that each rank gets
  every query's output over the whole sequence. Attention called anywhere else is taken as cross-attention with
  replicated keys (or with split queries and replicated keys) and runs locally.

Module ids: ``""`` is the root, dotted paths descend (``"blocks.0.attn"``, ModuleDict keys work), and one ``*`` stands
for every element of a ModuleList (``"blocks.*.attn"``).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Union

import torch

from ..base import ORIGINAL_FORWARD_ATTR
from ..blockstack import TensorArg


@dataclass(frozen=True)
class ReplicatedTokens:
    """A length source: the replicated (text) tokens of a forward input that holds them next to a split sequence,
    i.e. its length along ``dim`` minus that sequence's part in it. ``beside``:

    * ``"shard"``: the input holds this rank's shard (padded length of ``shard_group``'s sequence / world size), e.g.
      Flux's single-stream blocks, whose ``x = cat(txt, img)`` is built after the split:
      ``SequenceParallelSelfAttention(joint_tokens=ReplicatedTokens("x"))``;
    * ``"sequence"``: the input holds the whole sequence (its unpadded length), e.g. the position ids
      ``cat(txt_ids, img_ids)`` of a RoPE module whose output is split:
      ``{0: SequenceParallelPartialInput(..., split_output=True, text_len_source=ReplicatedTokens("ids",
      beside="sequence"))}``.

    The sequence of ``shard_group`` must have been split with ``auto_pad=True`` earlier in the same call (that split
    records its length).
    """

    param: str
    dim: int = 1
    shard_group: str | None = None
    beside: str = "shard"

    def __post_init__(self) -> None:
        if self.beside not in ("shard", "sequence"):
            raise ValueError(f"ReplicatedTokens: beside must be 'shard' or 'sequence', got {self.beside!r}")


# An int, the name of a forward parameter of the module (a tensor: its size along a stated dim; an int: itself),
# a function of the module's call ``(module, args, kwargs) -> int``, or ``ReplicatedTokens``.
LengthSource = Union[int, str, ReplicatedTokens, Callable[[torch.nn.Module, tuple, dict], int]]


@dataclass(frozen=True)
class SequenceParallelInput:
    """Split a forward input (string key) or, with ``split_output=True``, an output element (int key) along
    ``split_dim`` into one equal shard per rank, in rank order.

    * ``expected_dims``: only split tensors with this many dims (others pass unchanged, with a warning);
    * ``auto_pad``: pad a length the world size does not divide with zeros at the end; padded keys are dropped from
      attention and padded rows from the gathered output (``shard_group`` names the sequence the padding belongs to;
      None is the default sequence);
    * ``clone_shard``: give the shard its own storage so the full tensor can be freed;
    * ``outside_caches``: split before any cache hook on this module sees the call (the hook runs in the observation
      phase). For a model that creates its tokens inside its forward and whose first split point is the first block
      of the cached stack (Wan): the cache must see, store and skip with this rank's shard. Every input spec of one
      module must agree on it.
    * ``broadcast_length_one``: pass a tensor whose length along ``split_dim`` is 1 unchanged (one value broadcast
      over the whole sequence, e.g. a per-sample timestep of a model that also takes one per token).
    """

    split_dim: int
    expected_dims: int | None = None
    split_output: bool = False
    auto_pad: bool = False
    clone_shard: bool = False
    shard_group: str | None = None
    outside_caches: bool = False
    broadcast_length_one: bool = False


@dataclass(frozen=True)
class SequenceParallelPartialInput:
    """A tensor laid out ``[text | image]`` (``text_position="front"``) or ``[image | text]`` (``"rear"``) along
    ``split_dim``: the text part is kept whole on every rank, the image part is split, and the shard keeps the layout
    (e.g. a RoPE table over text and image positions).

    ``text_len_source``: the text length, an int, a forward parameter name (tensor: its size along ``text_len_dim``;
    int: the value), a function ``(module, args, kwargs) -> int`` or ``ReplicatedTokens``. ``auto_pad``/``shard_group``
    as for ``SequenceParallelInput``, applied to the image part.
    """

    split_dim: int
    text_len_source: LengthSource
    expected_dims: int | None = None
    split_output: bool = False
    auto_pad: bool = False
    shard_group: str | None = None
    text_len_dim: int = 0
    text_position: str = "front"

    def __post_init__(self) -> None:
        if self.text_position not in ("front", "rear"):
            raise ValueError(f"SequenceParallelPartialInput: text_position must be 'front' or 'rear', got "
                             f"{self.text_position!r}")


@dataclass(frozen=True)
class SequenceParallelObjectInput:
    """A forward input that holds per-token values in a form of the host's own rather than as a tensor (e.g. a
    table kept once per frame and expanded to tokens where it is read), split by two functions of the family:

    * ``tokens(value)``: how many tokens it holds values for, or None when it holds one value for every token (it is
      then passed unchanged);
    * ``narrow(value, start, length)``: the value for tokens ``[start, start + length)`` only; positions from
      ``tokens(value)`` on are padding (any values will do, the right length is what counts).

    Split like a ``SequenceParallelInput`` with ``auto_pad=True``: this rank gets tokens ``[rank · s, (rank + 1) · s)``
    of the length padded to a multiple of the world size (``s`` = padded length / world size), and the length is
    recorded for ``shard_group``. ``outside_caches`` as for ``SequenceParallelInput``.
    """

    tokens: Callable[[Any], int | None]
    narrow: Callable[[Any, int, int], Any]
    shard_group: str | None = None
    outside_caches: bool = False

    @property
    def auto_pad(self) -> bool:
        return True

    @property
    def split_output(self) -> bool:
        return False


@dataclass(frozen=True)
class SequenceParallelOutput:
    """Gather a module output along ``gather_dim`` from every rank (rank order) and drop the padding of
    ``shard_group`` (None: the default sequence) if its length was padded.

    ``replicated_position``: None when the output holds only this rank's shard; "front" (``[text | shard]``) or
    "rear" (``[shard | text]``) when it also holds replicated tokens, the same on every rank (e.g. the caption of a
    joint sequence): those are kept from this rank, next to the gathered sequence, in the same layout. Their length is
    the output's length minus this rank's shard of ``shard_group``, which must have been split with ``auto_pad=True``.

    ``outside_caches``: gather after any cache hook on this module has seen the output (the hook runs in the
    observation phase). For a model whose forward reshapes the stack's output before the next module, so that the
    stack's last block is where its tokens are gathered and where a cache reads the stack's output (Kandinsky 5):
    the cache must see, store and reuse this rank's shard. Every output spec of one module must agree on it.
    """

    gather_dim: int
    expected_dims: int | None = None
    shard_group: str | None = None
    replicated_position: str | None = None
    outside_caches: bool = False

    def __post_init__(self) -> None:
        if self.replicated_position not in (None, "front", "rear"):
            raise ValueError(f"SequenceParallelOutput: replicated_position must be None, 'front' or 'rear', got "
                             f"{self.replicated_position!r}")


@dataclass(frozen=True)
class SequenceParallelSelfAttention:
    """A module whose attention calls are self-attention over the split sequence (queries and keys sharded alike).

    ``joint_tokens``: how many replicated tokens (text, kept whole on every rank) the attention's sequence holds
    besides the split image tokens, at ``joint_position`` ("front": ``[text | image]``, "rear": ``[image | text]``);
    None or 0 for image-only self-attention. An int, a forward parameter name of this module (a tensor: its size
    along ``joint_tokens_dim``), a function ``(module, args, kwargs) -> int`` or ``ReplicatedTokens`` (the module
    receives ``[text | image shard]`` and nothing that tells the text length). ``shard_group``: the split sequence
    whose padding (if any) is dropped from the keys.
    """

    joint_tokens: LengthSource | None = None
    joint_tokens_dim: int = 1
    joint_position: str = "front"
    shard_group: str | None = None

    def __post_init__(self) -> None:
        if self.joint_position not in ("front", "rear"):
            raise ValueError(f"SequenceParallelSelfAttention: joint_position must be 'front' or 'rear', got "
                             f"{self.joint_position!r}")


@dataclass(frozen=True)
class SequenceParallelCrossAttention:
    """A module whose attention calls have queries every rank holds whole and keys/values that are this rank's shard
    of a split sequence (``shard_group``: its padding, if any, is dropped from the keys), e.g. LTX-2's audio attending
    to the video. Each rank gets the output of every query over the whole key sequence: with Ulysses the keys and
    values are exchanged for heads (all-to-all), every rank attends with its heads of the queries and the heads are
    all-gathered; across a ring each rank attends to the keys it holds and the partial results are all-gathered and
    merged (online softmax) in rank order, so every rank holds the same output. No mask is taken. A cross-attention
    whose keys every rank holds whole needs no entry (it runs locally, whichever way its queries are split)."""

    shard_group: str | None = None


@dataclass(frozen=True)
class SequenceParallelRefusedInput:
    """A forward input the plan cannot split (e.g. residuals over the whole sequence added between blocks): a call
    that passes it (anything but None) fails with ValueError(``reason``) on every rank alike, before the module runs
    and so before any exchange. ``reason`` should name the input, why, and the fix."""

    reason: str


InputSpec = Union[SequenceParallelInput, SequenceParallelPartialInput, SequenceParallelObjectInput]
AttentionSpec = Union[SequenceParallelSelfAttention, SequenceParallelCrossAttention]
SequenceParallelModelPlan = dict[str, Any]


def _is_input(spec: Any) -> bool:
    return isinstance(spec, (SequenceParallelInput, SequenceParallelPartialInput, SequenceParallelObjectInput))


def gathers_outside_caches(module_id: str, specs: list) -> bool:
    """Whether a module's output specs gather outside cache hooks (``SequenceParallelOutput.outside_caches``);
    ValueError when its specs disagree."""
    flags = {spec.outside_caches for spec in specs if spec is not None}
    if len(flags) > 1:
        raise ValueError(f"_sp_plan[{module_id!r}]: every output spec of one module must agree on outside_caches")
    return flags == {True}


def splits_outside_caches(module_id: str, specs: dict) -> bool:
    """Whether a module's input specs split outside cache hooks (``SequenceParallelInput.outside_caches``);
    ValueError when its specs disagree."""
    flags = {getattr(spec, "outside_caches", False)
             for value in specs.values() for spec in (value if isinstance(value, (list, tuple)) else [value])
             if spec is not None and not isinstance(spec, SequenceParallelRefusedInput)}
    if len(flags) > 1:
        raise ValueError(f"_sp_plan[{module_id!r}]: every input spec of one module must agree on outside_caches")
    return flags == {True}


def _validate_input_dict(module_id: str, specs: dict, groups: dict[str, str]) -> None:
    splits_outside_caches(module_id, specs)
    for key, value in specs.items():
        if not isinstance(key, (str, int)) or isinstance(key, bool):
            raise ValueError(f"_sp_plan[{module_id!r}]: input keys must be parameter names (str) or output indices "
                             f"(int), got {key!r}")
        if isinstance(key, int):
            if not _is_input(value) or not value.split_output:
                raise ValueError(f"_sp_plan[{module_id!r}][{key}]: an int key names an output element and needs a "
                                 "single SequenceParallelInput with split_output=True")
            elements = [value]
        elif isinstance(value, SequenceParallelRefusedInput):
            elements = []
        elif _is_input(value):
            elements = [value]
        elif isinstance(value, (list, tuple)) and any(_is_input(v) for v in value) and all(
                v is None or _is_input(v) for v in value):
            elements = [v for v in value if v is not None]
        else:
            raise ValueError(f"_sp_plan[{module_id!r}][{key!r}]: expected a SequenceParallelInput, a "
                             f"SequenceParallelPartialInput, a SequenceParallelObjectInput, a list/tuple of them (None "
                             f"for an element left alone) or a SequenceParallelRefusedInput, got {value!r}")
        for spec in elements:
            if spec.shard_group is None:
                continue
            if not spec.auto_pad:
                raise ValueError(f"_sp_plan[{module_id!r}][{key!r}]: shard_group {spec.shard_group!r} requires "
                                 "auto_pad=True")
            owner = groups.setdefault(spec.shard_group, module_id)
            if owner != module_id:
                raise ValueError(f"_sp_plan: shard_group {spec.shard_group!r} is split at multiple split boundaries "
                                 f"({owner!r} and {module_id!r}); one sequence is split at one module")


def validate_sp_plan(plan: Any) -> SequenceParallelModelPlan:
    """Check a plan's structure before any hook is installed; returns it unchanged or raises ValueError."""
    if not isinstance(plan, dict):
        raise ValueError(f"_sp_plan must be a dict of module id -> spec, got {type(plan).__name__}")
    groups: dict[str, str] = {}
    for module_id, spec in plan.items():
        if not isinstance(module_id, str):
            raise ValueError(f"_sp_plan keys must be strings (module ids, '' for the root), got {module_id!r}")
        if isinstance(spec, (SequenceParallelOutput, SequenceParallelSelfAttention, SequenceParallelCrossAttention)):
            continue
        if isinstance(spec, (list, tuple)) and spec and all(
                s is None or isinstance(s, SequenceParallelOutput) for s in spec):
            gathers_outside_caches(module_id, list(spec))
            continue
        if isinstance(spec, dict):
            _validate_input_dict(module_id, spec, groups)
            continue
        raise ValueError(f"_sp_plan values must be dict (input spec), SequenceParallelOutput (or a list of them), "
                         f"SequenceParallelSelfAttention or SequenceParallelCrossAttention; got {spec!r} for "
                         f"{module_id!r}")
    return plan


def get_sp_plan_from_model(model: torch.nn.Module) -> SequenceParallelModelPlan | None:
    """``model._sp_plan`` validated, or None when the model has none."""
    plan = getattr(model, "_sp_plan", None)
    return None if plan is None else validate_sp_plan(plan)


def resolve_submodules(model: torch.nn.Module, module_id: str) -> list[torch.nn.Module]:
    """The module(s) a plan id names: ``""`` the root, dotted atoms, one ``*`` over a ModuleList's elements."""
    if module_id.count("*") > 1:
        raise ValueError(f"_sp_plan id {module_id!r}: the wildcard '*' can only be used once")
    current = [model]
    for atom in (module_id.split(".") if module_id else []):
        following = []
        for module in current:
            if atom == "*":
                if not isinstance(module, torch.nn.ModuleList):
                    raise ValueError(f"_sp_plan id {module_id!r}: wildcard '*' can only be used with ModuleList, "
                                     f"{type(module).__name__} is not one")
                following.extend(module)
                continue
            child = module._modules.get(atom)
            if child is None:
                raise ValueError(f"_sp_plan id {module_id!r}: {atom!r} is not a submodule of "
                                 f"{type(module).__name__}")
            following.append(child)
        current = following
    return current


def unwrap_module(module: torch.nn.Module) -> torch.nn.Module:
    """The module whose forward really runs under known wrappers (torch.compile's ``_orig_mod``, DDP/FSDP's
    ``module``); any other module is itself (a block with a single child is not a wrapper)."""
    while True:
        inner = module._modules.get("_orig_mod")
        if inner is None and type(module).__name__ in ("DistributedDataParallel", "FullyShardedDataParallel"):
            inner = module._modules.get("module")
        if inner is None:
            return module
        module = inner


class ModuleForwardMetadata:
    """Where a module's forward parameters sit in a call: by keyword, else by position (from the signature)."""

    def __init__(self, module: torch.nn.Module):
        target = unwrap_module(module)
        forward = target.__dict__.get(ORIGINAL_FORWARD_ATTR, target.forward)
        parameters = inspect.signature(forward).parameters.values()
        self.module_name = type(target).__name__
        self.cached_parameter_indices: dict[str, int | None] = {}
        self.accepts_any_keyword = False
        position = 0
        for p in parameters:
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                self.cached_parameter_indices[p.name] = position
                position += 1
            elif p.kind is p.KEYWORD_ONLY:
                self.cached_parameter_indices[p.name] = None
            elif p.kind is p.VAR_KEYWORD:
                self.accepts_any_keyword = True

    def check(self, name: str) -> None:
        """Raise ValueError when ``name`` cannot be a parameter of this forward."""
        if name not in self.cached_parameter_indices and not self.accepts_any_keyword:
            raise ValueError(f"parameter {name!r} not found in the forward signature of {self.module_name} "
                             f"(parameters: {', '.join(self.cached_parameter_indices) or 'none'})")

    def argument(self, name: str) -> TensorArg:
        """Where ``name`` is found (keyword first, then its position; index -1 if keyword-only)."""
        self.check(name)
        index = self.cached_parameter_indices.get(name)
        return TensorArg(name, -1 if index is None else index)

    def lookup(self, name: str, args: tuple, kwargs: dict) -> Any:
        """The argument passed for ``name`` in this call, or None if it was not passed."""
        arg = self.argument(name)
        if name in kwargs:
            return kwargs[name]
        return args[arg.index] if 0 <= arg.index < len(args) else None


def resolve_length(source: LengthSource, dim: int, metadata: ModuleForwardMetadata, module: torch.nn.Module,
                   args: tuple, kwargs: dict, what: str,
                   split_length: Callable[[str | None, str], int] | None = None) -> int:
    """Resolve a ``LengthSource`` for one call of ``module``; ValueError naming ``what`` if it cannot.

    ``split_length(shard_group, part)``: the length of a split sequence's ``part`` ("shard" or "sequence") in the
    current call (the run's ``split_length``), needed by ``ReplicatedTokens`` sources.
    """
    try:
        if isinstance(source, ReplicatedTokens):
            value = metadata.lookup(source.param, args, kwargs)
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"parameter {source.param!r} is not a tensor (got {type(value).__name__})")
            if split_length is None:
                raise ValueError("ReplicatedTokens needs the run's split_length")
            value = value.shape[source.dim] - split_length(source.shard_group, source.beside)
        elif callable(source):
            value = source(module, args, kwargs)
        elif isinstance(source, str):
            value = metadata.lookup(source, args, kwargs)
            if value is None:
                raise ValueError(f"parameter {source!r} was not passed")
            if isinstance(value, torch.Tensor):
                value = value.shape[dim]
        else:
            value = source
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"expected a length >= 0 (int or tensor), got {value!r}")
        return value
    except Exception as exc:
        raise ValueError(f"Failed to resolve {what} {source!r} on {metadata.module_name}: {exc}") from exc
