"""Segmented gather matmuls for serving many LoRA adapters in one batch (Punica / S-LoRA's
"SGMV"): a batch's tokens come in consecutive segments, one per request, and each segment
uses one slot of an adapter pool (or none, slot -1). A LoRA layer adds ``B @ (A @ x)`` to a
base projection; the shrink computes ``h = A @ x`` (K down to the rank R) and the expand adds
``B @ h`` (R up to N) into the base output in place.

One program takes a tile of ``BLOCK_T`` tokens of one segment and a tile of output columns;
it reads its segment's slot, gathers that slot's matrix and walks the reduced dim in tiles,
accumulating in float32. All the per-request matrices of a pool are padded to one max rank
(zero rows/columns past an adapter's own rank), so the reduction needs no per-slot length.
``max_seg_len`` only sizes the grid; tiles past a segment's end, and segments without an
adapter, exit at once. Nothing is read back to the host, so with persistent segment buffers
the launches can be captured in a CUDA graph and replayed with other slot assignments.

A LoRA layer costs two launches, packed or not (qkv: parts q, k, v; gate_up: two):
``sgmv_shrink_split`` computes every part's ``h`` at once (the parts' A rows are stacked), and
``sgmv_expand_parts`` adds every part's ``B @ h`` in one grid whose column tiles each belong to
one part (up to three parts per launch; a part's width need not be a multiple of the tile: its
last tile is masked). For 16-row token tiles (decode) the shrink splits K into chunks, so that
a decode's few segments still spread over many programs instead of each walking all of K alone;
it writes a float32 partial sum per chunk, and the expand adds the chunks up when it loads ``h``
(in a fixed order: no atomics, results are deterministic). ``sgmv_shrink`` / ``sgmv_expand``
are the one-part forms (``sgmv_shrink`` adds its chunks up with torch: two more launches).

``tok_index`` (optional) maps a segment's positions to token rows: a decode batch grouped by
slot (``LoRAPool``) then makes one segment per adapter (per 16 of its rows), which reads the
adapter's matrices once for all those rows instead of once per request.

Fixed block shapes (no autotune): a graph capture must not tune, and each shape would
compile its candidates. ``tl.dot`` needs tiles of at least 16 in every dim; smaller ranks
or short segments are padded through the masks.

Measured on an H200 before the split-K and the one-launch expand (bf16, K = N = 4096, 16 slots,
CUDA-graph timed): shrink 9-13 us and expand 4-7 us for 32 decode tokens or four 128-token
prefills at rank 16-64; a batch mixing one long prefill with many decode segments pays for the
grid's empty tiles (expand 33-53 us at T=512).
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from core_kernels.common import dot, dot_in_f32

BLOCK_K = 128  # shrink's reduction tile (H200, K=4096: 15-20% faster than 64, 256 no better)
BLOCK_N = 64  # expand's output-column tile for prefill-sized token tiles (64 rows)
BLOCK_N_DECODE = 128  # ... and for 16-row tiles, whose programs do little each (a guess, not measured)
MAX_SPLITS = 16  # K chunks of a split shrink (the expand's load of h is unrolled over them)
SPLIT_MAX_TOKENS = 1024  # no split above: enough programs anyway, and the partial sums grow with T
MAX_PARTS = 3  # parts one expand launch takes (qkv's three); more go in further launches


@triton.jit
def _rows(SegStart, SegSlot, TokIdx, BLOCK_T: tl.constexpr, HAS_IDX: tl.constexpr):
    """This program's segment: (whether it has tokens, slot, token rows [BLOCK_T] int64, mask)."""
    seg = tl.program_id(0)
    t0 = tl.program_id(1) * BLOCK_T
    start = tl.load(SegStart + seg)
    seg_len = tl.load(SegStart + seg + 1) - start
    slot = tl.load(SegSlot + seg)
    rows = t0 + tl.arange(0, BLOCK_T)
    tmask = rows < seg_len
    if HAS_IDX:  # positions -> token rows (a batch grouped by slot)
        tok = tl.load(TokIdx + start + rows, mask=tmask, other=0).to(tl.int64)
    else:
        tok = (start + rows).to(tl.int64)
    return t0 < seg_len, slot, tok, tmask


@triton.jit
def _shrink_kernel(
    X, A, SegStart, SegSlot, TokIdx, Out, K, R, K_CHUNK, R_TILES,
    stride_xt, stride_xk, stride_as, stride_ar, stride_ak, stride_os, stride_ot, stride_or,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, F32: tl.constexpr, HAS_IDX: tl.constexpr,
):
    # grid: (segment, token tile, K chunk * R_TILES + rank tile); chunk c writes Out[c]
    busy, slot, tok, tmask = _rows(SegStart, SegSlot, TokIdx, BLOCK_T, HAS_IDX)
    if busy:
        chunk = tl.program_id(2) // R_TILES
        r = (tl.program_id(2) % R_TILES) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = r < R
        acc = tl.zeros([BLOCK_T, BLOCK_R], tl.float32)
        if slot >= 0:  # no adapter: the rows get zeros, without reading x or the pool
            a_rows = A + slot.to(tl.int64) * stride_as + r[None, :].to(tl.int64) * stride_ar  # A^T tile [K, R]
            x_rows = X + tok[:, None] * stride_xt
            k_lo = chunk * K_CHUNK  # (a multiple of BLOCK_K)
            k_hi = tl.minimum(k_lo + K_CHUNK, K)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                kmask = k < k_hi
                x = tl.load(x_rows + k[None, :] * stride_xk, mask=tmask[:, None] & kmask[None, :], other=0.0)
                a = tl.load(a_rows + k[:, None] * stride_ak, mask=kmask[:, None] & rmask[None, :], other=0.0)
                if not F32:  # a bf16/fp16 dot on the tensor cores; F32 upcasts both instead
                    x = x.to(a.dtype)
                acc += dot(x, a, F32)
        out = Out + chunk.to(tl.int64) * stride_os + tok[:, None] * stride_ot + r[None, :] * stride_or
        tl.store(out, acc.to(Out.dtype.element_ty), mask=tmask[:, None] & rmask[None, :])


@triton.jit
def _expand_kernel(
    H, B, SegStart, SegSlot, TokIdx, Y, R,
    S0, E0, HC0, S1, E1, HC1, S2, E2, HC2, C1, C2,
    stride_hs, stride_ht, stride_hr, stride_bs, stride_bn, stride_br, stride_yt, stride_yn,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SPLITS: tl.constexpr,
    F32: tl.constexpr, HAS_IDX: tl.constexpr,
):
    # grid: (segment, token tile, column tile); tiles [0, C1) are part 0's, [C1, C2) part 1's, the
    # rest part 2's. Part i: output columns [Si, Ei) of Y and B, h columns [HCi, HCi + R)
    busy, slot, tok, tmask = _rows(SegStart, SegSlot, TokIdx, BLOCK_T, HAS_IDX)
    if busy & (slot >= 0):  # no adapter: y's rows stay as they are
        j = tl.program_id(2)
        p1 = j >= C1
        p2 = j >= C2
        first = tl.where(p2, S2, tl.where(p1, S1, S0))
        end = tl.where(p2, E2, tl.where(p1, E1, E0))
        hcol = tl.where(p2, HC2, tl.where(p1, HC1, HC0))
        tile = j - tl.where(p2, C2, tl.where(p1, C1, 0))
        n = first + tile * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < end
        y_ptrs = Y + tok[:, None] * stride_yt + n[None, :].to(tl.int64) * stride_yn
        ymask = tmask[:, None] & nmask[None, :]
        if BLOCK_T == 16:  # decode-sized: y's load goes first, its latency overlapping the loop's
            y = tl.load(y_ptrs, mask=ymask, other=0.0)
        b_cols = B + slot.to(tl.int64) * stride_bs + n[None, :].to(tl.int64) * stride_bn  # B^T tile [R, N]
        acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
        for r0 in range(0, R, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            rmask = r < R
            h_ptrs = H + tok[:, None] * stride_ht + (hcol + r)[None, :].to(tl.int64) * stride_hr
            hmask = tmask[:, None] & rmask[None, :]
            h = tl.load(h_ptrs, mask=hmask, other=0.0).to(tl.float32)
            for c in tl.static_range(1, SPLITS):  # the sum of the shrink's K chunks, in a fixed order (unrolled:
                h += tl.load(h_ptrs + c * stride_hs, mask=hmask, other=0.0)  # the loads are in flight together)
            b = tl.load(b_cols + r[:, None] * stride_br, mask=rmask[:, None] & nmask[None, :], other=0.0)
            if not F32:
                h = h.to(b.dtype)
            acc += dot(h, b, F32)
        if BLOCK_T != 16:  # (a 64-row tile of y held through the loop would spill)
            y = tl.load(y_ptrs, mask=ymask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + acc).to(Y.dtype.element_ty), mask=ymask)


def _block_t(max_seg_len: int) -> int:
    """Token rows per program: 16 (tl.dot's minimum) for decode-sized segments, 64 for prefill,
    so a long segment reads its adapter's matrix a quarter as often. Two variants per kernel."""
    return 16 if max_seg_len <= 16 else 64


def _block_r(r: int) -> int:
    return max(16, min(64, triton.next_power_of_2(r)))


def _f32(act: torch.Tensor, weight: torch.Tensor) -> bool:
    """Dot in IEEE float32 when either operand is float32 (a float32 ``h`` is not rounded to the
    weight's bf16) or when the interpreter cannot do the bf16 dot (see ``common.dot_in_f32``)."""
    return dot_in_f32(act.dtype) or dot_in_f32(weight.dtype)


def k_splits(k: int, tokens: int, max_seg_len: int) -> int:
    """How many K chunks the shrink uses by default: for 16-row token tiles (decode) up to
    ``MAX_SPLITS``, at least two ``BLOCK_K`` tiles each; one for prefill-sized tiles, which
    have programs enough, and above ``SPLIT_MAX_TOKENS`` tokens."""
    if _block_t(max_seg_len) != 16 or tokens > SPLIT_MAX_TOKENS:
        return 1
    return max(1, min(MAX_SPLITS, triton.cdiv(k, BLOCK_K) // 2))


def _chunks(k: int, splits: int) -> tuple[int, int]:
    """(chunk width, a multiple of BLOCK_K; chunk count) for about ``splits`` chunks of K."""
    tiles = triton.cdiv(k, BLOCK_K)
    per = triton.cdiv(tiles, max(1, min(splits, tiles)))
    return per * BLOCK_K, triton.cdiv(tiles, per)


def _check_segments(name: str, seg_start: torch.Tensor, seg_slot: torch.Tensor, max_seg_len: int,
                    tok_index: torch.Tensor | None = None) -> int:
    """The segment count ``B``; shapes only (the values stay on the device: no sync)."""
    nseg = seg_slot.shape[0] if seg_slot.dim() == 1 else -1
    if nseg < 0 or seg_start.shape != (nseg + 1,) or max_seg_len < 0:
        raise ValueError(f"{name}: seg_start {tuple(seg_start.shape)} must be [B+1] for seg_slot "
                         f"{tuple(seg_slot.shape)} [B]; max_seg_len {max_seg_len}")
    if tok_index is not None and (tok_index.dim() != 1 or tok_index.dtype != torch.int32):
        raise ValueError(f"{name}: tok_index must be int32 [positions], got {tok_index.dtype} {tuple(tok_index.shape)}")
    return nseg


def _shrink(x: torch.Tensor, a: torch.Tensor, seg_start: torch.Tensor, seg_slot: torch.Tensor, max_seg_len: int,
            out: torch.Tensor, chunk: int, tok_index: torch.Tensor | None) -> None:
    """Launch the shrink into ``out`` ``[chunks, T, R]`` (chunk ``c`` reduces K columns
    ``[c * chunk, (c + 1) * chunk)``)."""
    nseg, k, r = seg_slot.shape[0], x.shape[1], a.shape[1]
    bt, br = _block_t(max_seg_len), _block_r(r)
    r_tiles = triton.cdiv(r, br)
    grid = (nseg, triton.cdiv(max_seg_len, bt), out.shape[0] * r_tiles)
    _shrink_kernel[grid](
        x, a, seg_start, seg_slot, seg_start if tok_index is None else tok_index, out, k, r, chunk, r_tiles,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), out.stride(0), out.stride(1), out.stride(2),
        BLOCK_T=bt, BLOCK_R=br, BLOCK_K=BLOCK_K, F32=_f32(x, a), HAS_IDX=tok_index is not None, num_warps=4,
    )


def sgmv_shrink(x: torch.Tensor, a: torch.Tensor, seg_start: torch.Tensor, seg_slot: torch.Tensor,
                max_seg_len: int, out: torch.Tensor, *, splits: int | None = None) -> None:
    """``out[t] = a[slot(t)] @ x[t]`` for ``x`` ``[T, K]``, ``a`` ``[S, R, K]`` (the pool's A
    matrices, ranks zero-padded to R), ``out`` ``[T, R]`` (its dtype is the result's); rows of
    segments with slot -1 get zeros. ``seg_start`` ``[B+1]`` int32 token offsets (``seg_start[B] ==
    T``), ``seg_slot`` ``[B]`` int32; ``max_seg_len`` at least the longest segment (sizes the grid).
    ``splits``: K chunks (default ``k_splits``); their float32 partial sums are added with torch."""
    t, k = x.shape
    nseg = _check_segments("sgmv_shrink", seg_start, seg_slot, max_seg_len)
    if a.dim() != 3 or a.shape[2] != k or out.shape != (t, a.shape[1]):
        raise ValueError(f"sgmv_shrink: x {tuple(x.shape)}, a {tuple(a.shape)} [S, R, K], out {tuple(out.shape)} [T, R]")
    if t == 0 or nseg == 0 or max_seg_len == 0 or a.shape[1] == 0:
        return
    chunk, n = _chunks(k, k_splits(k, t, max_seg_len) if splits is None else splits)
    if n == 1:
        _shrink(x, a, seg_start, seg_slot, max_seg_len, out.unsqueeze(0), chunk, None)
        return
    part = torch.empty(n, t, a.shape[1], dtype=torch.float32, device=x.device)
    _shrink(x, a, seg_start, seg_slot, max_seg_len, part, chunk, None)
    out.copy_(part.sum(0))


def sgmv_shrink_split(x: torch.Tensor, a: torch.Tensor, seg_start: torch.Tensor, seg_slot: torch.Tensor,
                      max_seg_len: int, *, splits: int | None = None,
                      tok_index: torch.Tensor | None = None) -> torch.Tensor:
    """The shrink for ``sgmv_expand_parts``: ``[C, T, R]`` whose sum over its first dim is
    ``sgmv_shrink``'s ``out`` (``C`` K chunks, ``splits`` or ``k_splits``'s; float32 when
    ``C > 1``, else ``x``'s dtype). Rows of no segment are left unset; ``tok_index`` ``[P]``
    int32: segment positions -> token rows (segments then index positions, not tokens)."""
    t, k = x.shape
    nseg = _check_segments("sgmv_shrink_split", seg_start, seg_slot, max_seg_len, tok_index)
    if a.dim() != 3 or a.shape[2] != k:
        raise ValueError(f"sgmv_shrink_split: x {tuple(x.shape)}, a {tuple(a.shape)} [S, R, K]")
    chunk, n = _chunks(k, k_splits(k, t, max_seg_len) if splits is None else splits)
    out = torch.empty(n, t, a.shape[1], dtype=x.dtype if n == 1 else torch.float32, device=x.device)
    if t and nseg and max_seg_len and a.shape[1]:
        _shrink(x, a, seg_start, seg_slot, max_seg_len, out, chunk, tok_index)
    return out


def _expand(h: torch.Tensor, b: torch.Tensor, seg_start: torch.Tensor, seg_slot: torch.Tensor, max_seg_len: int,
            y: torch.Tensor, parts: Sequence[tuple[int, int, int]], f32: bool, tok_index: torch.Tensor | None) -> None:
    """Launch the expand for ``parts`` (output start column, width, h column), three at a time."""
    parts = [p for p in parts if p[1] > 0]
    nseg, r = seg_slot.shape[0], b.shape[2]
    bt = _block_t(max_seg_len)
    bn = BLOCK_N if bt == 64 else BLOCK_N_DECODE
    br = 16 if h.shape[0] > 1 else _block_r(r)  # (16: the chunks' tiles of h stay small)
    for i in range(0, len(parts), MAX_PARTS):
        group = parts[i : i + MAX_PARTS]
        tiles = [triton.cdiv(w, bn) for _, w, _ in group]
        cum = [sum(tiles[: j + 1]) for j in range(len(tiles))]
        args: list[int] = []
        for j in range(MAX_PARTS):  # the missing parts: empty, after the last tile
            s, w, hc = group[j] if j < len(group) else (0, 0, 0)
            args += [s, s + w, hc]
        grid = (nseg, triton.cdiv(max_seg_len, bt), cum[-1])
        _expand_kernel[grid](
            h, b, seg_start, seg_slot, seg_start if tok_index is None else tok_index, y, r,
            *args, cum[0], cum[1] if len(cum) > 1 else cum[0],
            h.stride(0), h.stride(1), h.stride(2), b.stride(0), b.stride(1), b.stride(2), y.stride(0), y.stride(1),
            BLOCK_T=bt, BLOCK_N=bn, BLOCK_R=br, SPLITS=h.shape[0], F32=f32,
            HAS_IDX=tok_index is not None, num_warps=4, num_stages=1 if bt == 16 else 3,
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
    if t == 0 or nseg == 0 or max_seg_len == 0 or b.shape[1] == 0:
        return
    _expand(h.unsqueeze(0), b, seg_start, seg_slot, max_seg_len, y, [(0, b.shape[1], 0)], _f32(h, b), None)


def sgmv_expand_parts(h: torch.Tensor, b: torch.Tensor, seg_start: torch.Tensor, seg_slot: torch.Tensor,
                      max_seg_len: int, y: torch.Tensor, spans: Sequence[tuple[int, int]], *,
                      tok_index: torch.Tensor | None = None) -> None:
    """For each part ``p`` with span ``spans[p] = (start, width)``: ``y[t, start : start + width]
    += b[slot(t), start : start + width] @ h[t, p * R : (p + 1) * R]``, all parts in one launch
    (per three). ``h``: ``[T, P * R]``, or ``sgmv_shrink_split``'s ``[C, T, P * R]`` (its chunks
    are summed, then rounded to ``b``'s dtype, as the one-chunk shrink's output is); ``b``
    ``[S, N, R]``, ``y`` ``[T, N]``; columns outside the spans, and rows of segments with slot -1
    or of no segment, are left as they are. Segments and ``tok_index`` as for ``sgmv_shrink_split``."""
    h3 = h.unsqueeze(0) if h.dim() == 2 else h
    nseg = _check_segments("sgmv_expand_parts", seg_start, seg_slot, max_seg_len, tok_index)
    r = b.shape[2] if b.dim() == 3 else -1
    if (h3.dim() != 3 or r < 0 or h3.shape[1:] != (y.shape[0], len(spans) * r) or y.dim() != 2
            or b.shape[1] != y.shape[1] or any(s < 0 or w < 0 or s + w > y.shape[1] for s, w in spans)):
        raise ValueError(f"sgmv_expand_parts: h {tuple(h.shape)} [(C,) T, P*R], b {tuple(b.shape)} [S, N, R], "
                         f"y {tuple(y.shape)} [T, N], spans {list(spans)} within N")
    if h3.shape[0] > MAX_SPLITS:
        raise ValueError(f"sgmv_expand_parts: h has {h3.shape[0]} K chunks, at most {MAX_SPLITS}")
    if y.shape[0] == 0 or nseg == 0 or max_seg_len == 0 or r == 0:
        return
    f32 = _f32(h3, b) if h3.shape[0] == 1 else dot_in_f32(b.dtype)
    _expand(h3, b, seg_start, seg_slot, max_seg_len, y, [(s, w, p * r) for p, (s, w) in enumerate(spans)], f32,
            tok_index)


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
