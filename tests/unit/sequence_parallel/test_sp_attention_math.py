"""Attention pieces in one process: the online-softmax merge against a float64 reference, blockwise attention with
its log-sum-exp, the host-layout conversions, the errors that name a fix, and the byte accounting of every exchange
on a simulated mesh."""
from __future__ import annotations

import pytest
import torch

from omni_hooks.sequence_parallel import (
    ActiveSite,
    SequenceParallelConfig,
    SequenceParallelMesh,
    SequenceParallelRun,
    SequenceParallelSelfAttention,
    attention_math_with_lse,
    attention_with_lse,
    merge_attention,
    sdpa_attention,
)
from omni_hooks.sequence_parallel import attention as sp_attention


def reference(q, k, v):
    """float64 softmax attention and log-sum-exp, ``[B, H, L, D]``."""
    scores = (q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(scores, -1) @ v.double(), torch.logsumexp(scores, -1)


def qkv(b=2, h=3, lq=7, lk=24, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, lq, d, generator=g, dtype=dtype), torch.randn(b, h, lk, d, generator=g, dtype=dtype),
            torch.randn(b, h, lk, d, generator=g, dtype=dtype))


@pytest.mark.parametrize("blockwise", [attention_with_lse, attention_math_with_lse])
def test_blockwise_attention_returns_the_reference_output_and_lse(blockwise):
    q, k, v = qkv()
    out, lse = blockwise(q, k, v, q.shape[-1] ** -0.5, torch.float64)
    ref_out, ref_lse = reference(q, k, v)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_blockwise_attention_of_bf16_inputs_is_computed_in_float32():
    q, k, v = qkv(dtype=torch.bfloat16)
    out, lse = attention_with_lse(q, k, v, q.shape[-1] ** -0.5, torch.float32)
    assert out.dtype == lse.dtype == torch.float32
    ref_out, ref_lse = reference(q, k, v)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)


def test_query_chunking_changes_nothing(monkeypatch):
    q, k, v = qkv(lq=13)
    whole = attention_math_with_lse(q, k, v, 0.3, torch.float64)
    monkeypatch.setattr(sp_attention, "RING_SCORE_CHUNK_ELEMENTS", 2 * 3 * 24 * 2)  # 2 query rows per chunk
    chunked = attention_math_with_lse(q, k, v, 0.3, torch.float64)
    torch.testing.assert_close(chunked, whole, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("blocks", [2, 3, 8])
def test_merging_blocks_equals_attention_over_all_keys(blocks):
    q, k, v = qkv(lk=24)
    out = lse = None
    for kb, vb in zip(k.chunk(blocks, 2), v.chunk(blocks, 2)):
        out, lse = merge_attention(out, lse, *attention_with_lse(q, kb, vb, q.shape[-1] ** -0.5, torch.float64))
    ref_out, ref_lse = reference(q, k, v)
    torch.testing.assert_close(out, ref_out, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(lse, ref_lse, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(lse, torch.logsumexp(torch.stack(
        [reference(q, kb, vb)[1] for kb in k.chunk(blocks, 2)]), 0), rtol=2e-6, atol=2e-6)


def test_merge_with_extreme_lse_stays_finite_and_does_not_mutate():
    out_a, out_b = torch.ones(1, 1, 2, 4), torch.full((1, 1, 2, 4), 3.0)
    lse_a, lse_b = torch.tensor([[[1000.0, -1000.0]]]), torch.tensor([[[-1000.0, 1000.0]]])
    copies = [t.clone() for t in (out_a, lse_a, out_b, lse_b)]
    out, lse = merge_attention(out_a, lse_a, out_b, lse_b)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert out[0, 0, 0].tolist() == [1.0] * 4 and out[0, 0, 1].tolist() == [3.0] * 4
    assert all(torch.equal(a, b) for a, b in zip(copies, (out_a, lse_a, out_b, lse_b)))


def test_the_reference_local_function_accepts_both_host_layouts():
    q, k, v = qkv(b=1, h=2, lq=5, lk=5, dtype=torch.float32)
    heads_first = sdpa_attention(q, k, v, 2, skip_reshape=True, skip_output_reshape=True)
    flat = [t.transpose(1, 2).reshape(1, 5, 16) for t in (q, k, v)]
    torch.testing.assert_close(sdpa_attention(*flat, 2).reshape(1, 5, 2, 8).transpose(1, 2), heads_first)
    torch.testing.assert_close(heads_first, reference(q, k, v)[0].float(), rtol=1e-5, atol=1e-5)


# -- the entry at a site, on a simulated mesh (meta tensors: shapes and bytes, no values) --------------------------

def runtime_at_site(ulysses, ring, joint=0, rank=0):
    config = SequenceParallelConfig(ulysses_degree=ulysses, ring_degree=ring)
    runtime = SequenceParallelRun(config, SequenceParallelMesh.simulated_for(config, rank))
    runtime.enter_site(ActiveSite(SequenceParallelSelfAttention(joint_tokens=joint), joint, torch.nn.Identity()))
    return runtime


def test_heads_that_ulysses_cannot_divide_fail_naming_the_fix():
    runtime = runtime_at_site(4, 1)
    q = torch.zeros(1, 8, 6 * 2, device="meta")
    with pytest.raises(ValueError, match=r"6 attention heads are not divisible by ulysses_degree 4.*1, 2, 3, 6.*"
                                         r"ring_degree"):
        runtime.attention(sdpa_attention, q, q, q, 6)
    assert runtime.stats.bytes_sent == 0  # failed before any exchange, on every rank alike


def test_a_mask_at_a_site_is_refused_and_cross_shaped_calls_are_caught():
    runtime = runtime_at_site(2, 1)
    q = torch.zeros(1, 8, 16, device="meta")
    with pytest.raises(ValueError, match="mask"):
        runtime.attention(sdpa_attention, q, q, q, 2, mask=torch.ones(8, 8, dtype=torch.bool, device="meta"))
    with pytest.raises(ValueError, match="must be self-attention"):
        runtime.attention(sdpa_attention, q, torch.zeros(1, 5, 16, device="meta"), q, 2)


@pytest.mark.parametrize("ulysses, ring", [(2, 1), (4, 1), (1, 2), (1, 4), (2, 2)])
@pytest.mark.parametrize("heads_first", [False, True])
def test_every_exchange_counts_what_it_sends(ulysses, ring, heads_first):
    """Per attention call with B=1, L tokens per rank, H heads of D, 2-byte elements: Ulysses sends (U-1)/U of q, k,
    v and the output; ring sends its k and v block R-1 times; the joint tokens' output heads go to U-1 peers."""
    b, local, heads, dim, joint = 1, 6, 4, 8, 3
    runtime = runtime_at_site(ulysses, ring, joint=joint)
    if heads_first:
        q = torch.zeros(b, heads, joint + local, dim, dtype=torch.bfloat16, device="meta")
    else:
        q = torch.zeros(b, joint + local, heads * dim, dtype=torch.bfloat16, device="meta")
    out = runtime.attention(sdpa_attention, q, q, q, heads, skip_reshape=heads_first,
                            skip_output_reshape=heads_first)
    assert out.shape == q.shape
    tensor = b * local * heads * dim * 2
    expected = {}
    if ulysses > 1:
        expected["ulysses_all_to_all"] = (2, 4 * tensor * (ulysses - 1) // ulysses)
        expected["ulysses_joint_all_gather"] = (1, b * joint * heads // ulysses * dim * 2 * (ulysses - 1))
    if ring > 1:
        # after the all-to-all a ring block holds U·local tokens of H/U heads: the same bytes as k+v of the shard
        expected["ring_hop"] = (ring - 1, 2 * tensor * (ring - 1))
    assert {k: (r.calls, r.bytes_sent) for k, r in runtime.stats.by_kind.items()} == expected
