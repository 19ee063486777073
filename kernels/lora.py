"""Segmented gather matmuls for serving many LoRA adapters in one batch (Punica / S-LoRA's
"SGMV"): a batch's tokens come in consecutive segments, one per request, and each segment
uses one slot of an adapter pool (or none, slot -1). A LoRA layer adds ``B @ (A @ x)`` to a
base projection; ``sgmv_shrink`` computes ``h = A @ x`` (K down to the rank R) and
``sgmv_expand`` adds ``B @ h`` (R up to N) into the base output in place.

One program takes a tile of ``BLOCK_T`` tokens of one segment and a tile of output columns;
it reads its segment's slot, gathers that slot's matrix and walks the reduced dim (K for
shrink, R for expand) in tiles, accumulating in float32. All the per-request matrices of a
pool are padded to one max rank (zero rows/columns past an adapter's own rank), so the
reduction needs no per-slot length. ``max_seg_len`` only sizes the grid (1 for a decode
batch); tiles past a segment's end, and segments without an adapter, exit at once. Nothing
is read back to the host, so with persistent ``seg_start`` / ``seg_slot`` buffers the launch
can be captured in a CUDA graph and replayed with other slot assignments.

Fixed block shapes (no autotune): a graph capture must not tune, and each shape would
compile its candidates. ``tl.dot`` needs tiles of at least 16 in every dim; smaller ranks
or short segments are padded through the masks.

Measured on an H200 (bf16, K = N = 4096, 16 slots, CUDA-graph timed): shrink 9-13 us and expand
4-7 us for 32 decode tokens or four 128-token prefills at rank 16-64. The shrink is latency
bound (one program walks all of K; a split-K would spread it), and a batch mixing one long
prefill with many decode segments pays for the grid's empty tiles (expand 33-53 us at T=512).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from core_kernels.common import dot, dot_in_f32

BLOCK_K = 128  # shrink's reduction tile (H200, K=4096: 15-20% faster than 64, 256 no better)
BLOCK_N = 64  # expand's output-column tile: a 4096-wide output makes 64 programs even for one token


@triton.jit
def _shrink_kernel(
    X, A, SegStart, SegSlot, Out, K, R,
    stride_xt, stride_xk, stride_as, stride_ar, stride_ak, stride_ot, stride_or,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, F32: tl.constexpr,
):
    seg = tl.program_id(0)
    t0 = tl.program_id(1) * BLOCK_T
    start = tl.load(SegStart + seg)
    seg_len = tl.load(SegStart + seg + 1) - start
    if t0 < seg_len:
        slot = tl.load(SegSlot + seg)
        rows = t0 + tl.arange(0, BLOCK_T)
        tmask = rows < seg_len
        tok = (start + rows).to(tl.int64)
        r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = r < R
        acc = tl.zeros([BLOCK_T, BLOCK_R], tl.float32)
        if slot >= 0:  # no adapter: the rows get zeros, without reading x or the pool
            a_rows = A + slot.to(tl.int64) * stride_as + r[None, :].to(tl.int64) * stride_ar  # A^T tile [K, R]
            x_rows = X + tok[:, None] * stride_xt
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                kmask = k < K
                x = tl.load(x_rows + k[None, :] * stride_xk, mask=tmask[:, None] & kmask[None, :], other=0.0)
                a = tl.load(a_rows + k[:, None] * stride_ak, mask=kmask[:, None] & rmask[None, :], other=0.0)
                if not F32:  # a bf16/fp16 dot on the tensor cores; F32 upcasts both instead
                    x = x.to(a.dtype)
                acc += dot(x, a, F32)
        tl.store(Out + tok[:, None] * stride_ot + r[None, :] * stride_or, acc.to(Out.dtype.element_ty),
                 mask=tmask[:, None] & rmask[None, :])


@triton.jit
def _expand_kernel(
    H, B, SegStart, SegSlot, Y, N, R,
    stride_ht, stride_hr, stride_bs, stride_bn, stride_br, stride_yt, stride_yn,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, F32: tl.constexpr,
):
    seg = tl.program_id(0)
    t0 = tl.program_id(1) * BLOCK_T
    start = tl.load(SegStart + seg)
    seg_len = tl.load(SegStart + seg + 1) - start
    slot = tl.load(SegSlot + seg)
    if (t0 < seg_len) & (slot >= 0):  # no adapter: y's rows stay as they are
        rows = t0 + tl.arange(0, BLOCK_T)
        tmask = rows < seg_len
        tok = (start + rows).to(tl.int64)
        n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < N
        b_cols = B + slot.to(tl.int64) * stride_bs + n[None, :].to(tl.int64) * stride_bn  # B^T tile [R, N]
        h_rows = H + tok[:, None] * stride_ht
        acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
        for r0 in range(0, R, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            rmask = r < R
            h = tl.load(h_rows + r[None, :] * stride_hr, mask=tmask[:, None] & rmask[None, :], other=0.0)
            b = tl.load(b_cols + r[:, None] * stride_br, mask=rmask[:, None] & nmask[None, :], other=0.0)
            if not F32:
                h = h.to(b.dtype)
            acc += dot(h, b, F32)
        y_ptrs = Y + tok[:, None] * stride_yt + n[None, :] * stride_yn
        ymask = tmask[:, None] & nmask[None, :]
        y = tl.load(y_ptrs, mask=ymask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + acc).to(Y.dtype.element_ty), mask=ymask)


def _block_t(max_seg_len: int) -> int:
    """Token rows per program: 16 (tl.dot's minimum) for decode-sized segments, 64 for prefill,
    so a long segment reads its adapter's matrix a quarter as often. Two variants per kernel."""
    return 16 if max_seg_len <= 16 else 64


def _f32(act: torch.Tensor, weight: torch.Tensor) -> bool:
    """Dot in IEEE float32 when either operand is float32 (a float32 ``h`` is not rounded to the
    weight's bf16) or when the interpreter cannot do the bf16 dot (see ``common.dot_in_f32``)."""
    return dot_in_f32(act.dtype) or dot_in_f32(weight.dtype)


def _check_segments(name: str, seg_start: torch.Tensor, seg_slot: torch.Tensor, max_seg_len: int) -> int:
    """The segment count ``B``; shapes only (the values stay on the device: no sync)."""
    nseg = seg_slot.shape[0] if seg_slot.dim() == 1 else -1
    if nseg < 0 or seg_start.shape != (nseg + 1,) or max_seg_len < 0:
        raise ValueError(f"{name}: seg_start {tuple(seg_start.shape)} must be [B+1] for seg_slot "
                         f"{tuple(seg_slot.shape)} [B]; max_seg_len {max_seg_len}")
    return nseg


def sgmv_shrink(x: torch.Tensor, a: torch.Tensor, seg_start: torch.Tensor, seg_slot: torch.Tensor,
                max_seg_len: int, out: torch.Tensor) -> None:
    """``out[t] = a[slot(t)] @ x[t]`` for ``x`` ``[T, K]``, ``a`` ``[S, R, K]`` (the pool's A
    matrices, ranks zero-padded to R), ``out`` ``[T, R]`` (its dtype is the result's); rows of
    segments with slot -1 get zeros. ``seg_start`` ``[B+1]`` int32 token offsets (``seg_start[B] ==
    T``), ``seg_slot`` ``[B]`` int32; ``max_seg_len`` at least the longest segment (sizes the grid)."""
    t, k = x.shape
    nseg = _check_segments("sgmv_shrink", seg_start, seg_slot, max_seg_len)
    if a.dim() != 3 or a.shape[2] != k or out.shape != (t, a.shape[1]):
        raise ValueError(f"sgmv_shrink: x {tuple(x.shape)}, a {tuple(a.shape)} [S, R, K], out {tuple(out.shape)} [T, R]")
    r = a.shape[1]
    if t == 0 or nseg == 0 or max_seg_len == 0 or r == 0:
        return
    bt, br = _block_t(max_seg_len), max(16, min(64, triton.next_power_of_2(r)))
    grid = (nseg, triton.cdiv(max_seg_len, bt), triton.cdiv(r, br))
    _shrink_kernel[grid](
        x, a, seg_start, seg_slot, out, k, r,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), out.stride(0), out.stride(1),
        BLOCK_T=bt, BLOCK_R=br, BLOCK_K=BLOCK_K, F32=_f32(x, a), num_warps=4,
    )


def sgmv_expand(h: torch.Tensor, b: torch.Tensor, seg_start: torch.Tensor, seg_slot: torch.Tensor,
                max_seg_len: int, y: torch.Tensor) -> None:
    """``y[t] += b[slot(t)] @ h[t]`` in place for ``h`` ``[T, R]``, ``b`` ``[S, N, R]``, ``y``
    ``[T, N]``; rows of segments with slot -1 are left as they are. ``h`` and ``y`` may be strided
    views (a column slice of the shrink's output for one of several fused projections; a column
    slice of the fused projection's output). Segments as for ``sgmv_shrink``."""
    t, r = h.shape
    nseg = _check_segments("sgmv_expand", seg_start, seg_slot, max_seg_len)
    if b.dim() != 3 or b.shape[2] != r or y.shape != (t, b.shape[1]):
        raise ValueError(f"sgmv_expand: h {tuple(h.shape)}, b {tuple(b.shape)} [S, N, R], y {tuple(y.shape)} [T, N]")
    n = b.shape[1]
    if t == 0 or nseg == 0 or max_seg_len == 0 or n == 0:
        return
    bt, br = _block_t(max_seg_len), max(16, min(64, triton.next_power_of_2(r)))
    grid = (nseg, triton.cdiv(max_seg_len, bt), triton.cdiv(n, BLOCK_N))
    _expand_kernel[grid](
        h, b, seg_start, seg_slot, y, n, r,
        h.stride(0), h.stride(1), b.stride(0), b.stride(1), b.stride(2), y.stride(0), y.stride(1),
        BLOCK_T=bt, BLOCK_N=BLOCK_N, BLOCK_R=br, F32=_f32(h, b), num_warps=4,
    )


# --------------------------------------------------------------------------- references


def _token_slots(t: int, seg_start: torch.Tensor, seg_slot: torch.Tensor) -> torch.Tensor:
    """``[T]`` int64: each token's slot (-1 for none), from the segments."""
    lens = (seg_start[1:] - seg_start[:-1]).long()
    return torch.repeat_interleave(seg_slot.long(), lens, output_size=t)


def sgmv_shrink_ref(x: torch.Tensor, a: torch.Tensor, seg_start: torch.Tensor, seg_slot: torch.Tensor,
                    max_seg_len: int, out: torch.Tensor) -> None:
    """``sgmv_shrink`` in plain torch (float32 math): a per-token gather of the slot's matrix."""
    slots = _token_slots(x.shape[0], seg_start, seg_slot)
    res = torch.einsum("trk,tk->tr", a[slots.clamp(min=0)].float(), x.float())
    out.copy_(res.masked_fill((slots < 0)[:, None], 0.0))


def sgmv_expand_ref(h: torch.Tensor, b: torch.Tensor, seg_start: torch.Tensor, seg_slot: torch.Tensor,
                    max_seg_len: int, y: torch.Tensor) -> None:
    """``sgmv_expand`` in plain torch (float32 math, one rounding to ``y``'s dtype)."""
    slots = _token_slots(h.shape[0], seg_start, seg_slot)
    keep = slots >= 0
    res = y.float() + torch.einsum("tnr,tr->tn", b[slots.clamp(min=0)].float(), h.float())
    y.copy_(torch.where(keep[:, None], res, y.float()))
