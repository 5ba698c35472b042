"""Model drift, checked when a run starts: what a family's code assumes about the loaded model against the model.

A newer ComfyUI may change model code under the pack: a block's forward gains a parameter, a RoPE table becomes a
tensor where it was a pair. ``check_model`` compares the family's ``Expectations`` (declared in its file) with the
loaded diffusion model, without calling it and without changing anything:

  * each block-stack attribute exists, is a non-empty ModuleList, and its blocks' forward has the parameters the
    family knows (none lost, the ones the pack reads by position where it reads them, no new required one);
  * the diffusion model's forward (the DIFFUSION_MODEL call) likewise;
  * with Sequence Parallel: the family's plan is valid, every split point names modules of this model, every input it
    names is a parameter of that module's forward, and each declared plan input probe yields the type (tensor, or a
    list of as many tensors as the plan has specs) and dims the plan's specs expect, or, for an input of the host's
    own kind (``SequenceParallelObjectInput``), a value whose length the family's function reads.

A difference is drift: the run stops with a ``ModelDriftError`` before any hook is installed or any rank exchanges
anything. A forward taking ``*args`` / ``**kwargs`` the family does not expect is followed when it is a wrapper that
passes its call through (``nodes.families.pass_through``): the function it calls is checked in its place. What cannot be
decided (such a forward that is no pass-through, so which arguments reach the block is unknown) is not guessed: a cache
then computes every step and its statistics say why. For the sequence plan there is no such fallback (ranks that split
on a guess may wait on each other forever): a plan input that cannot be checked is a difference.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

from ...omni_hooks.sequence_parallel.plan import (ModuleForwardMetadata, ReplicatedTokens, SequenceParallelObjectInput,
                                                 resolve_submodules, unwrap_module, validate_sp_plan)
from . import ModelFamily, pass_through
from .base import ForwardParameters, dotted_attribute

TESTED = "0.3.64 to 0.33.0"     # the ComfyUI versions every test passes on (docs/compatibility.md)
MODEL = "model"                  # a finding about the blocks or the call: every feature relies on them
SEQUENCE_PLAN = "sequence plan"  # a finding about the sequence plan: Sequence Parallel relies on it


class ModelDriftError(RuntimeError):
    """The loaded model is not what the pack was written for (raised before anything was installed)."""


@dataclass(frozen=True)
class Finding:
    scope: str   # MODEL or SEQUENCE_PLAN
    what: str


@dataclass
class DriftReport:
    """What ``check_model`` found: ``differences`` (drift: the run must not start) and ``undecided`` (could not be
    checked: nothing is guessed; only ever about the blocks or the call, see the module docstring)."""

    family: ModelFamily
    differences: list[Finding] = field(default_factory=list)
    undecided: list[Finding] = field(default_factory=list)

    def error(self, nodes: str, scopes: tuple[str, ...] = (MODEL, SEQUENCE_PLAN)) -> ModelDriftError | None:
        """The error naming ``nodes``, the family, the ComfyUI version and each difference in ``scopes`` (None when
        there is none)."""
        found = [f.what for f in self.differences if f.scope in scopes]
        if not found:
            return None
        return ModelDriftError(
            f"{nodes}: the {self.family.display_name} model of {comfyui_version()} is not the one OmniHooks was "
            f"written for: {'; '.join(found)}. Nothing was applied to the model. Update "
            f"ComfyUI-OmniHooks, or use a ComfyUI it was tested with ({TESTED}); docs/compatibility.md says what "
            f"is checked.")


def comfyui_version() -> str:
    """"ComfyUI <version>" from the host's ``comfyui_version`` module ("this ComfyUI (version unknown)" without)."""
    try:
        from comfyui_version import __version__
    except Exception:
        return "this ComfyUI (version unknown)"
    return f"ComfyUI {__version__}"


def check_model(family: ModelFamily, dm: torch.nn.Module, sequence_parallel: bool = False) -> DriftReport:
    """Compare ``family.expects`` with ``dm`` (and its sequence plan when ``sequence_parallel``). Changes nothing."""
    report = DriftReport(family)
    expects = family.expects
    if expects is None:
        return report
    for attr, forward in expects.blocks.items():
        stack = dotted_attribute(dm, attr)
        if not isinstance(stack, torch.nn.ModuleList) or len(stack) == 0:
            what = ("is missing" if stack is None else "is empty" if isinstance(stack, torch.nn.ModuleList)
                    else f"is a {type(stack).__name__}, not a ModuleList")
            report.differences.append(Finding(MODEL, f"the block stack {attr!r} {what}"))
            continue
        instances: dict[type, torch.nn.Module] = {}
        for block in stack:
            instances.setdefault(type(unwrap_module(block)), unwrap_module(block))
        for cls, block in instances.items():
            _compare(report, MODEL, f"{attr}.* ({cls.__name__}.forward)", cls.forward, forward, block)
    _compare(report, MODEL, f"the model call ({type(dm).__name__}.forward)", type(dm).forward, expects.call, dm)
    if sequence_parallel and family.sequence_plan is not None:
        _check_plan(report, family, dm)
    return report


def _signature_names(fn) -> tuple[list[inspect.Parameter], list[str]]:
    parameters = list(pass_through.own_signature(fn).parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if parameters and parameters[0].kind in positional:
        parameters = parameters[1:]  # an unbound method: drop self
    names = []
    for p in parameters:
        prefix = "*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else ""
        names.append(prefix + p.name)
    return parameters, names


def _opaque(parameters: list[inspect.Parameter], names: list[str], expected: ForwardParameters) -> list[str]:
    """The ``*args`` / ``**kwargs`` of a forward that the family does not expect there."""
    return [name for p, name in zip(parameters, names)
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and name not in expected.params]


def _compare(report: DriftReport, scope: str, where: str, fn, expected: ForwardParameters,
             instance: torch.nn.Module) -> None:
    def opaque(f) -> bool:
        try:
            return bool(_opaque(*_signature_names(f), expected))
        except (TypeError, ValueError):
            return False

    # a wrapper that passes its call through (other custom nodes, profilers) is not drift: check what it calls
    followed = pass_through.follow(fn, instance, opaque, pass_through.sample_call(expected.params, expected.positions))
    fn = followed.function
    if followed.wrappers:
        where = f"{where}, wrapped by {', '.join(followed.wrappers)},"
    try:
        parameters, names = _signature_names(fn)
    except (TypeError, ValueError) as e:
        report.undecided.append(Finding(scope, f"{where} has no readable signature ({e})"))
        return
    hidden = _opaque(parameters, names, expected)
    if hidden:  # any argument may reach it through these: neither a loss nor a move can be told
        report.undecided.append(Finding(scope, f"{where} takes {' and '.join(hidden)}, which OmniHooks does not "
                                               f"know: what its calls pass cannot be checked "
                                               f"({pass_through.qualified_name(fn)}: {followed.problem})"))
        return
    for name in expected.params:
        if name not in names:
            report.differences.append(Finding(scope, f"{where} has no parameter {name!r} any more"))
    positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for name, index in expected.positions.items():
        if name in positional and positional.index(name) != index:
            report.differences.append(Finding(scope, f"{where} takes {name!r} as argument {positional.index(name)}, "
                                                     f"where OmniHooks reads it as argument {index}"))
    for p, name in zip(parameters, names):
        if name in expected.params:
            continue
        if p.default is p.empty:  # (a *args / **kwargs here is one the family declares)
            report.differences.append(Finding(scope, f"{where} gained a required parameter {p.name!r}"))


def _plan_names(spec: Any) -> list[str]:
    """The forward parameters a plan entry reads by name (inputs, joint token and text length sources)."""
    names: list[str] = []
    if isinstance(spec, dict):
        names += [key for key in spec if isinstance(key, str)]
        specs = [s for value in spec.values() for s in (value if isinstance(value, (list, tuple)) else [value])]
    else:
        specs = [spec]
    for s in specs:
        for source in (getattr(s, "joint_tokens", None), getattr(s, "text_len_source", None)):
            if isinstance(source, ReplicatedTokens):
                names.append(source.param)
            elif isinstance(source, str):
                names.append(source)
    return names


def _check_plan(report: DriftReport, family: ModelFamily, dm: torch.nn.Module) -> None:
    plan = family.sequence_plan(dm)  # a family's own refusal (ValueError naming the node's fix) is raised as it is
    try:
        validate_sp_plan(plan)
    except ValueError as e:
        report.differences.append(Finding(SEQUENCE_PLAN, f"the plan is not valid ({e})"))
        return
    for module_id, spec in plan.items():
        try:
            modules = resolve_submodules(dm, module_id)
        except ValueError as e:
            report.differences.append(Finding(SEQUENCE_PLAN, f"split point {module_id!r}: {e}"))
            continue
        if not modules:
            report.differences.append(Finding(SEQUENCE_PLAN, f"split point {module_id!r} names no module"))
            continue
        for module in {type(unwrap_module(m)): m for m in modules}.values():
            metadata = ModuleForwardMetadata(module)
            for name in dict.fromkeys(_plan_names(spec)):
                if name in metadata.cached_parameter_indices:
                    continue
                where = f"{module_id or 'the model'} ({metadata.module_name}.forward)"
                # undecided is a difference here: ranks splitting on a guess could wait on each other forever
                why = (f"takes **kwargs, so where its {name!r} is cannot be checked" if metadata.accepts_any_keyword
                       else f"has no parameter {name!r}, which the plan reads")
                report.differences.append(Finding(SEQUENCE_PLAN, f"{where} {why}"))
    for (module_id, key), probe in family.expects.plan_inputs.items():
        spec = plan.get(module_id, {}).get(key) if isinstance(plan.get(module_id), dict) else None
        if spec is None:
            continue  # the plan of this model does not split it
        try:
            with torch.no_grad():
                value = probe(dm)
        except Exception as e:
            report.differences.append(Finding(SEQUENCE_PLAN, f"making a sample of {key!r} at {module_id!r} the way "
                                                             f"the model does failed ({type(e).__name__}: {e})"))
            continue
        mismatch = type_mismatch(spec, value)
        if mismatch:
            report.differences.append(Finding(SEQUENCE_PLAN, f"{key!r} at {module_id!r} {mismatch}"))


def type_mismatch(spec: Any, value: Any) -> str | None:
    """How ``value`` differs from what plan input ``spec`` (one spec, or a list of them) splits; None if it fits."""
    if isinstance(spec, SequenceParallelObjectInput):
        try:
            length = spec.tokens(value)
        except Exception as e:  # the host changed the object the family reads
            return f"is a {type(value).__name__} whose length the plan cannot read ({type(e).__name__}: {e})"
        if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 0):
            return f"is a {type(value).__name__} whose length the plan reads as {length!r}, not a token count"
        return None
    if isinstance(spec, (list, tuple)):
        if isinstance(value, torch.Tensor):
            return f"is a tensor, the plan has a list of {len(spec)} specs"
        if not isinstance(value, (list, tuple)):
            return f"is a {type(value).__name__}, the plan has a list of {len(spec)} specs"
        if len(value) != len(spec):
            return f"has {len(value)} elements, the plan has {len(spec)} specs"
        pairs = list(zip(spec, value))
    elif not isinstance(value, torch.Tensor):
        size = f" of {len(value)}" if isinstance(value, (list, tuple)) else ""
        return f"is a {type(value).__name__}{size}, the plan has one spec for a tensor"
    else:
        pairs = [(spec, value)]
    for i, (s, v) in enumerate(pairs):
        part = f"element {i} " if len(pairs) > 1 or isinstance(spec, (list, tuple)) else ""
        if s is None:  # an element the plan leaves alone
            continue
        if not isinstance(v, torch.Tensor):
            return f"{part}is a {type(v).__name__}, not a tensor"
        if s.expected_dims is not None and v.ndim != s.expected_dims:
            return f"{part}has {v.ndim} dims, the plan splits {s.expected_dims}"
    return None
