"""``ReplicatedTokens``: text lengths of modules that only see ``[text | image]`` tensors built around a split.

A Flux-like toy (``FluxLike``): the image tokens are split where they are embedded, the RoPE table over
``[text | image]`` positions is split where it is made (its text length: the position ids minus the whole image
sequence), joint blocks attend text and image from two streams, then single-stream blocks attend ``cat(text, image
shard)`` (their text length: the input minus this rank's shard). In one process on a simulated mesh: what each module
sees; on 2 gloo ranks (tests/omnitest/rank_pool.py): the output equals the one-process model's with Ulysses and ring,
padded or not.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from omni_hooks.sequence_parallel import (
    ReplicatedTokens,
    SequenceParallelConfig,
    SequenceParallelInput,
    SequenceParallelMesh,
    SequenceParallelOutput,
    SequenceParallelPartialInput,
    SequenceParallelSelfAttention,
    apply_sequence_parallel,
    remove_sequence_parallel,
)
from omnitest.toy_dit import JointBlock, apply_rope, attention, rope_table

TIMEOUT_S = 90
DIM, HEADS = 32, 2


class Rope(torch.nn.Module):
    """Position ids ``[N]`` -> RoPE table ``[N, D/2, 2]`` (as ComfyUI's ``EmbedND`` makes ``pe`` from ids)."""

    def forward(self, ids):
        return rope_table(ids, DIM // HEADS)


class SingleStreamBlock(torch.nn.Module):
    """One stream ``[text | image]``, self-attention over all of it (Flux's single blocks)."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.out = torch.nn.Linear(DIM, DIM)

    def forward(self, x, table, transformer_options):
        b, length, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, length, 3, HEADS, DIM // HEADS).unbind(2)
        q, k = apply_rope(q, table), apply_rope(k, table)
        out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), HEADS, transformer_options,
                        skip_reshape=True)
        return x + self.out(out)


class FluxLike(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.img_in = torch.nn.Linear(DIM, DIM)
        self.rope = Rope()
        self.joint_blocks = torch.nn.ModuleList([JointBlock(DIM, HEADS)])
        self.single_blocks = torch.nn.ModuleList([SingleStreamBlock(), SingleStreamBlock()])
        self.final = torch.nn.Linear(DIM, DIM)

    def forward(self, img, txt, ids, temb, transformer_options=None):
        options = transformer_options or {}
        x = self.img_in(img)
        table = self.rope(ids)
        for block in self.joint_blocks:
            x, txt = block(x, txt, temb, table, options)
        x = torch.cat([txt, x], 1)
        for block in self.single_blocks:
            x = block(x, table, options)
        return self.final(x[:, txt.shape[1]:])


def flux_like_plan() -> dict:
    return {
        "img_in": {0: SequenceParallelInput(split_dim=1, expected_dims=3, split_output=True, auto_pad=True)},
        "rope": {0: SequenceParallelPartialInput(
            split_dim=0, split_output=True, auto_pad=True, shard_group="rope",
            text_len_source=ReplicatedTokens("ids", dim=0, beside="sequence"))},
        "joint_blocks.*.attn": SequenceParallelSelfAttention(joint_tokens="c"),
        "single_blocks.*": SequenceParallelSelfAttention(joint_tokens=ReplicatedTokens("x")),
        "final": SequenceParallelOutput(gather_dim=1, expected_dims=3),
    }


def flux_like_inputs(text: int, image: int) -> dict:
    g = torch.Generator().manual_seed(7)
    return dict(img=torch.randn(1, image, DIM, generator=g), txt=torch.randn(1, text, DIM, generator=g),
                ids=torch.arange(text + image, dtype=torch.float32), temb=torch.randn(1, DIM, generator=g))


def flux_like_model() -> FluxLike:
    torch.manual_seed(0)
    return FluxLike()


# -- one process, simulated mesh --------------------------------------------------------------------------------------

def test_modules_see_the_text_whole_and_this_ranks_shard():
    text, image = 3, 5  # 5 image tokens on 2 ranks: padded to 6, rank 1 holds tokens 3, 4 and one pad
    config = SequenceParallelConfig(ulysses_degree=2)
    model = flux_like_model()
    runtime = apply_sequence_parallel(model, config, flux_like_plan(),
                                      mesh=SequenceParallelMesh.simulated_for(config, 1))
    seen = []

    def replace_forward(module, forward):  # the module's own forward, under the hooks apply registered
        key = "_omni_original_forward"
        if key in module.__dict__:
            module.__dict__[key] = forward
        else:
            module.forward = forward

    def single(x, table, transformer_options):  # records what the block sees, runs no attention
        seen.append((runtime.active_site.joint_tokens, x.shape[1], table.clone()))
        return x

    for block in model.single_blocks:
        replace_forward(block, single)
    replace_forward(model.joint_blocks[0], lambda x, c, temb, table, options: (x, c))
    out = model(**flux_like_inputs(text, image))
    full_table = rope_table(torch.arange(float(text + image)), DIM // HEADS)
    expected_table = torch.cat([full_table[:text], full_table[text + 3:], torch.zeros(1, DIM // HEADS // 2, 2)])
    assert [s[:2] for s in seen] == [(text, text + 3)] * 2
    assert all(torch.equal(s[2], expected_table) for s in seen)
    assert out.shape == (1, image, DIM)  # gathered (uninitialised on a simulated mesh), padding dropped
    assert runtime.split_length(None, "shard") == 3 and runtime.split_length(None, "sequence") == 5


def test_replicated_tokens_without_an_earlier_split_names_the_fix():
    config = SequenceParallelConfig(ulysses_degree=2)
    model = flux_like_model()
    plan = {"single_blocks.*": SequenceParallelSelfAttention(
        joint_tokens=ReplicatedTokens("x", shard_group="image"))}
    apply_sequence_parallel(model, config, plan, mesh=SequenceParallelMesh.simulated_for(config, 0))
    with pytest.raises(ValueError, match=r"joint_tokens.*shard_group 'image' has not been split with auto_pad=True"):
        model.single_blocks[0](torch.zeros(1, 4, DIM), torch.zeros(4, DIM // HEADS // 2, 2), {})
    remove_sequence_parallel(model, plan)


def test_replicated_tokens_of_an_unknown_parameter_or_side_fail_early():
    config = SequenceParallelConfig(ulysses_degree=2)
    with pytest.raises(ValueError, match="parameter 'hidden' not found in the forward signature of SingleStreamBlock"):
        plan = {"single_blocks.*": SequenceParallelSelfAttention(joint_tokens=ReplicatedTokens("hidden"))}
        apply_sequence_parallel(flux_like_model(), config, plan, mesh=SequenceParallelMesh.simulated_for(config, 0))
    with pytest.raises(ValueError, match="beside must be 'shard' or 'sequence'"):
        ReplicatedTokens("x", beside="image")


# -- 2 gloo ranks ------------------------------------------------------------------------------------------------------

def rank_flux_like(ulysses: int, ring: int, text: int, image: int):
    model = flux_like_model()
    inputs = flux_like_inputs(text, image)
    plan = flux_like_plan()
    with torch.no_grad():
        reference = model(**inputs)
        runtime = apply_sequence_parallel(model, SequenceParallelConfig(ulysses_degree=ulysses, ring_degree=ring),
                                          plan)
        out = model(**inputs, transformer_options={"attention_override": runtime.attention})
        remove_sequence_parallel(model, plan)
        restored = model(**inputs)
    calls = {kind: record.calls for kind, record in runtime.stats.snapshot().items()}
    return (out - reference).abs().max().item(), torch.equal(restored, reference), calls, dist.get_rank()


@pytest.mark.parametrize("ulysses, ring, text, image", [(2, 1, 3, 8), (2, 1, 3, 7), (1, 2, 4, 8), (1, 2, 4, 9)])
def test_flux_like_model_on_two_ranks_equals_one_process(rank_pool, ulysses, ring, text, image):
    exchange = "ulysses_all_to_all" if ulysses > 1 else "ring_hop"
    for error, restored, calls, _rank in rank_pool(2).run(rank_flux_like, ulysses, ring, text, image,
                                                         timeout=TIMEOUT_S):
        assert error <= 1e-5
        assert restored
        assert calls[exchange] > 0 and calls["output_all_gather"] == 1
