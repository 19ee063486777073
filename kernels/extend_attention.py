"""Extend (prefill) attention: each sequence's new tokens attend to its cached prefix and,
causally, to each other (or, verifying draft trees, as a per-sequence tree mask says).

One program takes a tile of ``BLOCK_M`` new tokens of one sequence for one query head. It
first walks the prefix's keys in the pool (through ``prefix_indices``), then the new keys
straight from the forward's K/V (no round trip through the pool), up to the tile's last
token. A sliding window narrows both walks to the keys some token of the tile can see;
soft-capping transforms the scaled scores before the softmax. A decode row is simply a
sequence with one new token, so mixed batches need no special case.

``_extend_tree_kernel`` is the same body (``TREE``) for a verify of draft trees: the new-token
walk covers every new key and reads each score's bit of the sequence's tree mask instead of
comparing indices; the prefix walk is unchanged. The causal kernel keeps its own signature and
launch, so batches without a tree pay nothing for it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from core_kernels.common import block_d, dot, dot_in_f32, head_stride_ok, soft_cap, softmax_step, tile_n


@triton.jit
def _extend_body(
    Q, KNew, VNew, KPool, VPool, QoIndptr, PrefixIndptr, PrefixIndices, Out, TreeMask, TreeOffsets,
    scale, logit_cap, window,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kp, stride_kph, stride_vp, stride_vph, stride_ot, stride_oh,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAP: tl.constexpr, WINDOW: tl.constexpr, F32: tl.constexpr, TREE: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    kvh = h // GROUP
    q_start = tl.load(QoIndptr + b)
    ext = tl.load(QoIndptr + b + 1) - q_start
    if m0 < ext:
        p_start = tl.load(PrefixIndptr + b)
        prefix = tl.load(PrefixIndptr + b + 1) - p_start
        rows = m0 + tl.arange(0, BLOCK_M)  # index among the new tokens; absolute position prefix + rows
        rmask = rows < ext
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        q_rows = (q_start + rows).to(tl.int64)
        q = tl.load(Q + q_rows[:, None] * stride_qt + h * stride_qh + d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

        # 1) the cached prefix, from the pool
        lo = prefix * 0
        if WINDOW:
            lo = tl.maximum(prefix + m0 - window + 1, 0)  # the oldest key the tile's first token sees
        for start in range(lo, prefix, BLOCK_N):
            offs = start + tl.arange(0, BLOCK_N)
            nmask = offs < prefix
            slots = tl.load(PrefixIndices + p_start + offs, mask=nmask, other=0).to(tl.int64)
            kv_mask = nmask[:, None] & dmask[None, :]
            k = tl.load(KPool + slots[:, None] * stride_kp + kvh * stride_kph + d[None, :], mask=kv_mask, other=0.0)
            s = dot(q, tl.trans(k.to(q.dtype)), F32) * scale
            if CAP:
                s = soft_cap(s, logit_cap)
            ok = nmask[None, :]
            if WINDOW:
                ok = ok & (offs[None, :] > (prefix + rows)[:, None] - window)
            s = tl.where(ok, s, float("-inf"))
            m_i, p, alpha = softmax_step(m_i, s)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(VPool + slots[:, None] * stride_vp + kvh * stride_vph + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + dot(p.to(q.dtype), v.to(q.dtype), F32)

        # 2) the new tokens, causally (or as the tree mask says), from this forward's K/V
        lo = m0 * 0
        if WINDOW:
            lo = tl.maximum(m0 - window + 1, 0)
        hi = tl.minimum(ext, m0 + BLOCK_M)
        t_start = b * 0
        if TREE:
            hi = ext  # a mask need not be lower-triangular
            t_start = tl.load(TreeOffsets + b)
        for start in range(lo, hi, BLOCK_N):
            offs = start + tl.arange(0, BLOCK_N)
            nmask = offs < ext
            k_rows = (q_start + offs).to(tl.int64)
            kv_mask = nmask[:, None] & dmask[None, :]
            k = tl.load(KNew + k_rows[:, None] * stride_kt + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
            s = dot(q, tl.trans(k.to(q.dtype)), F32) * scale
            if CAP:
                s = soft_cap(s, logit_cap)
            if TREE:
                bits = tl.load(TreeMask + t_start + rows[:, None] * ext + offs[None, :],
                               mask=rmask[:, None] & nmask[None, :], other=0)
                ok = bits != 0
            else:
                ok = nmask[None, :] & (offs[None, :] <= rows[:, None])
            if WINDOW:
                ok = ok & (offs[None, :] > rows[:, None] - window)
            s = tl.where(ok, s, float("-inf"))
            m_i, p, alpha = softmax_step(m_i, s)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(VNew + k_rows[:, None] * stride_vt + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + dot(p.to(q.dtype), v.to(q.dtype), F32)

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(Out + q_rows[:, None] * stride_ot + h * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
                 mask=rmask[:, None] & dmask[None, :])


@triton.jit
def _extend_kernel(
    Q, KNew, VNew, KPool, VPool, QoIndptr, PrefixIndptr, PrefixIndices, Out,
    scale, logit_cap, window,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kp, stride_kph, stride_vp, stride_vph, stride_ot, stride_oh,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAP: tl.constexpr, WINDOW: tl.constexpr, F32: tl.constexpr,
):
    _extend_body(
        Q, KNew, VNew, KPool, VPool, QoIndptr, PrefixIndptr, PrefixIndices, Out, QoIndptr, QoIndptr,
        scale, logit_cap, window,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_kp, stride_kph, stride_vp, stride_vph, stride_ot, stride_oh,
        GROUP, D, BLOCK_D, BLOCK_M, BLOCK_N, CAP, WINDOW, F32, False,
    )


@triton.jit
def _extend_tree_kernel(
    Q, KNew, VNew, KPool, VPool, QoIndptr, PrefixIndptr, PrefixIndices, Out, TreeMask, TreeOffsets,
    scale, logit_cap,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kp, stride_kph, stride_vp, stride_vph, stride_ot, stride_oh,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAP: tl.constexpr, F32: tl.constexpr,
):
    """The extend kernel for a verify of draft trees: new token i of sequence b sees new token j
    where ``TreeMask[TreeOffsets[b] + i * ext + j]`` (uint8) is nonzero (no sliding window)."""
    _extend_body(
        Q, KNew, VNew, KPool, VPool, QoIndptr, PrefixIndptr, PrefixIndices, Out, TreeMask, TreeOffsets,
        scale, logit_cap, 0,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_kp, stride_kph, stride_vp, stride_vph, stride_ot, stride_oh,
        GROUP, D, BLOCK_D, BLOCK_M, BLOCK_N, CAP, False, F32, True,
    )


def extend_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
    qo_indptr: torch.Tensor, prefix_indptr: torch.Tensor, prefix_indices: torch.Tensor, max_extend_len: int,
    *, scale: float, logit_cap: float = 0.0, sliding_window: int | None = None, out: torch.Tensor | None = None,
    block_m: int | None = None, block_n: int | None = None, tree_mask: torch.Tensor | None = None,
    tree_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the new tokens ``q`` ``[T, H, D]`` (sequence b's are rows
    ``qo_indptr[b]:qo_indptr[b + 1]``, with keys/values ``k``/``v`` ``[T, Hkv, D]``) over their
    sequence's prefix (pool rows ``prefix_indices[prefix_indptr[b]:prefix_indptr[b + 1]]``) and,
    causally, each other. ``max_extend_len`` bounds the new tokens per sequence (it sizes the
    grid). Returns ``[T, H, D]`` in ``q.dtype``.

    A verify of draft trees passes ``tree_mask`` (``ForwardBatch.tree_mask``: per sequence its
    ``[n, n]`` bool matrix, flattened and concatenated) and ``tree_offsets`` (``[B]`` int32, where
    each sequence's matrix starts): new token i then sees new token j where its matrix says so,
    not causally (no sliding window with a tree)."""
    t, h, d = q.shape
    hkv = k.shape[1]
    bsz = qo_indptr.shape[0] - 1
    shapes_ok = k.shape == (t, hkv, d) and v.shape == k.shape and k_pool.shape[1:] == (hkv, d)
    if h % hkv or not shapes_ok or prefix_indptr.shape != (bsz + 1,):
        raise ValueError(f"extend_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, pool {tuple(k_pool.shape)}, "
                         f"qo_indptr {tuple(qo_indptr.shape)}, prefix_indptr {tuple(prefix_indptr.shape)}")
    q, k, v = head_stride_ok(q), head_stride_ok(k), head_stride_ok(v)
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    if t == 0 or bsz == 0:
        return out
    block_m, block_n = block_m or tile_n(d), block_n or tile_n(d)
    grid = (bsz, h, triton.cdiv(max_extend_len, block_m))
    if tree_mask is not None:
        if sliding_window or tree_offsets is None or tree_offsets.shape != (bsz,):
            raise ValueError(f"extend_attention: a tree mask needs tree_offsets [{bsz}] and no sliding window "
                             f"(got {None if tree_offsets is None else tuple(tree_offsets.shape)}, {sliding_window})")
        bits = tree_mask.view(torch.uint8) if tree_mask.dtype == torch.bool else tree_mask.to(torch.uint8)
        _extend_tree_kernel[grid](
            q, k, v, k_pool, v_pool, qo_indptr, prefix_indptr, prefix_indices, out, bits, tree_offsets,
            scale, logit_cap,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), out.stride(0), out.stride(1),
            GROUP=h // hkv, D=d, BLOCK_D=block_d(d), BLOCK_M=block_m, BLOCK_N=block_n,
            CAP=logit_cap > 0, F32=dot_in_f32(q.dtype),
            num_warps=4 if d <= 64 else 8, num_stages=1,
        )
        return out
    _extend_kernel[grid](
        q, k, v, k_pool, v_pool, qo_indptr, prefix_indptr, prefix_indices, out,
        scale, logit_cap, sliding_window or 0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), out.stride(0), out.stride(1),
        GROUP=h // hkv, D=d, BLOCK_D=block_d(d), BLOCK_M=block_m, BLOCK_N=block_n,
        CAP=logit_cap > 0, WINDOW=bool(sliding_window), F32=dot_in_f32(q.dtype),
        num_warps=4 if d <= 64 else 8, num_stages=1,
    )
    return out
