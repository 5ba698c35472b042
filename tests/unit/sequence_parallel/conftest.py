"""Shared spawned rank pools for the multi-process sequence-parallel tests (one per world size, per session)."""
from __future__ import annotations

import pytest

from omnitest.rank_pool import RankPool


@pytest.fixture(scope="session")
def rank_pool():
    """``rank_pool(world_size)`` -> a ``RankPool`` (gloo on loopback); every pool is closed at the end."""
    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        if world_size not in pools:
            pools[world_size] = RankPool(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()
