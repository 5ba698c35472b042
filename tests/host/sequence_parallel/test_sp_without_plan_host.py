"""Families without a sequence plan (LTX-2: audio and video attend to each other whole; Kandinsky 5: its tokens are
reshaped to the grid between the last block and the final layer; MiniMax-H3: one packed sequence modulated span by
span at absolute positions; HiDream-O1: its attention is built per call and its kept prompt keys and values index the
whole sequence): the Sequence Parallel node refuses them saying why and which families it supports; on a ComfyUI
without the model every test skips in one line naming the version."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.host

WHY = {
    "ltxav": r"LTX-2 \(audio and video\) is not supported yet \(in every block the video attends to the whole audio",
    "kandinsky5": r"Kandinsky 5 \(video and image\) is not supported yet \(its block stack's output is reshaped",
    "minimax_h3": r"MiniMax-H3 \(audio and video\) is not supported yet \(its blocks take one packed sequence",
    "hidream_o1": r"HiDream-O1 is not supported yet \(its attention is a function the model builds on every call",
}


@pytest.mark.parametrize("case_name", sorted(WHY))
def test_a_family_without_a_plan_is_refused_saying_why(case_name):
    from omnitest.pack import pack_module
    from omnitest.tiny_models import build_case

    node = pack_module("nodes.sequence_parallel.node")
    case = build_case(case_name)
    with pytest.raises(ValueError, match=rf"^Sequence Parallel: {WHY[case_name]}.*\); supported: .*Wan"):
        node.SequenceParallel.execute(case.patcher, 2, "auto", "auto", "auto", "auto", "127.0.0.1", 0)
