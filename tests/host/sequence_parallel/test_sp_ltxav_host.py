"""LTX-2 (audio and video) has no sequence plan: the Sequence Parallel node refuses it saying why (in every block each
stream attends to the whole other one) and which families it supports; skips in one line on a ComfyUI without it."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.host


def test_ltx2_is_refused_saying_why():
    from omnitest.pack import pack_module
    from omnitest.tiny_models import build_case

    node = pack_module("nodes.sequence_parallel.node")
    case = build_case("ltxav")
    with pytest.raises(ValueError, match=r"^Sequence Parallel: LTX-2 \(audio and video\) is not supported yet \(in "
                                         r"every block the video attends to the whole audio.*\); supported: .*Wan"):
        node.SequenceParallel.execute(case.patcher, 2, "auto", "auto", "auto", "auto", "127.0.0.1", 0)
