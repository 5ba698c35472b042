"""``SequenceParallelConfig``: how many ranks split the sequence, and how attention is exchanged among them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class SequenceParallelConfig:
    """Degrees of the two attention exchanges; their product is the sequence-parallel world size.

    * ``ulysses_degree`` (U): ranks that exchange heads for sequence with an all-to-all before attention (DeepSpeed
      Ulysses). The head count must be divisible by U.
    * ``ring_degree`` (R): ranks that pass key/value blocks around a ring and merge partial attentions with the
      online softmax (ring attention). No divisibility constraint on heads.
    * Both > 1 is the hybrid (USP, xDiT): Ulysses groups of U neighbouring ranks, ring groups across them
      (hook-library-spec.md §7.11, vllm-omni's "ulysses-low" layout).
    * ``process_group``: the torch.distributed group of exactly U·R ranks that share one model call; None means the
      default group. The hybrid builds its Ulysses and ring subgroups from it and then needs it to be the default
      group (every rank of the default group takes part in creating subgroups).
    """

    ulysses_degree: int = 1
    ring_degree: int = 1
    process_group: Any = None

    def __post_init__(self) -> None:
        for name in ("ulysses_degree", "ring_degree"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SequenceParallelConfig: SP degrees must be >= 1, got {name}={value!r}")
        if self.ulysses_degree == 1 and self.ring_degree == 1:
            raise ValueError("SequenceParallelConfig: at least one SP degree must be > 1 (ulysses_degree and "
                             "ring_degree are both 1); for a single process, do not apply sequence parallelism")

    @property
    def sequence_parallel_size(self) -> int:
        """U·R: the number of ranks the sequence is split across."""
        return self.ulysses_degree * self.ring_degree

    @property
    def mode(self) -> str:
        """"ulysses", "ring" or "hybrid"."""
        if self.ring_degree == 1:
            return "ulysses"
        return "ring" if self.ulysses_degree == 1 else "hybrid"
