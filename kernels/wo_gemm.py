"""Weight-only quantized GEMMs of few rows on a GPU: ``y = x @ (W * scale)^T`` for fp8 (e4m3)
or int8 weights with one scale per output row, the weight dequantized in registers, so a decode
step reads the narrow weight once and the activations stay in their dtype.

torch's own paths read more: fp8 through ``torch._scaled_mm`` needs the activations quantized
per token first (a launch and a round trip), and an int8 weight went through cuBLAS by casting
the whole weight to bf16 each step (``packed.py``'s fallback, still used past ``MAX_ROWS``).
The products run on the tensor cores in tiles of 16, 32 or 64 rows (one row pads to 16: on an
H200 that was faster than a multiply-and-sum of the single row on the CUDA cores, which read
1.3-1.8 TB/s), over narrow column blocks so that even a 4096-wide output spreads over every SM.
The block shapes are tuned once per shape on the GPU (``triton.autotune``, timed inside CUDA
graphs); under triton's interpreter (CPU tests) a fixed block shape runs.

Measured on an H200 (docs/benchmarks.md): 1.5-2.7 TB/s for fp8 and 2.0-3.2 TB/s for int8 at
Llama-3.1-8B widths, where bf16 cuBLAS reads 3.2-4.3 TB/s: ahead of torch's fp8 path and of the
int8 cast, behind the bytes saved.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from core_kernels import interpreting
from core_kernels.common import dot, dot_in_f32

# Rows up to which the fp8 and int8 layers use this kernel on a GPU; past it they use the fp8
# tensor cores (``torch._scaled_mm``) or cuBLAS: such GEMMs are no longer bound by the weight read.
MAX_ROWS = 64
TUNED = True  # False: the fixed block shape on a GPU too (the tests' many small shapes; no tuning runs)


@triton.jit
def _wo_gemm_kernel(X, W, S, Bias, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                    HAS_BIAS: tl.constexpr, F32: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + rk[None, :], mask=m_ok[:, None] & (rk < K)[None, :], other=0.0)
        w = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & (rk < K)[None, :], other=0.0)
        if F32:  # float32 activations, or bf16 under the interpreter (see common.dot_in_f32)
            x = x.to(tl.float32)
        acc += dot(x, tl.trans(w.to(x.dtype)), F32)  # fp8 e4m3 and int8 values are exact in bf16
    acc *= tl.load(S + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = Y + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    tl.store(y, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _configs(shapes: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s) for n, k, w, s in shapes]


FEW_ROWS = _configs([(16, 256, 4, 4), (32, 256, 4, 4), (64, 256, 4, 3), (16, 128, 4, 4), (32, 128, 4, 4),
                     (64, 128, 4, 4), (16, 512, 4, 3), (16, 64, 4, 6), (32, 64, 4, 5)])
FIXED = {"BLOCK_N": 16, "BLOCK_K": 32}  # untuned: the interpreter's block (CPU tests)


def _bench(fn, quantiles=None, **_):
    """Times a candidate inside a CUDA graph: launched one by one from Python, a Triton kernel
    costs tens of microseconds of host time, more than a decode-sized GEMM takes on the GPU, and
    the choice would follow the host. Short runs (~10 ms a candidate, not triton's ~125): the
    tuning happens once per shape, in the CUDA-graph warm-up at start-up (with graphs off, at a
    shape's first use; a fresh machine also compiles each candidate once, seconds per shape)."""
    return triton.testing.do_bench_cudagraph(fn, rep=8, quantiles=quantiles)


_KEY = ["N", "K", "BLOCK_M"]
_TUNED = triton.autotune(FEW_ROWS, key=_KEY, do_bench=_bench)(_wo_gemm_kernel)


def mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ (w * scale[:, None])^T (+ bias)`` in ``x``'s dtype, ``M <= MAX_ROWS``; ``w``
    ``[N, K]`` float8 e4m3 or int8, ``scale [N]``."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"wo_gemm.mm: x {tuple(x.shape)} does not match the weight {tuple(w.shape)}")
    m, k = x.shape
    n = w.shape[0]
    if m > MAX_ROWS or scale.shape != (n,) or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"wo_gemm.mm: {m} rows (at most {MAX_ROWS}), scale {tuple(scale.shape)} and bias "
                         f"{None if bias is None else tuple(bias.shape)} for {n} outputs")
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    args = (x, w, scale, bias if bias is not None else scale, y, m, n, k, x.stride(0), w.stride(0), y.stride(0))
    flags = dict(HAS_BIAS=bias is not None, F32=dot_in_f32(x.dtype), BLOCK_M=bm)
    if interpreting() or not x.is_cuda or not TUNED:
        _wo_gemm_kernel[(triton.cdiv(n, FIXED["BLOCK_N"]), triton.cdiv(m, bm))](*args, **flags, **FIXED)
    else:
        _TUNED[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, bm))](*args, **flags)
    return y
