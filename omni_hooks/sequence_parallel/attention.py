"""Attention across ranks: Ulysses (all-to-all over heads), ring (online-softmax merge) and their hybrid (USP).

Shapes are written ``[B, L, H, D]`` (batch, tokens, heads, head dim), the canonical layout inside this module.

* Ulysses (DeepSpeed-Ulysses): each rank holds ``L/U`` tokens of all ``H`` heads; one all-to-all gives it all
  ``L`` tokens of ``H/U`` heads (rank ``r``: heads ``[r·H/U, (r+1)·H/U)``), local attention runs on them, the inverse
  all-to-all returns its tokens with all heads.
* Ring: queries stay; key/value blocks travel around the ring while each rank attends to the block it holds and
  merges with the online softmax: ``lse' = logaddexp(lse, lse_b)``,
  ``out' = out·exp(lse - lse') + out_b·exp(lse_b - lse')``.
* Hybrid (USP; the group layout is ``mesh``'s): Ulysses inside groups of U ranks, then ring attention across the
  R groups, then the inverse all-to-all.
* Joint tokens (text kept whole on every rank, "front" ``[text | image]`` or "rear" ``[image | text]``): each rank
  takes its heads of them without communication, attends with them (their keys added once, at ring step 0), and
  the heads of their output are all-gathered over the Ulysses group.
* Padding (``auto_pad``): the padded keys are cut off before attention, so padding needs no attention mask and works
  with mask-blind kernels; padded query rows give values the gather hook drops (with Ulysses alone they are cut too,
  so the host function sees the very queries and keys of one process, and their rows are zeros).
* Split keys (``SequenceParallelCrossAttention``: queries every rank holds whole, keys and values of a split sequence,
  e.g. a short stream attending to a long one): Ulysses exchanges the keys and values for heads as above, each rank
  attends with its heads of the queries and the heads of the output are all-gathered; across a ring each rank attends
  to the keys it holds, and the partial results (output and log-sum-exp) are all-gathered and merged in rank order,
  so every rank holds the same output.
* Host key masks (e.g. HunyuanVideo's padded text tokens): a mask over the keys the rank holds (its shard and the
  joint tokens; the same for every query) is all-gathered over the sequence-parallel group, so each rank knows the
  mask of every key: Ulysses passes the host function the mask of the whole key sequence it attends to, ring adds the
  slice of the key block held at each hop. A mask that differs between queries is refused.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from .comm import Communicator
from .sharding import pad_to

if TYPE_CHECKING:
    from .run import ActiveSite, SequenceParallelRun

# Where ring blocks are computed by torch's math, it is in chunks of query rows so that one chunk's score matrix holds
# at most this many elements (2^25 float32 = 128 MiB), whatever the sequence length.
RING_SCORE_CHUNK_ELEMENTS = 1 << 25

ULYSSES_KIND = "ulysses_all_to_all"
JOINT_KIND = "ulysses_joint_all_gather"
RING_KIND = "ring_hop"
MASK_KIND = "key_mask_all_gather"
CROSS_HEADS_KIND = "cross_heads_all_gather"
CROSS_PARTIAL_KIND = "cross_partial_all_gather"


# -- layouts ------------------------------------------------------------------------------------------------------

def to_canonical(x: torch.Tensor, heads: int, heads_first: bool) -> torch.Tensor:
    """Host layout -> ``[B, L, H, D]``: ``[B, H, L, D]`` if ``heads_first`` else ``[B, L, H·D]``."""
    if heads_first:
        return x.transpose(1, 2)
    b, length, width = x.shape
    return x.reshape(b, length, heads, width // heads)


def from_canonical(x: torch.Tensor, heads_first: bool) -> torch.Tensor:
    """``[B, L, H, D]`` -> host layout (the inverse of ``to_canonical``)."""
    if heads_first:
        return x.transpose(1, 2)
    b, length, heads, dim = x.shape
    return x.reshape(b, length, heads * dim)


# -- Ulysses ------------------------------------------------------------------------------------------------------

def heads_to_sequence(comm: Communicator, x: torch.Tensor) -> torch.Tensor:
    """``[N, B, L/U, H, D]`` (N stacked tensors, e.g. q, k, v) -> ``[N, B, L, H/U, D]`` by one all-to-all; the
    sequence comes back in rank order, this rank keeps head group ``comm.group.rank``."""
    size = comm.size
    if size == 1:
        return x
    n, b, local, heads, dim = x.shape
    send = x.reshape(n, b, local, size, heads // size, dim).permute(3, 0, 1, 2, 4, 5)
    received = comm.all_to_all(send, ULYSSES_KIND)  # [U (source rank = sequence chunk), N, B, L/U, H/U, D]
    return received.permute(1, 2, 0, 3, 4, 5).reshape(n, b, size * local, heads // size, dim)


def sequence_to_heads(comm: Communicator, x: torch.Tensor) -> torch.Tensor:
    """``[B, L, H/U, D]`` -> ``[B, L/U, H, D]``: the inverse of ``heads_to_sequence`` for one tensor."""
    size = comm.size
    if size == 1:
        return x
    b, length, local_heads, dim = x.shape
    send = x.reshape(b, size, length // size, local_heads, dim).permute(1, 0, 2, 3, 4)
    received = comm.all_to_all(send, ULYSSES_KIND)  # [U (source rank = head group), B, L/U, H/U, D]
    return received.permute(1, 2, 0, 3, 4).reshape(b, length // size, size * local_heads, dim)


def head_divisibility_error(heads: int, ulysses_degree: int) -> ValueError:
    divisors = [d for d in range(1, heads + 1) if heads % d == 0]
    return ValueError(
        f"SequenceParallelAttention: {heads} attention heads are not divisible by ulysses_degree {ulysses_degree}; "
        f"fix: use a ulysses_degree that divides {heads} ({', '.join(map(str, divisors))}) and put the remaining "
        f"factor of the world size into ring_degree (ring attention has no head constraint)")


# -- ring -----------------------------------------------------------------------------------------------------------

def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       dtype: torch.dtype, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` over ``k``/``v`` (``[B, H, L, D]``) with its log-sum-exp, in ``dtype``.

    ``bias``: an additive key mask broadcastable to ``[B, H, 1, Lk]`` (finite: see ``additive_key_bias``).
    Returns ``(out [B, H, Lq, D], lse [B, H, Lq])``, both in ``dtype``. Torch's own kernels that return the
    log-sum-exp: on CPU its flash attention computed in ``dtype``; on CUDA its memory-efficient attention on the
    inputs' dtype (accumulating in float32), falling back to the math below for what that kernel refuses (e.g.
    float64); elsewhere ``attention_math_with_lse``.
    """
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=None if bias is None else bias.to(dtype), scale=scale)
    if q.device.type == "cuda":
        kernel_bias = None
        if bias is not None:  # in the inputs' dtype, still finite (float16's range is narrower than the bias's)
            kernel_bias = bias.clamp(min=torch.finfo(q.dtype).min).to(q.dtype).expand(
                q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        try:
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, kernel_bias, True,
                                                                              scale=scale)[:2]
        except RuntimeError:  # a dtype or shape the kernel does not take: exact math instead
            pass
        else:  # the kernel may pad the log-sum-exp's sequence dim (to a multiple of 32)
            return out.to(dtype), lse[..., :q.shape[2]].to(dtype)
    return attention_math_with_lse(q, k, v, scale, dtype, bias)


def attention_math_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                            dtype: torch.dtype, bias: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention_with_lse`` by torch's math in ``dtype``, in chunks of query rows whose score matrix holds at most
    ``RING_SCORE_CHUNK_ELEMENTS`` elements (one chunk for "meta" tensors, which hold no memory). ``bias``: a key
    mask broadcastable to ``[B, H, 1, Lk]``, added to the scores."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    b, h, lq, _ = q.shape
    rows = max(1, RING_SCORE_CHUNK_ELEMENTS // max(1, b * h * k.shape[2]))
    if q.device.type == "meta":
        rows = max(1, lq)
    outs, lses = [], []
    for start in range(0, lq, rows):
        scores = torch.matmul(q[:, :, start:start + rows], k.transpose(-1, -2)) * scale
        if bias is not None:
            scores = scores + bias
        lse = torch.logsumexp(scores, dim=-1)
        outs.append(torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v))
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)


def merge_attention(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor,
                    block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a block's attention into the running result (online softmax): ``out [B, H, L, D]``, ``lse [B, H, L]``.

    ``out`` None starts the result. Neither input is modified.
    """
    if out is None:
        return block_out, block_lse
    merged = torch.logaddexp(lse, block_lse)
    return (out * torch.exp(lse - merged).unsqueeze(-1)
            + block_out * torch.exp(block_lse - merged).unsqueeze(-1)), merged


def ring_attention(comm: Communicator, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                   joint_k: torch.Tensor | None = None, joint_v: torch.Tensor | None = None,
                   valid_keys: Callable[[int], int] | None = None, scale: float | None = None,
                   key_bias: torch.Tensor | None = None, joint_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Ring attention over ``comm``'s group. ``[B, L, H, D]`` tensors; returns ``[B, Lq, H, D]`` in ``q.dtype``.

    ``q``: this rank's queries (all of them stay here); ``k``/``v``: this rank's key/value block, which travels
    around the ring (block of member ``j`` = the ``j``-th segment of the sequence). ``joint_k``/``joint_v``: replicated
    keys every query also attends to, added once at step 0. ``valid_keys(j)``: how many leading keys of member ``j``'s
    block are real (the rest is padding and is left out). ``key_bias``: an additive key mask over the blocks of every
    member in ring order, ``[B|1, H|1, 1, size·block]`` (``additive_key_bias``); ``joint_bias`` the same over the joint
    keys. Blocks are computed by torch itself (``attention_with_lse``:
    they need the log-sum-exp, which a host's attention function does not return) in float32, or float64 for
    float64 inputs, and merged in that precision; the next block is in flight while one is computed.
    """
    size, me = comm.size, comm.group.rank
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qh = q.transpose(1, 2)
    block = torch.stack([k, v])
    out = lse = None
    for step in range(size):
        pending = comm.start_shift(block, RING_KIND) if step < size - 1 else None
        source = (me - step) % size
        keys, values = block[0], block[1]
        keep = keys.shape[1] if valid_keys is None else valid_keys(source)
        keys, values = keys[:, :keep], values[:, :keep]
        bias = None
        if key_bias is not None:
            bias = key_bias[..., source * block.shape[2]:source * block.shape[2] + keep]
        if step == 0 and joint_k is not None:
            keys, values = torch.cat([joint_k, keys], 1), torch.cat([joint_v, values], 1)
            if bias is not None or joint_bias is not None:
                bias = torch.cat([_bias_or_zeros(joint_bias, joint_k.shape[1], bias),
                                  _bias_or_zeros(bias, keep, joint_bias)], -1)
        if keys.shape[1]:
            block_out, block_lse = attention_with_lse(qh, keys.transpose(1, 2), values.transpose(1, 2), scale, dtype,
                                                      bias)
            out, lse = merge_attention(out, lse, block_out, block_lse)
        if pending is not None:
            block = pending.wait()
    if out is None:
        raise ValueError("ring_attention: no key is valid on any rank (an empty sequence)")
    return out.transpose(1, 2).to(q.dtype)


def split_keys_attention(comm: Communicator, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         scale: float | None = None) -> torch.Tensor:
    """Attention of queries every member of ``comm`` holds alike over keys/values split across the members (member
    ``j`` holds the ``j``-th segment; ``k``/``v`` this member's real keys, possibly none). ``[B, L, H, D]`` tensors;
    returns ``[B, Lq, H, D]`` in ``q.dtype``, the same on every member.

    Each member attends to its keys (``attention_with_lse``, float32, or float64 for float64 inputs), the partial
    outputs and their log-sum-exps are all-gathered and merged in member order (``merge_attention``); a member without
    keys adds a part that weighs nothing (zeros where no member holds a key)."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qh = q.transpose(1, 2)
    if k.shape[1]:
        out, lse = attention_with_lse(qh, k.transpose(1, 2), v.transpose(1, 2), scale, dtype)
    else:  # no key here: a part that weighs nothing in the merge
        out = qh.new_zeros(qh.shape, dtype=dtype)
        lse = qh.new_full(qh.shape[:-1], torch.finfo(dtype).min, dtype=dtype)
    parts = comm.all_gather(torch.cat([out, lse.unsqueeze(-1)], -1).unsqueeze(0), 0, CROSS_PARTIAL_KIND)
    merged = merged_lse = None
    for part in parts:
        merged, merged_lse = merge_attention(merged, merged_lse, part[..., :-1], part[..., -1])
    return merged.transpose(1, 2).to(q.dtype)


def _bias_or_zeros(bias: torch.Tensor | None, keys: int, like: torch.Tensor) -> torch.Tensor:
    """``bias``, or a zero bias over ``keys`` keys shaped like ``like`` (the other part of a concatenated mask)."""
    if bias is not None:
        return bias
    return like.new_zeros(*like.shape[:-1], keys)


# -- host masks -----------------------------------------------------------------------------------------------------

def check_key_mask(mask: torch.Tensor, heads: int, keys: int) -> None:
    """ValueError unless ``mask`` is a key mask the entry can exchange: the host's layouts ``[Lk]``, ``[1, Lk]``,
    ``[B, 1, Lk]`` or ``[B, H|1, 1, Lk]`` (one row for every query) over the ``keys`` keys of the call."""
    problem = None
    if mask.dim() > 4 or mask.shape[-1] != keys:
        problem = f"expected {keys} keys in its last dim"
    elif mask.dim() >= 2 and mask.shape[-2] != 1:
        problem = "it differs between queries (only a mask over keys, the same for every query, can be exchanged)"
    elif mask.dim() == 4 and mask.shape[1] not in (1, heads):
        problem = f"its head dim is neither 1 nor the {heads} heads"
    if problem is not None:
        raise ValueError(
            f"SequenceParallelAttention: an attention mask of shape {tuple(mask.shape)} at a sequence-parallel "
            f"self-attention site is not supported: {problem}; fix: run this model without sequence parallelism, or "
            "give the attention a key mask ([B, 1, Lk] or [B, H, 1, Lk])")


def additive_key_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A host key mask as an additive float bias ``[B|1, H|1, 1, Lk]`` in ``dtype``: boolean True (attend) -> 0,
    False -> the most negative finite value; float masks as they are, -inf clamped to that value (a block whose keys
    are all masked then merges with weight 0 instead of giving NaN)."""
    while mask.dim() < 4:
        mask = mask.unsqueeze(0) if mask.dim() < 2 else mask.unsqueeze(1)
    lowest = torch.finfo(dtype).min
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, lowest)
    return mask.to(dtype).clamp(min=lowest)


# -- the host-facing entry -------------------------------------------------------------------------------------------

def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, mask: torch.Tensor | None = None,
                   skip_reshape: bool = False, skip_output_reshape: bool = False, **kwargs: Any) -> torch.Tensor:
    """A local attention function in the hosts' convention (ComfyUI's ``optimized_attention``): ``[B, L, H·D]``
    inputs, or ``[B, H, L, D]`` with ``skip_reshape``; ``[B, L, H·D]`` output, or ``[B, H, L, D]`` with
    ``skip_output_reshape``. Other keyword arguments are ignored. For hosts without their own and for tests."""
    qh, kh, vh = (to_canonical(t, heads, skip_reshape).transpose(1, 2) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
    return out if skip_output_reshape else from_canonical(out.transpose(1, 2), False)


class SequenceParallelAttention:
    """The attention entry a host installs in its attention-override seam.

    Called as ``entry(func, q, k, v, heads, mask=None, skip_reshape=False, skip_output_reshape=False, **kwargs)``,
    the signature of ComfyUI's ``transformer_options["optimized_attention_override"]``: ``func`` is the host's own
    attention function in the convention of ``sdpa_attention``; ``heads`` the head count; other keyword arguments
    are passed on to ``func`` unchanged. RoPE must already be applied to ``q`` and ``k`` (all these hosts do).

    * Outside an attention site of the plan (cross-attention, whose keys every rank holds whole; anything not
      declared) it calls ``func`` unchanged: no communication, no guessing from shapes.
    * Inside one (``SequenceParallelSelfAttention``; q, k, v hold this rank's shard plus the site's joint tokens):
      Ulysses-only runs ``func`` itself on the exchanged tensors (``heads / U`` heads); with a ring it computes the
      blocks itself (see ``ring_attention``), since the merge needs the log-sum-exp. The scale is ``D^-1/2``.
      ``mask`` there must be a key mask over the keys this rank holds, in their layout (``check_key_mask``); Ulysses
      passes ``func`` the mask of the keys it attends to in the host's mask layout (its heads only, for a per-head
      mask), ring applies it to each block. Without a mask, ``func`` gets none (mask-blind kernels work).
    * Inside a cross-attention site (``SequenceParallelCrossAttention``; q holds every query, k and v this rank's
      shard of the split sequence): Ulysses-only runs ``func`` on this rank's heads of the queries and every key of
      those heads, then all-gathers the heads; with a ring, ``split_keys_attention`` merges the partial results. No
      mask is taken there.
    """

    def __init__(self, run: "SequenceParallelRun"):
        self.run = run

    def __call__(self, func: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 heads: int, mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        site = self.run.active_site
        if site is None:
            return func(q, k, v, heads, mask=mask, **kwargs)
        if site.split_keys:
            return self._exchange_split_keys(func, q, k, v, heads, site, mask, kwargs)
        return self._exchange(func, q, k, v, heads, site, mask, kwargs)

    def _exchange_split_keys(self, func: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, heads: int, site: "ActiveSite", mask: torch.Tensor | None,
                             kwargs: dict) -> torch.Tensor:
        rt = self.run
        ulysses, ring = rt.ulysses_comm, rt.ring_comm
        heads_first = bool(kwargs.get("skip_reshape", False))
        out_heads_first = bool(kwargs.get("skip_output_reshape", False))
        where = f"the cross-attention site on {type(site.module).__name__}"
        if mask is not None:
            raise ValueError(f"SequenceParallelAttention: {where} got an attention mask; a cross-attention over "
                             "split keys takes none; fix: run this model without sequence parallelism")
        if heads % ulysses.size:
            raise head_divisibility_error(heads, ulysses.size)
        qc, kc, vc = (to_canonical(t, heads, heads_first) for t in (q, k, v))
        if kc.shape != vc.shape or qc.shape[0] != kc.shape[0] or qc.shape[2:] != kc.shape[2:]:
            raise ValueError(f"SequenceParallelAttention: {where} got q {tuple(qc.shape)}, k {tuple(kc.shape)}, "
                             f"v {tuple(vc.shape)} ([B, L, H, D]): keys and values must match, and the queries' "
                             "batch, heads and head dim theirs")
        kc, vc = heads_to_sequence(ulysses, torch.stack([kc, vc])).unbind(0)
        local_heads = heads // ulysses.size
        qc = qc.narrow(2, ulysses.group.rank * local_heads, local_heads)
        segment = kc.shape[1]  # the keys of one Ulysses group = one ring block
        valid_keys = self._valid_keys(site, segment, ring.size)
        keep = segment if valid_keys is None else valid_keys(ring.group.rank)
        kc, vc = kc[:, :keep], vc[:, :keep]
        if ring.size == 1:
            out = func(*(from_canonical(t, heads_first) for t in (qc, kc, vc)), local_heads, **kwargs)
            out = to_canonical(out, local_heads, out_heads_first)
        else:
            out = split_keys_attention(ring, qc, kc, vc)
        out = ulysses.all_gather(out.contiguous(), 2, CROSS_HEADS_KIND)
        return from_canonical(out, out_heads_first)

    def _exchange(self, func: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  heads: int, site: "ActiveSite", mask: torch.Tensor | None, kwargs: dict) -> torch.Tensor:
        rt = self.run
        ulysses, ring = rt.ulysses_comm, rt.ring_comm
        heads_first = bool(kwargs.get("skip_reshape", False))
        out_heads_first = bool(kwargs.get("skip_output_reshape", False))
        if heads % ulysses.size:
            raise head_divisibility_error(heads, ulysses.size)
        qc, kc, vc = (to_canonical(t, heads, heads_first) for t in (q, k, v))
        if not qc.shape == kc.shape == vc.shape:
            raise ValueError(f"SequenceParallelAttention: a self-attention site got q {tuple(qc.shape)}, k "
                             f"{tuple(kc.shape)}, v {tuple(vc.shape)} ([B, L, H, D]); a site's attention must be "
                             "self-attention over the split sequence; declare cross-attention modules as no site")
        joint, front = site.joint_tokens, site.spec.joint_position == "front"
        length = qc.shape[1]
        if joint > length:
            raise ValueError(f"SequenceParallelAttention: {joint} joint tokens but the attention has {length}")
        if mask is not None:
            check_key_mask(mask, heads, length)

        def split(x: torch.Tensor, dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
            """(joint part, sharded part) along the sequence."""
            cut = joint if front else x.shape[dim] - joint
            first, second = x.narrow(dim, 0, cut), x.narrow(dim, cut, x.shape[dim] - cut)
            return (first, second) if front else (second, first)

        def join(joint_part: torch.Tensor, sharded: torch.Tensor, dim: int = 1) -> torch.Tensor:
            if not joint:
                return sharded
            return torch.cat([joint_part, sharded] if front else [sharded, joint_part], dim)

        (qj, qi), (kj, ki), (vj, vi) = split(qc), split(kc), split(vc)
        qi, ki, vi = heads_to_sequence(ulysses, torch.stack([qi, ki, vi])).unbind(0)
        local_heads = heads // ulysses.size
        if joint:
            first = ulysses.group.rank * local_heads
            qj, kj, vj = (t.narrow(2, first, local_heads) for t in (qj, kj, vj))
        segment = qi.shape[1]  # the tokens of one Ulysses group = one ring block
        valid_keys = self._valid_keys(site, segment, ring.size)
        mask_joint = mask_split = None
        if mask is not None:
            mask_joint, mask_split = self._exchange_mask(mask, heads, local_heads, split)
        if ring.size == 1:  # every key and query of the sequence is here: the padded ones are left out of both
            keep = segment if valid_keys is None else valid_keys(0)
            qi, ki, vi = qi[:, :keep], ki[:, :keep], vi[:, :keep]
            if mask is not None:
                kwargs = {**kwargs, "mask": join(mask_joint, mask_split[..., :keep], -1)}
            out = func(*(from_canonical(t, heads_first) for t in (join(qj, qi), join(kj, ki), join(vj, vi))),
                       local_heads, **kwargs)
            out = to_canonical(out, local_heads, out_heads_first)
        else:
            bias_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
            out = ring_attention(
                ring, join(qj, qi), ki, vi, joint_k=kj if joint else None, joint_v=vj if joint else None,
                valid_keys=valid_keys,
                key_bias=None if mask is None else additive_key_bias(mask_split, bias_dtype),
                joint_bias=None if mask is None or not joint else additive_key_bias(mask_joint, bias_dtype))
        out_joint, out_sharded = split(out)
        out_sharded = sequence_to_heads(ulysses, pad_to(out_sharded, 1, segment))  # padded queries' rows: zeros
        if joint:
            out_joint = ulysses.all_gather(out_joint.contiguous(), 2, JOINT_KIND)
        return from_canonical(join(out_joint, out_sharded), out_heads_first)

    def _exchange_mask(self, mask: torch.Tensor, heads: int, local_heads: int,
                       split: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """A checked key mask over this rank's keys -> (its joint part, the mask of every split key in sequence
        order), both narrowed to this rank's heads when the mask has one row per head. The split part is all-gathered
        over the whole sequence-parallel group (sequence order is rank order), on every rank alike whatever the mask
        holds, so no rank waits for another."""
        mask_joint, mask_split = split(mask, mask.dim() - 1)
        wire = mask_split.to(torch.uint8) if mask_split.dtype == torch.bool else mask_split  # gloo has no bool
        mask_split = self.run.sp_comm.all_gather(wire.contiguous(), mask.dim() - 1, MASK_KIND).to(mask.dtype)
        if mask.dim() == 4 and mask.shape[1] == heads and local_heads != heads:  # after the gather: every rank's
            first = self.run.ulysses_comm.group.rank * local_heads             # keys, this rank's heads
            mask_joint, mask_split = (m.narrow(1, first, local_heads) for m in (mask_joint, mask_split))
        return mask_joint, mask_split

    def _valid_keys(self, site: "ActiveSite", segment: int, ring_size: int) -> Callable[[int], int] | None:
        """Real (unpadded) keys in ring block ``j``, or None when the site's sequence was not padded."""
        record = self.run.padding.get(site.spec.shard_group)
        if record is None or record.pad == 0:
            return None
        if record.padded_len != segment * ring_size:
            raise ValueError(
                f"SequenceParallelAttention: the attention site on {type(site.module).__name__} holds "
                f"{segment * ring_size} split tokens in all, but the padded sequence of shard_group "
                f"{site.spec.shard_group!r} has {record.padded_len}; name the right shard_group in the plan's "
                f"{type(site.spec).__name__} (or joint_tokens, if the site also holds replicated tokens)")
        return lambda j: max(0, min(segment, record.original_len - j * segment))
