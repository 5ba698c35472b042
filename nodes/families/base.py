"""What the pack knows about one model family, as registered data shared by every feature.

Each family file in this package defines one ``FAMILY = ModelFamily(...)``: how to recognise the family from the
diffusion model itself (its class and config, never a file name), how its block stack is called, the signals it
offers by name (tensors a cache may measure at the head of the stack), the weights that live outside the block
stack, its sequence plan and attention sites, and ONE decision tree (``resolve_variant``) that names the detected
variant together with what each cache's 'auto' uses for it, keyed by the cache's kind ("teacache", "magcache"). The
published tables live with each cache (``nodes/caches/``) and are keyed by those auto_choices; each cache asks the
family for the signal it needs and says itself how to calibrate where nothing is published. A cache no family
recommends anything for needs nothing here (its 'auto' then asks for a calibration). ``nodes/families/__init__.py``
registers every family file and detects.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import torch

from ...omni_hooks.blockstack import BlockStack, SkipFn, StackSignal


class UnsupportedModelError(ValueError):
    """The MODEL is not a diffusion transformer of a registered family."""


@dataclass(frozen=True)
class AutoChoice:
    """What one cache's 'auto' uses for a variant: a key of that cache's published table, or None when none fits,
    and what the user should know about the choice (e.g. "720p i2v has the same weights shape as 480p: choose")."""

    key: str | None = None
    notes: tuple[str, ...] = ()
    #: the key 'auto' uses instead when the run's conditioning carries reference latents (Flux: Kontext's entry)
    with_reference: str | None = None
    #: with no key: the model, as users call it, when no entry of the cache's table is published for it at all (the
    #: cache's 'auto' then says, before ``notes``, to calibrate this model once)
    unpublished: str | None = None


NO_AUTO_CHOICE = AutoChoice()
#: the signal every family offers, and the one a cache asks for unless its published entry says otherwise
DEFAULT_SIGNAL = "default"


@dataclass(frozen=True, init=False)
class Variant:
    """The outcome of a family's decision tree: the variant's name and each cache's auto choice for it, keyed by
    the cache's kind: ``Variant("Wan T2V 1.3B", teacache=AutoChoice("wan2.1_t2v_1.3B"), magcache=AutoChoice(...))``.
    A cache without an entry uses ``otherwise`` (default: no auto choice, no notes)."""

    name: str
    auto_choices: Mapping[str, AutoChoice]
    otherwise: AutoChoice

    def __init__(self, name: str, otherwise: AutoChoice = NO_AUTO_CHOICE, **auto_choices: AutoChoice):
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "otherwise", otherwise)
        object.__setattr__(self, "auto_choices", MappingProxyType(dict(auto_choices)))


def nothing_published(name: str, model: str, *notes: str) -> Variant:
    """The variant ``name`` of a model (``model``, as users call it) for which no cache has published numbers: no
    cache's 'auto' has a choice for it (each cache says to calibrate ``model`` first); ``notes`` follow that line."""
    return Variant(name, otherwise=AutoChoice(None, notes, unpublished=model))


#: ``matches(base_model, diffusion_model)``: True when this family handles the model (``base_model`` is ComfyUI's
#: ``comfy.model_base.BaseModel``, ``diffusion_model`` its ``.diffusion_model``).
Matcher = Callable[[torch.nn.Module, torch.nn.Module], bool]
#: ``resolve_variant(base_model, diffusion_model)``: called only on models the family matches.
VariantResolver = Callable[[torch.nn.Module, torch.nn.Module], Variant]
StackBuilder = Callable[[torch.nn.Module], BlockStack]
#: ``builder(diffusion_model)``: where one signal of the model comes from (a tensor measured at the head block, e.g.
#: its timestep-modulated input), as an ``omni_hooks.blockstack.StackSignal``.
SignalBuilder = Callable[[torch.nn.Module], StackSignal]
#: For one diffusion model instance, where its sequence is split across ranks and gathered back (which inputs, along
#: which dimension, which rotary tables are sliced with them): an ``omni_hooks.sequence_parallel`` plan. None means
#: the family does not support sequence parallelism.
SequencePlanBuilder = Callable[[torch.nn.Module], Any]
#: The attention modules of one diffusion model instance whose attention is exchanged across ranks. None means not
#: declared.
AttentionSitesBuilder = Callable[[torch.nn.Module], Sequence[torch.nn.Module]]
#: ``probe(diffusion_model)``: a small sample of what one sequence plan input receives (the value itself, or for an
#: output spec the module's output), made the way the model's forward makes it (same function, tiny sizes).
InputProbe = Callable[[torch.nn.Module], Any]


@dataclass(frozen=True)
class ForwardParameters:
    """What the pack assumes about one ``forward``'s parameters (checked against the model before every run).

    ``params``: every parameter this forward takes on every supported ComfyUI, in any order (``"*args"`` /
    ``"**kwargs"`` spelled so where the forward has them; a parameter only some hosts have is left out: the check
    accepts a parameter it does not know when it has a default); ``positions``: the parameters the pack reads at a fixed
    position when a call passes them positionally (name -> index, ``self`` not counted).
    """

    params: tuple[str, ...]
    positions: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Expectations:
    """What the pack assumes about a family's diffusion model, next to the code that assumes it.

    ``blocks``: each block-stack attribute (a ModuleList) and its blocks' forward; ``call``: the diffusion model's
    forward, whose arguments the DIFFUSION_MODEL wrapper gets; ``plan_inputs``: for sequence plan inputs keyed
    ``(module id, input name or output index)``, how to make a sample of what they receive (its type and dims are
    checked against the plan's specs).
    """

    blocks: Mapping[str, ForwardParameters]
    call: ForwardParameters
    plan_inputs: Mapping[tuple[str, str | int], InputProbe] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelFamily:
    """One registered model family (one file per family in ``nodes/families/``).

    ``name`` is the family's key everywhere (calibration files, the ``family`` of the published tables);
    ``display_name`` is how users see it in the supported-families list. ``signals`` names every signal the family
    offers (``DEFAULT_SIGNAL`` always; e.g. Wan's "ret", the 6-way time projection) and how each is built; a cache
    asks for one by name (``signal``) and says itself what to do when the family does not offer it. ``resident``
    names the attributes of the diffusion model (modules or parameters; a name absent on some variant is skipped) that
    hold weights outside the block stack: embeddings, the tail, side branches such as VACE blocks (a dotted name
    reaches into a submodule: HiDream-O1's ``language_model.embed_tokens``). With the blocks of ``build_stack`` they
    hold every parameter and buffer of the model (checked on every tiny and real-size test model), so an offloading
    feature can stream the blocks and keep exactly these on the compute device.

    ``auto_keys`` lists, by cache kind, every key ``resolve_variant`` may recommend; detection refuses a key
    outside them, and the tests check each exists in its table under this family. ``detect_before`` names families
    whose matcher must be tried after this one (e.g. Chroma before Flux), so precedence never rests on file order.
    ``expects`` is what the family's code assumes about the model's blocks, call and plan inputs;
    ``nodes.families.drift`` checks it against the loaded model when a run starts.
    """

    name: str
    display_name: str
    matches: Matcher
    resolve_variant: VariantResolver
    build_stack: StackBuilder
    signals: Mapping[str, SignalBuilder] = field(hash=False)
    resident: tuple[str, ...]
    auto_keys: Mapping[str, frozenset[str]] = field(default_factory=dict, hash=False)
    detect_before: tuple[str, ...] = ()
    sequence_plan: SequencePlanBuilder | None = None
    attention_sites: AttentionSitesBuilder | None = None
    expects: Expectations | None = field(default=None, hash=False)
    #: without a sequence plan: why the model cannot be split (the Sequence Parallel node says it), "" if not known
    sequence_refusal: str = ""

    def __post_init__(self):
        if DEFAULT_SIGNAL not in self.signals:
            raise ValueError(f"model family {self.name!r} offers no {DEFAULT_SIGNAL!r} signal")

    def resident_modules(self, diffusion_model: torch.nn.Module) -> dict[str, torch.nn.Module | torch.Tensor]:
        """The ``resident`` attributes this model has (modules or parameters), by name, in declaration order."""
        found = {}
        for name in self.resident:
            value = dotted_attribute(diffusion_model, name)
            if isinstance(value, (torch.nn.Module, torch.Tensor)):
                found[name] = value
        return found


@dataclass(frozen=True)
class DetectedModel:
    """One detected MODEL: its registered family, the variant its decision tree named, and each cache's
    auto choice by cache kind."""

    family: ModelFamily
    variant: str
    auto_choices: Mapping[str, AutoChoice]
    otherwise: AutoChoice = NO_AUTO_CHOICE  # the variant's choice for a cache it has no entry for

    def auto_choice(self, cache_kind: str) -> AutoChoice:
        """What ``cache_kind``'s 'auto' uses for this model (the variant's ``otherwise`` when it names none)."""
        return self.auto_choices.get(cache_kind, self.otherwise)

    def describe(self) -> str:
        return f"{self.family.name} ({self.variant})"

    def build_stack(self, diffusion_model: torch.nn.Module) -> BlockStack:
        return self.family.build_stack(diffusion_model)

    def resident_modules(self, diffusion_model: torch.nn.Module) -> dict[str, torch.nn.Module | torch.Tensor]:
        return self.family.resident_modules(diffusion_model)


def dotted_attribute(obj: Any, name: str) -> Any:
    """``obj.<name>`` where a dotted ``name`` reaches into submodules ("language_model.layers"); None if absent."""
    for part in name.split("."):
        obj = getattr(obj, part, None)
    return obj


def pe_embedder_probe(dm: torch.nn.Module) -> torch.Tensor:
    """A plan input probe: the RoPE table ``dm.pe_embedder`` (ComfyUI's ``EmbedND``) makes for two positions."""
    return dm.pe_embedder(torch.zeros(1, 2, len(dm.pe_embedder.axes_dim)))


def call_arg(args: tuple, kwargs: dict, name: str, index: int, default=None):
    """An argument of a block call, by keyword ``name`` or else at position ``index`` (``default`` if absent)."""
    if name in kwargs:
        return kwargs[name]
    return args[index] if index < len(args) else default


def skip_by_type(skips: dict[type, SkipFn], inner: Callable[[torch.nn.Module], torch.nn.Module] | None = None
                 ) -> SkipFn:
    """A ``skip_block`` for stacks of several block types: the skip of the first type ``block`` is an instance of.

    ``inner(block)`` picks the module whose type decides (for wrapper blocks such as HiDream's ``HiDreamImageBlock``).
    """
    items = list(skips.items())

    def skip(block: torch.nn.Module, args: tuple, kwargs: dict):
        probe = inner(block) if inner is not None else block
        for cls, fn in items:
            if isinstance(probe, cls):
                return fn(block, args, kwargs)
        raise TypeError(f"no skip rule for block type {type(probe).__name__}")

    return skip
