"""The small per-layer ops of a decoder, one launch each on a GPU: RMS norm, rotary embedding
of q and k, the gated activation ``act(gate) * up``, and the per-token fp8 quantization of a
linear layer's input (``--quantization fp8``).

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
