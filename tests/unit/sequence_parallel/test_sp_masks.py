"""Host key masks at a sequence-parallel self-attention site (e.g. HunyuanVideo's padded text tokens): the blockwise
kernels with a bias against float64 math, the mask checks, and the entry on 2 and 4 gloo ranks (Ulysses, ring,
hybrid; joint tokens in front and at the rear; padding) against one-process attention with the whole mask."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from omni_hooks.sequence_parallel import (
    ActiveSite,
    PaddingRecord,
    SequenceParallelConfig,
    SequenceParallelRun,
    SequenceParallelSelfAttention,
    attention_math_with_lse,
    attention_with_lse,
)
from omni_hooks.sequence_parallel.attention import additive_key_bias, check_key_mask

TIMEOUT_S = 90


def reference(q, k, v, bias):
    """float64 attention and log-sum-exp over ``[B, H, L, D]`` with an additive bias."""
    scores = (q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5 + bias.double()
    return torch.softmax(scores, -1) @ v.double(), torch.logsumexp(scores, -1)


@pytest.mark.parametrize("blockwise", [attention_with_lse, attention_math_with_lse])
def test_blockwise_attention_applies_a_key_bias(blockwise):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g, dtype=torch.float64) for n in (5, 9, 9))
    keep = torch.rand(2, 1, 1, 9, generator=g) > 0.4
    keep[..., 0] = True
    bias = additive_key_bias(keep, torch.float64)
    out, lse = blockwise(q, k, v, 8 ** -0.5, torch.float64, bias)
    ref_out, ref_lse = reference(q, k, v, torch.where(keep, 0.0, float("-inf")).double())
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_blockwise_attention_applies_a_key_bias_on_cuda(dtype):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, n, 64, generator=g) for n in (37, 53, 53))
    keep = torch.rand(2, 1, 1, 53, generator=g) > 0.4
    keep[..., 0] = True
    bias = additive_key_bias(keep, torch.float32)
    q, k, v = (t.to(dtype) for t in (q, k, v))  # the reference sees the same rounded inputs
    out, lse = attention_with_lse(*(t.cuda() for t in (q, k, v)), 64 ** -0.5, torch.float32, bias.cuda())
    ref_out, ref_lse = reference(q, k, v, torch.where(keep, 0.0, float("-inf")).double())
    tolerance = 5e-3 if dtype == torch.float16 else 1e-4
    torch.testing.assert_close(out.double().cpu(), ref_out, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(lse.double().cpu(), ref_lse, rtol=tolerance, atol=tolerance)


def test_additive_key_bias_layouts():
    mask = torch.tensor([True, False, True])
    assert additive_key_bias(mask, torch.float32).shape == (1, 1, 1, 3)
    assert additive_key_bias(mask.reshape(1, 3), torch.float32).shape == (1, 1, 1, 3)
    assert additive_key_bias(mask.reshape(1, 1, 3), torch.float32).shape == (1, 1, 1, 3)
    bias = additive_key_bias(torch.tensor([[0.0, float("-inf")]]), torch.float32)
    assert bias.flatten().tolist() == [0.0, torch.finfo(torch.float32).min]  # finite: merging stays NaN-free


@pytest.mark.parametrize("shape, message", [
    ((8, 8), "differs between queries"),
    ((1, 8, 8), "differs between queries"),
    ((1, 3, 1, 8), "head dim"),
    ((1, 1, 7), "8 keys"),
    ((1, 1, 1, 1, 8), "8 keys"),
])
def test_masks_that_cannot_be_exchanged_are_refused_naming_why(shape, message):
    with pytest.raises(ValueError, match=message):
        check_key_mask(torch.zeros(shape), heads=4, keys=8)
    check_key_mask(torch.zeros(1, 4, 1, 8), heads=4, keys=8)  # one row per head is fine


# -- on ranks ---------------------------------------------------------------------------------------------------------

def comfy_like_host(calls):
    """A host attention function with ComfyUI's mask convention (2-D -> [1, Lq, Lk], 3-D -> [B, 1, Lq, Lk])."""
    def host(q, k, v, heads, mask=None, skip_reshape=False, skip_output_reshape=False, **kwargs):
        calls.append(None if mask is None else tuple(mask.shape))
        b = q.shape[0]
        qh, kh, vh = (t if skip_reshape else t.reshape(b, -1, heads, t.shape[-1] // heads).transpose(1, 2)
                      for t in (q, k, v))
        if mask is not None:
            if mask.dim() == 2:
                mask = mask.unsqueeze(0)
            if mask.dim() == 3:
                mask = mask.unsqueeze(1)
        out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
        return out if skip_output_reshape else out.transpose(1, 2).reshape(b, -1, heads * out.shape[-1])
    return host


def rank_masked_entry(ulysses: int, ring: int, joint: int, front: bool, image: int, kind: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    runtime = SequenceParallelRun(SequenceParallelConfig(ulysses_degree=ulysses, ring_degree=ring))
    g = torch.Generator().manual_seed(5)
    b, heads, dim = 2, 4, 8
    q, k, v = (torch.randn(b, joint + image, heads, dim, generator=g, dtype=torch.float64) for _ in range(3))
    keep = torch.rand(b, heads if kind == "per_head" else 1, 1, joint + image, generator=g) > 0.3
    keep[..., 0] = True  # every query keeps a key
    if kind == "text_only":  # HunyuanVideo: the image keys always count, the text keys are masked where padded
        keep[..., (joint if front else 0):(joint + image if front else image)] = True
    full_bias = torch.where(keep, 0.0, float("-inf")).double()
    local = -(-image // world)
    if image % world:
        runtime.padding[None] = PaddingRecord(image, local * world)

    def layout(t, dim_):
        """Full ``[joint | image]`` (front) or ``[image | joint]`` (rear) along ``dim_`` -> this rank's part."""
        joint_part = t.narrow(dim_, 0 if front else image, joint)
        img = t.narrow(dim_, joint if front else 0, image)
        pad_shape = list(img.shape)
        pad_shape[dim_] = local * world - image
        img = torch.cat([img, img.new_ones(pad_shape)], dim_).narrow(dim_, rank * local, local)
        return torch.cat([joint_part, img] if front else [img, joint_part], dim_)

    mask = keep if kind != "float" else full_bias  # a float mask in the inputs' dtype, as hosts build it
    local_mask = layout(mask, 3)
    if kind == "float":
        local_mask = local_mask[:, 0]  # [B, 1, Lk]: HunyuanVideo's layout
    calls = []
    site = ActiveSite(SequenceParallelSelfAttention(joint_tokens=joint, joint_position="front" if front else "rear"),
                      joint, torch.nn.Identity())
    runtime.enter_site(site)
    out = runtime.attention(comfy_like_host(calls), layout(q, 1).reshape(b, -1, heads * dim),
                            layout(k, 1).reshape(b, -1, heads * dim), layout(v, 1).reshape(b, -1, heads * dim),
                            heads, mask=local_mask)
    out = out.reshape(b, -1, heads, dim)
    want = reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), full_bias)[0].transpose(1, 2)
    want = layout(want, 1)
    valid = max(0, min(local, image - rank * local))
    keep_rows = list(range(joint)) if front else []
    first_image = joint if front else 0
    keep_rows += list(range(first_image, first_image + valid))
    if not front:
        keep_rows += list(range(local, local + joint))
    rows = torch.tensor(keep_rows, dtype=torch.long)
    error = (out[:, rows] - want[:, rows]).abs().max().item()
    return error, calls, runtime.stats.by_kind["key_mask_all_gather"].calls


@pytest.mark.parametrize("ulysses, ring, joint, front, image, kind", [
    (2, 1, 5, False, 13, "float"),       # HunyuanVideo: [image | text], key mask on text, padded image
    (2, 1, 0, True, 16, "bool"),
    (2, 1, 3, True, 16, "per_head"),
    (1, 2, 5, False, 13, "float"),
    (1, 2, 4, True, 15, "bool"),
    (1, 2, 6, False, 16, "text_only"),
])
def test_masked_entry_on_two_ranks_equals_one_process(rank_pool, ulysses, ring, joint, front, image, kind):
    for error, calls, gathers in rank_pool(2).run(rank_masked_entry, ulysses, ring, joint, front, image, kind,
                                                  timeout=TIMEOUT_S):
        assert error < 1e-10
        assert gathers == 1
        if ring == 1:  # Ulysses hands the host function the mask of the whole key sequence, in its own layout
            expected_dims = 3 if kind == "float" else 4
            assert len(calls) == 1 and len(calls[0]) == expected_dims and calls[0][-1] == joint + min(image, 16)
        else:
            assert calls == []


@pytest.mark.parametrize("ulysses, ring, joint, front, image, kind", [
    (2, 2, 5, False, 14, "float"), (2, 2, 3, True, 16, "per_head")])
def test_masked_entry_on_four_ranks_hybrid_equals_one_process(rank_pool, ulysses, ring, joint, front, image, kind):
    for error, _, gathers in rank_pool(4).run(rank_masked_entry, ulysses, ring, joint, front, image, kind,
                                              timeout=TIMEOUT_S):
        assert error < 1e-10 and gathers == 1
