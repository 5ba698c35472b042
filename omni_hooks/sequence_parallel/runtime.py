"""``SequenceParallelRuntime``: sequence parallelism on one model in one process, shared by its hooks and its
attention entry."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..context import RankView
from .attention import SequenceParallelAttention
from .cache_sync import GroupAgreement
from .comm import CommStats, Communicator
from .config import SequenceParallelConfig
from .mesh import SequenceParallelMesh
from .plan import SequenceParallelSelfAttention
from .sharding import PaddingRecord


@dataclass(frozen=True)
class ActiveSite:
    """A self-attention site whose forward is running, with its joint-token count resolved for this call."""

    spec: SequenceParallelSelfAttention
    joint_tokens: int
    module: torch.nn.Module


class SequenceParallelRuntime:
    """What ``apply_sequence_parallel`` returns: the mesh, the per-call facts the split/gather/attention hooks share,
    the byte accounting, and the two things a host installs:

    * ``attention``: the attention entry for the host's attention-override seam (see ``SequenceParallelAttention``);
    * ``rank_view()``: the ``RankView`` to put into each ``CallContext``, so caches decide alike on every rank.

    Per call facts: ``padding`` maps a shard group (None: the default sequence) to the length its last split padded;
    ``active_site`` is the self-attention site whose forward is running. One runtime serves one thread.
    """

    def __init__(self, config: SequenceParallelConfig, mesh: SequenceParallelMesh | None = None):
        self.config = config
        self.mesh = mesh if mesh is not None else SequenceParallelMesh.from_config(config)
        if self.mesh.sp.size != config.sequence_parallel_size:
            raise ValueError(f"SequenceParallelRuntime: mesh of {self.mesh.sp.size} ranks for a config of "
                             f"{config.sequence_parallel_size}")
        self.stats = CommStats()
        simulated = self.mesh.simulated
        self.sp_comm = Communicator(self.mesh.sp, self.stats, simulated)
        self.ulysses_comm = Communicator(self.mesh.ulysses, self.stats, simulated)
        self.ring_comm = Communicator(self.mesh.ring, self.stats, simulated)
        self.agreement = GroupAgreement(self.sp_comm, self.mesh.device)
        self.attention = SequenceParallelAttention(self)
        self.padding: dict[str | None, PaddingRecord] = {}
        self._sites: list[ActiveSite] = []

    @property
    def rank(self) -> int:
        """This process's sequence shard index (its rank in the SP group)."""
        return self.mesh.sp.rank

    @property
    def world_size(self) -> int:
        return self.mesh.sp.size

    def rank_view(self) -> RankView:
        return RankView(rank=self.rank, world_size=self.world_size, agreement=self.agreement)

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

    # -- self-attention sites -------------------------------------------------------------------------------------

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
