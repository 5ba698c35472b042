"""``SequenceParallelConfig``: how many ranks split the sequence, and how attention is exchanged among them."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class SequenceParallelConfig:
    """Degrees of the two attention exchanges; their product is the sequence-parallel world size.

    * ``ulysses_degree`` (U): ranks that exchange heads for sequence with an all-to-all before attention (DeepSpeed
      Ulysses). The head count must be divisible by U.
    * ``ring_degree`` (R): ranks that pass key/value blocks around a ring and merge partial attentions with the
      online softmax (ring attention). No divisibility constraint on heads.
    * Both > 1 is the hybrid (USP, xDiT): Ulysses groups of U neighbouring ranks, ring groups across them
      (vllm-omni's "ulysses-low" layout, ``omni_hooks.sequence_parallel.mesh``).
    * ``cfg_degree`` (C): CFG parallel. The world of C·U·R ranks is C groups ("cfg halves") of U·R ranks; a call whose
      batch splits into C equal parts (cond and uncond batched together) runs part ``c`` on half ``c``, each half
      sequence-parallel over its U·R ranks, and the output is gathered along the batch on every rank. A call whose
      batch does not split runs on all C·U·R ranks with degrees (U, C·R) (``whole_config``). Needs the default group.
    * ``process_group``: the torch.distributed group of exactly U·R ranks that share one model call; None means the
      default group. The hybrid builds its Ulysses and ring subgroups from it and then needs it to be the default
      group (every rank of the default group takes part in creating subgroups).
    * ``batch_unsplit_inputs``: (CFG parallel) forward parameters of the plan's root that are never split along the
      batch (their tensors are not batched data); every other tensor argument whose leading dim is the call's batch
      is, also inside lists, tuples and dicts.
    * ``group``: the host's description of the ranks' process group (a frozen dataclass of plain values: world size,
      backend, devices, address); the library does not read it, the host finds or starts its group from it.

    Frozen: built once by the caller and read unchanged by the run (``SequenceParallelRun.config``).
    """

    ulysses_degree: int = 1
    ring_degree: int = 1
    cfg_degree: int = 1
    process_group: Any = None
    batch_unsplit_inputs: tuple[str, ...] = ("transformer_options",)
    group: Any = None

    def __post_init__(self) -> None:
        for name in ("ulysses_degree", "ring_degree", "cfg_degree"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SequenceParallelConfig: SP degrees must be >= 1, got {name}={value!r}")
        if self.ulysses_degree == 1 and self.ring_degree == 1 and self.cfg_degree == 1:
            raise ValueError("SequenceParallelConfig: at least one degree must be > 1 (ulysses_degree, ring_degree "
                             "and cfg_degree are all 1); for a single process, do not apply sequence parallelism")
        if self.cfg_degree > 1 and self.process_group is not None:
            raise ValueError("SequenceParallelConfig: cfg_degree > 1 builds its groups from the default group; "
                             "leave process_group None")

    @property
    def world_size(self) -> int:
        """C·U·R: every rank taking part."""
        return self.cfg_degree * self.sequence_parallel_size

    def whole_config(self) -> "SequenceParallelConfig":
        """The degrees of a call that the cfg halves cannot split: all C·U·R ranks, the cfg factor added to the ring
        (ring attention has no head constraint; the Ulysses groups keep their members)."""
        return replace(self, ring_degree=self.ring_degree * self.cfg_degree, cfg_degree=1)

    @property
    def sequence_parallel_size(self) -> int:
        """U·R: the number of ranks the sequence is split across (within one cfg half)."""
        return self.ulysses_degree * self.ring_degree

    @property
    def mode(self) -> str:
        """"ulysses", "ring" or "hybrid"."""
        if self.ring_degree == 1:
            return "ulysses"
        return "ring" if self.ulysses_degree == 1 else "hybrid"
