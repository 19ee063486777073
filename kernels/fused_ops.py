"""The small per-layer ops of a decoder, one launch each on a GPU: RMS norm, rotary embedding
of q and k, the gated activation ``act(gate) * up``, the per-token fp8 quantization of a
linear layer's input (``--quantization fp8``), and the sampler's two routes for sampled rows.

In eager torch each is 5-14 elementwise kernels (float casts, pow, mean, rsqrt, cat, neg, ...),
which at decode batch sizes costs more in launches than in work: a SmolLM2 step was ~1,300
kernels, 43 per layer. Each kernel reproduces the rounding of the torch code in
``core/layers.py`` (which stays the CPU path and the reference): intermediate results are
rounded to the activation dtype where torch rounds them, so greedy outputs do not move.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ACTS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}  # ``act`` ids of gated_act


@triton.jit
def _rms_norm_kernel(X, W, Out, stride_x, stride_o, N, eps, offset,
                     OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if OFFSET:  # Gemma: (x * r) * (offset + w), rounded once
        y = (x * r) * (offset + w)
    else:  # w * (x * r) rounded to the activation dtype, the product rounded again
        y = w * (x * r).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_o + cols, y.to(Out.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """RMS norm over the last dim of ``x`` (any leading shape), as ``core.layers.RMSNorm``."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, x2.stride(0), out.stride(0), n, eps, offset,
                                         OFFSET=bool(offset), BLOCK=triton.next_power_of_2(n))
    return out.view(x.shape)


@triton.jit
def _gated_act_kernel(G, U, Out, stride_g, stride_u, stride_o, N, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        a = g * tl.sigmoid(g)
    elif ACT == 1:
        a = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    else:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = 0.5 * g * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))  # tanh via the sigmoid
    a = a.to(Out.dtype.element_ty).to(tl.float32)  # torch rounds act(gate) before the product
    tl.store(Out + row * stride_o + cols, (a * u).to(Out.dtype.element_ty), mask=mask)


def gated_act(gate: torch.Tensor, up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` for ``[T, N]`` inputs (unit column stride), ``act`` one of ``ACTS``."""
    if act not in ACTS or gate.shape != up.shape or gate.dim() != 2:
        raise ValueError(f"gated_act: act {act!r}, gate {tuple(gate.shape)}, up {tuple(up.shape)}")
    gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    up = up if up.stride(-1) == 1 else up.contiguous()
    t, n = gate.shape
    out = torch.empty(t, n, dtype=gate.dtype, device=gate.device)
    block = min(1024, triton.next_power_of_2(n))
    if t:
        _gated_act_kernel[(t, triton.cdiv(n, block))](gate, up, out, gate.stride(0), up.stride(0), out.stride(0), n,
                                                      ACT=ACTS[act], BLOCK=block)
    return out


@triton.jit
def _rotary_kernel(Q, K, QOut, KOut, Pos, Cos, Sin,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
                   stride_c, H, D: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   BLOCK_REST: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if head < H:
        src, dst = Q + t * stride_qt + head * stride_qh, QOut + t * stride_qot + head * stride_qoh
    else:
        src, dst = K + t * stride_kt + (head - H) * stride_kh, KOut + t * stride_kot + (head - H) * stride_koh
    dty = QOut.dtype.element_ty
    pos = tl.load(Pos + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    m = i < HALF
    # the cache row is [freqs, freqs]: cos/sin of the first half equal those of the second
    c = tl.load(Cos + pos * stride_c + i, mask=m, other=0.0).to(dty).to(tl.float32)
    s = tl.load(Sin + pos * stride_c + i, mask=m, other=0.0).to(dty).to(tl.float32)
    x1 = tl.load(src + i, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + i, mask=m, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product rounded as torch does in the activation dtype
    o1 = (x1 * c).to(dty).to(tl.float32) + (-x2 * s).to(dty).to(tl.float32)
    o2 = (x2 * c).to(dty).to(tl.float32) + (x1 * s).to(dty).to(tl.float32)
    tl.store(dst + i, o1.to(dty), mask=m)
    tl.store(dst + HALF + i, o2.to(dty), mask=m)
    if BLOCK_REST > 0:  # partial rotary: the dims past rotary_dim pass through
        r = 2 * HALF + tl.arange(0, BLOCK_REST)
        mr = r < D
        tl.store(dst + r, tl.load(src + r, mask=mr, other=0.0), mask=mr)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX-layout rotary embedding of ``q`` ``[T, H, D]`` and ``k`` ``[T, Hkv, D]`` (row strides
    free, e.g. views of a fused QKV output) at ``positions`` ``[T]``, from float32 caches
    ``cos``/``sin`` ``[max_pos, rotary_dim]``; new contiguous tensors, one launch for both."""
    t, h, d = q.shape
    hkv = k.shape[1]
    if k.shape[0] != t or k.shape[2] != d or rotary_dim % 2 or rotary_dim > d or cos.shape[1] != rotary_dim:
        raise ValueError(f"rotary: q {tuple(q.shape)}, k {tuple(k.shape)}, rotary_dim {rotary_dim}, cache {tuple(cos.shape)}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    q_out, k_out = torch.empty(t, h, d, dtype=q.dtype, device=q.device), torch.empty(t, hkv, d, dtype=k.dtype, device=k.device)
    if t:
        half = rotary_dim // 2
        rest = d - rotary_dim
        _rotary_kernel[(t, h + hkv)](
            q, k, q_out, k_out, positions, cos, sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1),
            k_out.stride(0), k_out.stride(1), cos.stride(0), h,
            D=d, HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_REST=triton.next_power_of_2(rest) if rest else 0,
        )
    return q_out, k_out


@triton.jit
def _per_token_fp8_kernel(X, Q, S, stride_x, stride_q, N, fp8_max, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + cols, mask=cols < N, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    s = tl.maximum(tl.max(amax, axis=0), 1e-12) / fp8_max
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + cols, mask=cols < N, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -fp8_max), fp8_max)
        tl.store(Q + row * stride_q + cols, q.to(Q.dtype.element_ty), mask=cols < N)
    tl.store(S + row, s)


def per_token_fp8(x: torch.Tensor, fp8_max: float = 448.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[T, K]`` quantized to float8 e4m3 per row, and the rows' float32 scales ``[T, 1]``:
    ``s = max(amax|x|, 1e-12) / fp8_max``, ``q = clamp(x / s)`` (the fp8 plugin's torch ops, which
    are ~9 launches a linear layer)."""
    if x.dim() != 2:
        raise ValueError(f"per_token_fp8: x {tuple(x.shape)}, want [T, K]")
    x = x if x.stride(-1) == 1 else x.contiguous()
    t, k = x.shape
    q = torch.empty(t, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(t, 1, dtype=torch.float32, device=x.device)
    if t:
        _per_token_fp8_kernel[(t,)](x, q, s, x.stride(0), q.stride(0), k, fp8_max,
                                    BLOCK=min(4096, triton.next_power_of_2(k)))
    return q, s


# --------------------------------------------------------------------------- sampling (Sampler's two routes)
# On a GPU the sampler's torch ops for a sampled row are ~15-40 small launches after the graph
# replay (softmax, cumsum, searchsorted, masks, gathers), each costing more host time than GPU
# time at decode batch sizes: a sampled step at batch 1 took 1.2 ms more than a greedy one on an
# H200 (docs/benchmarks.md). These are one launch each, one program per row, the same decisions as
# ``cpu_ops.sample_rows`` / ``sample_sorted`` (float32 sums in block order, so a token can differ
# from the torch ops' only where the target falls within rounding of a boundary of the CDF).


@triton.jit
def _sample_rows_kernel(X, T, U, F, Out, stride_x, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    inv_t = 1.0 / tl.load(T + row)
    m = tl.full([], float("-inf"), tl.float32)  # running max and the mass below it (online softmax)
    total = tl.full([], 0.0, tl.float32)
    nan = tl.full([], 0, tl.int32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < N, other=float("-inf"))
        nan = tl.maximum(nan, tl.max((x != x).to(tl.int32), axis=0))
        m_new = tl.maximum(m, tl.max(tl.where(x != x, float("-inf"), x), axis=0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing finite yet: no NaN from -inf - -inf
        total = total * tl.exp((m - m_ref) * inv_t) + tl.sum(tl.exp((x - m_ref) * inv_t), axis=0)
        m = m_new
    target = tl.load(U + row) * total
    acc = tl.full([], 0.0, tl.float32)
    first = tl.full([], N, tl.int64)  # the first column whose cumulative mass passes the target
    last = tl.full([], -1, tl.int64)  # the last column with mass (the rounding guard)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < N, other=float("-inf"))
        e = tl.where(cols < N, tl.exp((x - m) * inv_t), 0.0)
        c = acc + tl.cumsum(e, axis=0)
        first = tl.minimum(first, tl.min(tl.where((c > target) & (e > 0.0), cols, N), axis=0).to(tl.int64))
        last = tl.maximum(last, tl.max(tl.where(e > 0.0, cols, -1), axis=0).to(tl.int64))
        acc += tl.sum(e, axis=0)
    pick = tl.where(first < N, first, last)
    ok = (nan == 0) & (m > float("-inf")) & (m < float("inf")) & (total > 0.0) & (total < float("inf")) & (pick >= 0)
    tl.store(Out + row, tl.where(ok, pick, tl.load(F + row)))


def sample_rows(x: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Per row of float32 ``x`` ``[rows, n]``: the token at ``u`` of softmax(x / temperature) by the
    inverse CDF in column order (``Sampler``'s rows without filters), ``fallback`` where the row has
    no finite distribution. Temperatures must be > 0 (not checked here: that would wait for the GPU)."""
    rows = _check_rows("sample_rows", x, fallback)
    for name, t in (("temperature", temperature), ("u", u)):
        if t.shape != (rows,) or t.dtype != torch.float32:
            raise ValueError(f"sample_rows: {name} must be float32 [{rows}], got {t.dtype} {tuple(t.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(rows, dtype=torch.long, device=x.device)
    if rows:
        block = min(4096, triton.next_power_of_2(x.shape[1]))
        _sample_rows_kernel[(rows,)](x, temperature.contiguous(), u.contiguous(), fallback.contiguous(), out,
                                     x.stride(0), x.shape[1], BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return out


@triton.jit
def _kept_block(p_row, start, K, acc, top_k, top_p, floor, BLOCK: tl.constexpr):
    """One block of the sorted candidates: (columns, probabilities, kept probabilities), given
    ``acc``, the mass of every candidate before the block (top_p looks at it)."""
    cols = start + tl.arange(0, BLOCK)
    p = tl.load(p_row + cols, mask=cols < K, other=0.0)
    exclusive = acc + tl.cumsum(p, axis=0) - p
    drop = (cols > 0) & ((cols.to(tl.float32) >= top_k) | (exclusive >= top_p) | (p < floor))
    return cols, p, tl.where(drop | (cols >= K), 0.0, p)


@triton.jit
def _sample_sorted_kernel(P, O, C, F, Out, stride_p, stride_o, K, COMPLETE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    p_row = P + row * stride_p
    top_k = tl.load(C + row * 5 + 1)
    top_p = tl.load(C + row * 5 + 2)
    top_p = tl.where(top_p < 1.0, top_p, 3.0)  # 1 (off): a bound no mass reaches
    min_p = tl.load(C + row * 5 + 3)
    u = tl.load(C + row * 5 + 4)
    floor = tl.load(p_row) * min_p
    acc = tl.full([], 0.0, tl.float32)  # mass of every candidate so far (top_p looks at it)
    kept = tl.full([], 0.0, tl.float32)  # mass of the kept ones
    for start in range(0, K, BLOCK):
        _, p, kp = _kept_block(p_row, start, K, acc, top_k, top_p, floor, BLOCK)
        kept += tl.sum(kp, axis=0)
        acc += tl.sum(p, axis=0)
    target = u * kept
    acc2 = tl.full([], 0.0, tl.float32)
    kcum = tl.full([], 0.0, tl.float32)
    first = tl.full([], K, tl.int64)
    last = tl.full([], -1, tl.int64)
    for start in range(0, K, BLOCK):
        cols, p, kp = _kept_block(p_row, start, K, acc2, top_k, top_p, floor, BLOCK)
        c = kcum + tl.cumsum(kp, axis=0)
        first = tl.minimum(first, tl.min(tl.where((c > target) & (kp > 0.0), cols, K), axis=0).to(tl.int64))
        last = tl.maximum(last, tl.max(tl.where(kp > 0.0, cols, -1), axis=0).to(tl.int64))
        kcum += tl.sum(kp, axis=0)
        acc2 += tl.sum(p, axis=0)
    pick = tl.where(first < K, first, last)
    ok = (kept > 0.0) & (kept < float("inf")) & (pick >= 0)
    token = tl.where(ok, tl.load(O + row * stride_o + tl.maximum(pick, 0)), tl.load(F + row))
    if not COMPLETE:  # the kept prefix ends within the candidates iff the next one would be dropped
        fits = (top_k <= K) | (acc >= top_p) | (tl.load(p_row + K - 1) < floor)
        token = tl.where(fits, token, -1)
    tl.store(Out + row, token)


def sample_sorted(probs: torch.Tensor, order: torch.Tensor, cols: torch.Tensor, fallback: torch.Tensor,
                  complete: bool) -> torch.Tensor:
    """``Sampler``'s filtered rows over candidates sorted most likely first: the token each row's
    top-k / top-p / min-p prefix gives at its uniform (``cols`` ``[rows, 5]``: temperature, top_k,
    top_p, min_p, u), as ``sampler._pick_sorted`` does; -1 where the prefix may reach past the
    candidates (unless ``complete``)."""
    rows = _check_rows("sample_sorted", probs, fallback)
    if order.shape != probs.shape or order.dtype != torch.long:
        raise ValueError(f"sample_sorted: order must be int64 {tuple(probs.shape)}, got {order.dtype} {tuple(order.shape)}")
    if cols.shape != (rows, 5) or cols.dtype != torch.float32:
        raise ValueError(f"sample_sorted: cols must be float32 [{rows}, 5], got {cols.dtype} {tuple(cols.shape)}")
    probs = probs if probs.stride(-1) == 1 else probs.contiguous()
    order = order if order.stride(-1) == 1 else order.contiguous()
    out = torch.empty(rows, dtype=torch.long, device=probs.device)
    if rows:
        k = probs.shape[1]
        _sample_sorted_kernel[(rows,)](probs, order, cols.contiguous(), fallback.contiguous(), out, probs.stride(0),
                                       order.stride(0), k, COMPLETE=bool(complete),
                                       BLOCK=min(4096, triton.next_power_of_2(k)))
    return out


def _check_rows(name: str, x: torch.Tensor, fallback: torch.Tensor) -> int:
    if x.dim() != 2 or x.dtype != torch.float32 or x.shape[1] == 0:
        raise ValueError(f"{name}: float32 [rows, n > 0] expected, got {x.dtype} {tuple(x.shape)}")
    if fallback.shape != (x.shape[0],) or fallback.dtype != torch.long:
        raise ValueError(f"{name}: fallback must be int64 [{x.shape[0]}], got {fallback.dtype} {tuple(fallback.shape)}")
    return x.shape[0]
