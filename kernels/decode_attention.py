"""Paged decode attention: one new query per sequence over its cached keys.

Stage 1 splits each sequence's keys into ``num_kv_splits`` ranges; one program takes one
(sequence, kv head, split) and computes, for all the query heads sharing that kv head at
once (grouped-query attention: the K/V tile is loaded once for the group), the attention
output over its range and the range's log-sum-exp. Stage 2 merges the splits per head,
weighting each by ``exp(lse_split - lse_max)``. Splitting long sequences keeps the GPU
busy when the batch is small.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from core_kernels.common import block_d, dot, dot_in_f32, head_stride_ok, soft_cap, softmax_step, tile_n

BLOCK_H = 16  # query-head rows per program (tl.dot needs >= 16); a group smaller than this is masked
MAX_KV_SPLITS = 16


@triton.jit
def _decode_split_kernel(
    Q, KPool, VPool, KvIndptr, KvIndices, MidO, MidLse,
    scale, logit_cap, window, num_splits,
    stride_qb, stride_qh, stride_kp, stride_kh, stride_vp, stride_vh,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    CAP: tl.constexpr, WINDOW: tl.constexpr, F32: tl.constexpr,
):
    b = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    head_blocks: tl.constexpr = (GROUP + BLOCK_H - 1) // BLOCK_H
    kvh = hb // head_blocks
    heads = kvh * GROUP + (hb % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < (kvh + 1) * GROUP
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=hmask[:, None] & dmask[None, :], other=0.0)

    kv_start = tl.load(KvIndptr + b)
    kv_len = tl.load(KvIndptr + b + 1) - kv_start
    lo = kv_len * 0
    if WINDOW:
        lo = tl.maximum(kv_len - window, 0)  # the query sits at kv_len - 1; it sees `window` keys
    per_split = tl.cdiv(kv_len - lo, num_splits)
    s_lo = lo + split * per_split
    s_hi = tl.minimum(s_lo + per_split, kv_len)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(s_lo, s_hi, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        nmask = offs < s_hi
        slots = tl.load(KvIndices + kv_start + offs, mask=nmask, other=0).to(tl.int64)
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(KPool + slots[:, None] * stride_kp + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        s = dot(q, tl.trans(k.to(q.dtype)), F32) * scale
        if CAP:
            s = soft_cap(s, logit_cap)
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_i, p, alpha = softmax_step(m_i, s)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(VPool + slots[:, None] * stride_vp + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(q.dtype), v.to(q.dtype), F32)

    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))  # an empty split weighs nothing
    tl.store(MidO + b * stride_mob + heads[:, None] * stride_moh + split * stride_mos + d[None, :], out,
             mask=hmask[:, None] & dmask[None, :])
    tl.store(MidLse + b * stride_mlb + heads * stride_mlh + split, lse, mask=hmask)


@triton.jit
def _decode_merge_kernel(
    MidO, MidLse, Out, num_splits,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    smask = s < num_splits
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    lse = tl.load(MidLse + b * stride_mlb + h * stride_mlh + s, mask=smask, other=float("-inf"))
    top = tl.max(lse, 0)  # finite: a sequence has at least one key, so some split is not empty
    w = tl.exp(lse - top)
    o = tl.load(MidO + b * stride_mob + h * stride_moh + s[:, None] * stride_mos + d[None, :],
                mask=smask[:, None] & dmask[None, :], other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(Out + b * stride_ob + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=dmask)


def num_kv_splits_for(batch_size: int, num_kv_heads: int, group: int, max_kv_len: int, num_sms: int,
                      block_n: int = 64) -> int:
    """How many ranges to split each sequence's keys into: enough programs to fill ~2 waves of
    ``num_sms`` streaming multiprocessors, never a range shorter than two key tiles."""
    programs = batch_size * num_kv_heads * triton.cdiv(group, BLOCK_H)
    want = triton.cdiv(2 * num_sms, max(programs, 1))
    return max(1, min(MAX_KV_SPLITS, want, triton.cdiv(max_kv_len, 2 * block_n)))


def decode_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
    *, scale: float, logit_cap: float = 0.0, sliding_window: int | None = None, num_kv_splits: int = 1,
    out: torch.Tensor | None = None, block_n: int | None = None,
) -> torch.Tensor:
    """Attention of ``q`` ``[B, H, D]`` (the newest token of each sequence) over the pool rows
    ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`` (positions 0.. of sequence b, every sequence
    non-empty), ``k_pool``/``v_pool`` ``[slots, Hkv, D]``. ``sliding_window`` keeps the newest
    that many keys; ``logit_cap`` > 0 soft-caps the scaled scores. Returns ``[B, H, D]`` in ``q.dtype``."""
    bsz, h, d = q.shape
    hkv = k_pool.shape[1]
    if h % hkv or k_pool.shape[2] != d or kv_indptr.shape != (bsz + 1,) or not 1 <= num_kv_splits <= MAX_KV_SPLITS:
        raise ValueError(f"decode_attention: q {tuple(q.shape)}, pool {tuple(k_pool.shape)}, kv_indptr "
                         f"{tuple(kv_indptr.shape)}, num_kv_splits {num_kv_splits}")
    q = head_stride_ok(q)
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    if bsz == 0:
        return out
    group, bd = h // hkv, block_d(d)
    mid_o = torch.empty(bsz, h, num_kv_splits, d, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(bsz, h, num_kv_splits, dtype=torch.float32, device=q.device)
    grid = (bsz, hkv * triton.cdiv(group, BLOCK_H), num_kv_splits)
    _decode_split_kernel[grid](
        q, k_pool, v_pool, kv_indptr, kv_indices, mid_o, mid_lse,
        scale, logit_cap, sliding_window or 0, num_kv_splits,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, D=d, BLOCK_D=bd, BLOCK_H=BLOCK_H, BLOCK_N=block_n or tile_n(d),
        CAP=logit_cap > 0, WINDOW=bool(sliding_window), F32=dot_in_f32(q.dtype),
        num_warps=4, num_stages=2,
    )
    _decode_merge_kernel[(bsz, h)](
        mid_o, mid_lse, out, num_kv_splits,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1),
        D=d, BLOCK_D=bd, BLOCK_S=triton.next_power_of_2(num_kv_splits),
    )
    return out
