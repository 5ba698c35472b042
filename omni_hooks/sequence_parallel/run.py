"""``SequenceParallelRun``: sequence parallelism on one model in one process, shared by its hooks and its
attention entry."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..context import RankView
from .attention import SequenceParallelAttention
from .batch import call_batch, gather_output, split_call
from .cache_sync import GroupAgreement
from .comm import CommStats, Communicator, ExchangeGate
from .config import SequenceParallelConfig
from .mesh import SequenceParallelMesh
from .plan import AttentionSpec, SequenceParallelCrossAttention
from .sharding import PaddingRecord


@dataclass(frozen=True)
class ActiveSite:
    """An attention site whose forward is running, with its joint-token count resolved for this call (0 for a
    cross-attention site)."""

    spec: AttentionSpec
    joint_tokens: int
    module: torch.nn.Module

    @property
    def split_keys(self) -> bool:
        """Whether the site's queries are whole on every rank and only its keys split (cross-attention)."""
        return isinstance(self.spec, SequenceParallelCrossAttention)


CFG_GATHER_KIND = "cfg_batch_all_gather"


class _Layout:
    """The communicators of one mesh (a cfg half's, or the whole world's) and its cache agreement: ``mean`` over the
    ranks that compute the same part of the batch, ``any`` over ``any_comm`` (every rank of the world)."""

    def __init__(self, mesh: SequenceParallelMesh, stats: CommStats, gate: ExchangeGate,
                 any_comm: Communicator | None = None):
        simulated = mesh.simulated
        self.sp_comm = Communicator(mesh.sp, stats, simulated, gate)
        self.ulysses_comm = Communicator(mesh.ulysses, stats, simulated, gate)
        self.ring_comm = Communicator(mesh.ring, stats, simulated, gate)
        self.agreement = GroupAgreement(self.sp_comm, mesh.device, any_comm)


class _CallAgreement:
    """The run's ``RankAgreement``: the agreement of the layout the current call runs on (a cache asks during the
    call, after the root has chosen it)."""

    def __init__(self, run: "SequenceParallelRun"):
        self.run = run

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        return self.run._layout.agreement.mean(values)

    def any(self, flag: bool) -> bool:
        return self.run._layout.agreement.any(flag)


class SequenceParallelRun:
    """What ``apply_sequence_parallel`` returns: the mesh, the per-call facts the split/gather/attention hooks share,
    the byte accounting, and the two things a host installs:

    * ``attention``: the attention entry for the host's attention-override seam (see ``SequenceParallelAttention``);
    * ``rank_view()``: the ``RankView`` to put into each ``CallContext``, so caches decide alike on every rank.

    ``gate`` (``ExchangeGate``): a check the host wants run before this rank's next collective.

    Per call facts: ``padding`` maps a shard group (None: the default sequence) to the length its last split padded;
    ``active_site`` is the attention site whose forward is running. One run serves one thread.

    CFG parallel (``config.cfg_degree`` C > 1): the root's batch hook calls ``split_batch`` and ``gather_batch``
    around the root forward. A call whose batch C divides runs part ``c`` on cfg half ``c`` (``sp_comm``,
    ``ulysses_comm``, ``ring_comm``, ``rank`` and ``world_size`` are then the half's); any other call runs on the
    whole world with ``config.whole_config()``'s degrees. ``batch_part()`` says which part this rank computes, and the
    agreement averages over the ranks of that part but decides ``any`` over the world, so a cache's verdict is the
    same on every rank. ``whole_call`` is the unsplit arguments of the root call in progress (a host that relays the
    call to other ranks from inside the root forward sends these).
    """

    def __init__(self, config: SequenceParallelConfig, mesh: SequenceParallelMesh | None = None):
        self.config = config
        self.mesh = mesh if mesh is not None else SequenceParallelMesh.from_config(config)
        if self.mesh.sp.size != config.sequence_parallel_size:
            raise ValueError(f"SequenceParallelRun: mesh of {self.mesh.sp.size} ranks for a config of "
                             f"{config.sequence_parallel_size}")
        self.stats = CommStats()
        self.gate = ExchangeGate()
        whole = self.mesh.whole
        if (config.cfg_degree > 1) != (whole is not None):
            raise ValueError(f"SequenceParallelRun: cfg_degree {config.cfg_degree} needs a mesh built for it "
                             "(SequenceParallelMesh.from_config of the same config)")
        self._whole = _Layout(whole, self.stats, self.gate) if whole is not None else None
        world_comm = self._whole.sp_comm if self._whole is not None else None
        self._split = _Layout(self.mesh, self.stats, self.gate, any_comm=world_comm)
        self.cfg_comm = Communicator(self.mesh.cfg, self.stats, gate=self.gate) if self.mesh.cfg is not None else None
        self._layout = self._whole or self._split
        self.whole_call: tuple[tuple, dict] | None = None
        self._part_batch: int | None = None
        self.agreement = _CallAgreement(self)
        self.attention = SequenceParallelAttention(self)
        self.padding: dict[str | None, PaddingRecord] = {}
        self._sites: list[ActiveSite] = []

    @property
    def sp_comm(self) -> Communicator:
        return self._layout.sp_comm

    @property
    def ulysses_comm(self) -> Communicator:
        return self._layout.ulysses_comm

    @property
    def ring_comm(self) -> Communicator:
        return self._layout.ring_comm

    @property
    def rank(self) -> int:
        """This process's sequence shard index (its rank in the SP group of the current call's layout)."""
        return self._layout.sp_comm.group.rank

    @property
    def world_size(self) -> int:
        """The ranks the current call's sequence is split across."""
        return self._layout.sp_comm.size

    def rank_view(self) -> RankView:
        """This process among every rank (all cfg halves), for each call's ``CallContext``."""
        world = (self._whole or self._split).sp_comm.group
        return RankView(rank=world.rank, world_size=world.size, agreement=self.agreement,
                        batch_part=self.batch_part)

    # -- CFG parallel ---------------------------------------------------------------------------------------------

    def batch_part(self) -> tuple[int, int]:
        """``(index, parts)``: this rank computes part ``index`` of ``parts`` equal parts of the current call's batch
        (``(0, 1)``: the whole batch)."""
        if self._part_batch is None:
            return 0, 1
        return self.mesh.cfg.rank, self.config.cfg_degree

    def split_batch(self, args: tuple, kwargs: dict, names: list[str]) -> tuple[tuple, dict]:
        """At the root, before its forward: choose the call's layout and return this rank's part of the batch.
        ``names``: the root forward's positional parameter names."""
        self.whole_call = (args, kwargs)
        parts = self.config.cfg_degree
        batch = call_batch(args, kwargs)
        if parts == 1:
            return args, kwargs
        if batch is None or batch % parts:
            self._layout, self._part_batch = self._whole, None
            return args, kwargs
        self._layout, self._part_batch = self._split, batch // parts
        return split_call(args, kwargs, names, self.config.batch_unsplit_inputs, batch, parts, self.mesh.cfg.rank)

    def gather_batch(self, output):
        """At the root, after its forward: the parts' outputs gathered along the batch (every rank gets all)."""
        part_batch, self._part_batch = self._part_batch, None
        self._layout, self.whole_call = self._whole or self._split, None
        if part_batch is None:
            return output
        return gather_output(output, part_batch, lambda x: self.cfg_comm.all_gather(x, 0, CFG_GATHER_KIND))

    def split_length(self, shard_group: str | None, part: str) -> int:
        """The length of ``shard_group``'s sequence (None: the default one) as its last split saw it: ``part``
        "shard" is this rank's shard (padded length / world size), "sequence" the whole unpadded sequence.
        ValueError when no ``auto_pad`` split of it has run."""
        record = self.padding.get(shard_group)
        if record is None:
            raise ValueError(f"the sequence of shard_group {shard_group!r} has not been split with auto_pad=True "
                             "before this module in this call; fix: split it (auto_pad=True) at a module that runs "
                             "earlier, or name the shard_group it was split with")
        return record.padded_len // self.world_size if part == "shard" else record.original_len

    # -- attention sites ------------------------------------------------------------------------------------------

    @property
    def active_site(self) -> ActiveSite | None:
        return self._sites[-1] if self._sites else None

    def enter_site(self, site: ActiveSite) -> None:
        self._sites.append(site)

    def leave_site(self, module: torch.nn.Module) -> None:
        if self._sites and self._sites[-1].module is module:
            self._sites.pop()

    def reset(self) -> None:
        """Forget per-call facts (after a forward that raised, before reusing the model)."""
        self._sites.clear()
        self.padding.clear()
        self._part_batch, self.whole_call = None, None
        self._layout = self._whole or self._split
