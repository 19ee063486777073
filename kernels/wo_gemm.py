"""Weight-only quantized GEMMs on a GPU: ``y = x @ W^T`` with the weight dequantized in registers
and multiplied on the tensor cores, so a decode step reads the narrow weight once and nothing else.

torch's own paths were slower than bf16 at batch 1 on an H200 (docs/benchmarks.md): fp8 through
``torch._scaled_mm`` needs the activations quantized first (extra launches), tinygemm's int4 read
its weights at ~0.8 TB/s, and an int8 LM head was cast to bf16 whole each step. One kernel serves
three weight formats:

- ``fp8`` / ``int8``: ``W [N, K]`` float8 e4m3 or int8, one scale per output row:
  ``w[n, k] = W[n, k] * scale[n]``. The activations stay in their dtype (no per-token quantization).
- ``int4``: ``W [N, K/2]`` uint8, byte ``j`` of a row holding columns ``2j`` (low nibble) and ``2j+1``
  (high nibble); ``scale`` and ``zero`` ``[N, K/G]`` per group of ``G`` columns, in tinygemm's
  convention ``w = (q - 8) * scale + zero``. Each tile lies in one group, so the tile's product is
  taken on the raw codes and scaled once: ``x . w = scale * (x . q) + (zero - 8 scale) * sum(x)``.

The block shapes are tuned once per shape on the GPU (``triton.autotune``, short timing runs);
under triton's interpreter (CPU tests) a fixed block shape runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from core_kernels import interpreting
from core_kernels.common import dot, dot_in_f32


@triton.jit
def _wo_gemm_kernel(X, W, S, Z, Bias, Y, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                    INT4: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, F32: tl.constexpr,
                    DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``DOT``: the tile products on the tensor cores (``BLOCK_M`` >= 16); else as multiply-and-sum
    on the CUDA cores, for 1-4 rows, where a 16-row tensor-core tile would be mostly padding."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = X + rm[:, None].to(tl.int64) * stride_xm
    w_rows = W + rn[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if INT4:  # K % GROUP == 0 and GROUP % BLOCK_K == 0: the tile is whole and in one group
            half = k0 + 2 * tl.arange(0, BLOCK_K // 2)  # even columns; each byte's low nibble
            x_even = tl.load(x_rows + half[None, :], mask=m_ok[:, None], other=0.0)
            x_odd = tl.load(x_rows + (half + 1)[None, :], mask=m_ok[:, None], other=0.0)
            b = tl.load(w_rows + (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :], mask=n_ok[:, None], other=0)
            if F32 or not DOT:  # float32 activations, or bf16 under the interpreter (see common.dot_in_f32)
                x_even, x_odd = x_even.to(tl.float32), x_odd.to(tl.float32)
            lo, hi = (b & 15).to(x_even.dtype), (b >> 4).to(x_even.dtype)  # codes 0..15, exact
            if DOT:
                part = dot(x_even, tl.trans(lo), F32) + dot(x_odd, tl.trans(hi), F32)
            else:
                part = tl.sum(x_even[:, None, :] * lo[None, :, :] + x_odd[:, None, :] * hi[None, :, :], axis=2)
            g = k0 // GROUP
            s = tl.load(S + rn * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)
            z = tl.load(Z + rn * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)
            xsum = tl.sum(x_even.to(tl.float32) + x_odd.to(tl.float32), axis=1)
            acc += part * s[None, :] + xsum[:, None] * (z - 8.0 * s)[None, :]
        else:
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + rk[None, :], mask=m_ok[:, None] & (rk < K)[None, :], other=0.0)
            w = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & (rk < K)[None, :], other=0.0)
            if F32 or not DOT:
                x = x.to(tl.float32)
            w = w.to(x.dtype)
            if DOT:
                acc += dot(x, tl.trans(w), F32)
            else:
                acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if not INT4:
        acc *= tl.load(S + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = Y + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    tl.store(y, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _configs(shapes: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s) for n, k, w, s in shapes]


# 1-4 rows (batch-1 decode): multiply-and-sum over few output rows per program, so even a
# 4096-wide output spreads over every SM with deep K blocks in flight. 5-64 rows: tensor-core tiles
# of 16-64 rows, narrow column blocks. More: GEMM-like tiles.
GEMV = _configs([(4, 512, 4, 3), (8, 512, 4, 3), (8, 256, 4, 4), (16, 256, 8, 3), (4, 1024, 8, 3), (8, 1024, 8, 2),
                 (4, 128, 4, 4), (8, 128, 4, 4), (16, 128, 4, 4), (32, 128, 8, 3), (64, 128, 8, 3)])
FEW_ROWS = _configs([(16, 256, 4, 4), (32, 256, 4, 4), (64, 256, 4, 3), (16, 128, 4, 4), (32, 128, 4, 4),
                     (64, 128, 4, 4), (16, 512, 4, 3), (16, 64, 4, 6), (32, 64, 4, 5), (16, 32, 4, 6)])
MANY_ROWS = _configs([(128, 64, 8, 3), (64, 64, 4, 4), (128, 32, 4, 4), (256, 64, 8, 3), (64, 32, 4, 4)])
FIXED = {"BLOCK_N": 16, "BLOCK_K": 32}  # the interpreter's block (CPU tests)


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """int4 tiles must lie inside one group."""
    args = {**named_args, **kwargs}
    if not args.get("INT4"):
        return configs
    ok = [c for c in configs if args["GROUP"] % c.kwargs["BLOCK_K"] == 0]
    return ok or configs[-1:]


def _bench(fn, quantiles=None, **_):
    """Times a candidate block shape inside a CUDA graph: launched one by one from Python, a
    Triton kernel costs tens of microseconds of host time, more than a decode-sized GEMM takes on
    the GPU, and the choice would follow the host. Short runs (~10 ms a candidate rather than
    triton's ~125): the tuning happens once per shape, at start-up (the CUDA-graph warm-up)."""
    return triton.testing.do_bench_cudagraph(fn, rep=8, quantiles=quantiles)


def _tuner(configs: list[triton.Config]):
    return triton.autotune(configs, key=_KEY, prune_configs_by={"early_config_prune": _prune}, do_bench=_bench)(_wo_gemm_kernel)


_KEY = ["N", "K", "BLOCK_M", "INT4", "GROUP"]
_TUNERS = {"gemv": _tuner(GEMV), "few": _tuner(FEW_ROWS), "many": _tuner(MANY_ROWS)}


def _block_m(m: int) -> int:
    return 1 if m == 1 else 4 if m <= 4 else 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128


def mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
       bias: torch.Tensor | None = None, group: int = 0) -> torch.Tensor:
    """``x [M, K] @ dequant(w)^T (+ bias)`` in ``x``'s dtype. Per-row formats: ``w [N, K]`` (fp8 or
    int8) and ``scale [N]``; int4: ``w [N, K/2]`` uint8 from ``pack_int4``, ``scale``/``zero``
    ``[N, K/group]`` (pass ``group``)."""
    if x.dim() != 2:
        raise ValueError(f"wo_gemm.mm: x {tuple(x.shape)}, want [M, K]")
    int4 = zero is not None
    m, k = x.shape
    n = w.shape[0]
    if (w.shape[1] * 2 if int4 else w.shape[1]) != k:
        raise ValueError(f"wo_gemm.mm: x {tuple(x.shape)} does not match weight {tuple(w.shape)} (int4={int4})")
    if int4 and (group <= 0 or k % group or group % 16 or scale.shape != (n, k // group) or zero.shape != scale.shape):
        raise ValueError(f"wo_gemm.mm: int4 group {group} does not fit K={k} / scales {tuple(scale.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bm = _block_m(m)
    args = (x, w, scale, zero if int4 else scale, bias if bias is not None else scale, y, m, n, k,
            x.stride(0), w.stride(0), scale.stride(0), y.stride(0))
    flags = dict(INT4=int4, GROUP=group if int4 else 0, HAS_BIAS=bias is not None,
                 F32=dot_in_f32(x.dtype), DOT=bm >= 16, BLOCK_M=bm)
    if interpreting() or not x.is_cuda:
        blocks = dict(FIXED, BLOCK_K=min(FIXED["BLOCK_K"], group) if int4 else FIXED["BLOCK_K"])
        grid = (triton.cdiv(n, blocks["BLOCK_N"]), triton.cdiv(m, bm))
        _wo_gemm_kernel[grid](*args, **flags, **blocks)
    else:
        kernel = _TUNERS["gemv" if bm < 16 else "few" if bm <= 64 else "many"]
        kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, bm))](*args, **flags)
    return y


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int4 codes ``[N, K]`` (0..15, any integer dtype) -> ``[N, K/2]`` uint8, even columns low."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_int4``: ``[N, K]`` uint8 codes."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


# Rows up to which fp8 and int8 layers use this kernel on a GPU; past it they use the fp8 tensor
# cores (``torch._scaled_mm``) or cuBLAS on the dequantized weight: such GEMMs are no longer bound
# by the weight read. int4 layers use it for every size.
MAX_ROWS = 64
