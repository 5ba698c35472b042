"""Which ranks exchange what: the sequence-parallel group and its Ulysses and ring subgroups.

Layout (vllm-omni ``set_seq_parallel_pg`` "ulysses-low"): with U = ulysses_degree and
R = ring_degree, SP rank ``g`` holds sequence shard ``g``; the Ulysses groups are the contiguous ranges
``[i·U, (i+1)·U)`` and the ring groups the strided sets ``{j, j+U, j+2U, ...}``. So ``g`` is member ``g % U`` of Ulysses
group ``g // U`` and member ``g // U`` of ring group ``g % U``: after the Ulysses all-to-all a rank holds the
contiguous sequence segment of its Ulysses group, and ring order is sequence order. Ulysses neighbours should be
the best-connected ranks (all-to-all is the heavier exchange).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .config import SequenceParallelConfig

SIMULATED = "simulated"


@dataclass(frozen=True)
class RankGroup:
    """One communication group as this process sees it.

    ``ranks``: the members' ranks in the default group, in group order; ``rank``: this process's index among them;
    ``process_group``: the torch.distributed group (None for a group of one or a simulated mesh).
    """

    ranks: tuple[int, ...]
    rank: int
    process_group: Any = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, index: int) -> int:
        """The default-group rank of member ``index`` (wrapping around)."""
        return self.ranks[index % self.size]


@dataclass(frozen=True)
class SequenceParallelMesh:
    """The SP group and its Ulysses and ring subgroups for this process, plus the backend collectives run on.

    ``backend``: the torch.distributed backend ("gloo", "nccl", ...) or "simulated" (no process group: collectives
    only count bytes and return uninitialised tensors, for accounting at sizes no test machine can hold).
    ``device``: where small control tensors (cache agreement) must live for this backend.

    CFG parallel (``cfg_degree`` C > 1): ``sp``/``ulysses``/``ring`` are the groups inside this rank's cfg half (half
    ``c`` = default-group ranks ``[c·U·R, (c+1)·U·R)``); ``cfg`` holds the ranks at this rank's SP position in every
    half, in half order (the batch gather); ``whole`` is the mesh of all C·U·R ranks for calls the halves do not split
    (``SequenceParallelConfig.whole_config``). Both None without CFG parallel.
    """

    sp: RankGroup
    ulysses: RankGroup
    ring: RankGroup
    backend: str
    device: torch.device
    cfg: RankGroup | None = None
    whole: "SequenceParallelMesh | None" = None

    @property
    def simulated(self) -> bool:
        return self.backend == SIMULATED

    @classmethod
    def from_config(cls, config: SequenceParallelConfig) -> "SequenceParallelMesh":
        """Build the mesh from torch.distributed (collective over the SP group; the hybrid creates subgroups, which
        every rank of the default group must do in the same order)."""
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("apply_sequence_parallel: torch.distributed is not initialized; call "
                             "torch.distributed.init_process_group(...) in every rank first")
        if config.cfg_degree > 1:
            return cls._with_cfg(config)
        group = config.process_group
        ranks = tuple(dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size()))
        size = config.sequence_parallel_size
        if len(ranks) != size:
            raise ValueError(f"Configuration mismatch: expected SP size {size} (ulysses_degree "
                             f"{config.ulysses_degree} x ring_degree {config.ring_degree}), but actual sequence "
                             f"parallel world size is {len(ranks)}; make the degrees' product equal the group size")
        if dist.get_rank() not in ranks:
            raise ValueError(f"apply_sequence_parallel: this process (rank {dist.get_rank()}) is not in the config's "
                             f"process_group (ranks {list(ranks)}); apply sequence parallelism on its members only")
        me = ranks.index(dist.get_rank())
        pg = group if group is not None else dist.group.WORLD
        backend = str(dist.get_backend(pg))
        device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu"))
        u, r = config.ulysses_degree, config.ring_degree
        if u > 1 and r > 1:
            if len(ranks) != dist.get_world_size():
                raise ValueError("SequenceParallelConfig: the hybrid (ulysses_degree and ring_degree > 1) builds "
                                 "subgroups and needs process_group=None (the default group)")
            ulysses_groups, ring_groups = _layout(ranks, u, r)
            # every rank creates every group, in the same order, as torch.distributed.new_group requires
            ulysses = _create_groups(ulysses_groups)
            ring = _create_groups(ring_groups)
        else:
            whole = RankGroup(ranks, me, pg)
            ulysses = whole if u > 1 else RankGroup((ranks[me],), 0)
            ring = whole if r > 1 else RankGroup((ranks[me],), 0)
        return cls(sp=RankGroup(ranks, me, pg), ulysses=ulysses, ring=ring, backend=backend, device=device)

    @classmethod
    def _with_cfg(cls, config: SequenceParallelConfig) -> "SequenceParallelMesh":
        """CFG parallel: every rank creates every half's groups, then the cfg groups, then the whole mesh's."""
        world, size = dist.get_world_size(), config.sequence_parallel_size
        if world != config.world_size:
            raise ValueError(f"Configuration mismatch: cfg_degree {config.cfg_degree} x ulysses_degree "
                             f"{config.ulysses_degree} x ring_degree {config.ring_degree} = {config.world_size}, but "
                             f"the world size is {world}; make the degrees' product equal the world size")
        me = dist.get_rank()
        halves = [tuple(range(c * size, (c + 1) * size)) for c in range(config.cfg_degree)]
        single = RankGroup((me,), 0)
        sp = _create_groups(halves) if size > 1 else single
        u, r = config.ulysses_degree, config.ring_degree
        if u > 1 and r > 1:
            layouts = [_layout(half, u, r) for half in halves]
            ulysses = _create_groups([g for layout in layouts for g in layout[0]])
            ring = _create_groups([g for layout in layouts for g in layout[1]])
        else:
            ulysses = sp if u > 1 else single
            ring = sp if r > 1 else single
        cfg = _create_groups([tuple(g + c * size for c in range(config.cfg_degree)) for g in range(size)])
        whole = cls.from_config(config.whole_config())
        return cls(sp=sp, ulysses=ulysses, ring=ring, backend=whole.backend, device=whole.device, cfg=cfg, whole=whole)

    @classmethod
    def simulated_for(cls, config: SequenceParallelConfig, rank: int = 0) -> "SequenceParallelMesh":
        """A mesh without processes: rank ``rank`` of U·R, for byte accounting (see ``comm.Communicator``); use it
        with tensors on the "meta" device to account for sizes no machine here can hold. No CFG parallel."""
        if config.cfg_degree > 1:
            raise ValueError("SequenceParallelMesh.simulated_for: CFG parallel is not simulated; account for one cfg "
                             "half (cfg_degree=1)")
        ranks = tuple(range(config.sequence_parallel_size))
        ulysses_groups, ring_groups = _layout(ranks, config.ulysses_degree, config.ring_degree)
        ulysses = next(g for g in ulysses_groups if rank in g)
        ring = next(g for g in ring_groups if rank in g)
        return cls(sp=RankGroup(ranks, rank), ulysses=RankGroup(ulysses, ulysses.index(rank)),
                   ring=RankGroup(ring, ring.index(rank)), backend=SIMULATED, device=torch.device("cpu"))


def _create_groups(groups: list[tuple[int, ...]]) -> RankGroup:
    """Create a process group for each member tuple; return this process's one."""
    mine = None
    me = dist.get_rank()
    for members in groups:
        made = dist.new_group(list(members))
        if me in members:
            mine = RankGroup(members, members.index(me), made)
    return mine


def _layout(ranks: tuple[int, ...], u: int, r: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(Ulysses groups, ring groups) of the "ulysses-low" layout over ``ranks`` (SP order)."""
    ulysses = [tuple(ranks[i * u:(i + 1) * u]) for i in range(r)]
    ring = [tuple(ranks[j::u]) for j in range(u)]
    return ulysses, ring


def group_layout(world_size: int, ulysses_degree: int, ring_degree: int) -> tuple[list[tuple[int, ...]],
                                                                                  list[tuple[int, ...]]]:
    """The (Ulysses groups, ring groups) of SP ranks ``0..world_size-1``; ValueError if U·R != world_size."""
    if ulysses_degree * ring_degree != world_size:
        raise ValueError(f"ulysses_degree {ulysses_degree} x ring_degree {ring_degree} != world size {world_size}")
    return _layout(tuple(range(world_size)), ulysses_degree, ring_degree)
