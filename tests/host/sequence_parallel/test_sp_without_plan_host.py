"""Families without a sequence plan (MiniMax-H3: one packed sequence modulated span by span at absolute positions;
HiDream-O1: its attention is built per call and its kept prompt keys and values index the whole sequence): the
Sequence Parallel node refuses them saying why and which families it supports, LTX-2 and Kandinsky 5 among them; on a
ComfyUI without the model every test skips in one line naming the version."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.host

WHY = {
    "minimax_h3": r"MiniMax-H3 \(audio and video\) is not supported yet \(its blocks take one packed sequence",
    "hidream_o1": r"HiDream-O1 is not supported yet \(its attention is a function the model builds on every call",
}


@pytest.mark.parametrize("case_name", sorted(WHY))
def test_a_family_without_a_plan_is_refused_saying_why(case_name):
    from omnitest.pack import pack_module
    from omnitest.tiny_models import build_case

    node = pack_module("nodes.sequence_parallel.node")
    case = build_case(case_name)
    supported = r"supported: .*Kandinsky 5 \(video and image\), LTX-2 \(audio and video\), .*Wan"
    with pytest.raises(ValueError, match=rf"^Sequence Parallel: {WHY[case_name]}.*\); {supported}"):
        node.SequenceParallel.execute(case.patcher, 2, "auto", "auto", "auto", "auto", "127.0.0.1", 0)
