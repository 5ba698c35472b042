"""What the Sequence Parallel host tests share: the tiny Wan with its one-process result, and the check that a test
leaves no group, process or port behind."""
from __future__ import annotations

import pytest

from omnitest.processes import Snapshot, assert_nothing_left


@pytest.fixture(scope="module")
def wan():
    """The tiny Wan and its latent sampled in one process (a module may define its own ``wan``)."""
    from omnitest.tiny_models import build_case, sample

    case = build_case("wan21_t2v")
    return case, sample(case)


@pytest.fixture
def ports_before():
    """The ports this process listened on before the test, with no group running; checked after the test (with the
    child processes: those of a session-wide rank pool are not the test's)."""
    from omnitest.pack import pack_module

    group = pack_module("nodes.sequence_parallel.group")
    group.close_group()
    before = Snapshot.now()
    yield before.ports
    group.close_group()
    assert_nothing_left(before)
