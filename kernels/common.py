"""Pieces the attention kernels share: the dot precision, tile sizes, the
capped-score transform and one online-softmax step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from core_kernels import interpreting


def dot_in_f32(dtype: torch.dtype) -> bool:
    """Whether the kernels should compute their dots in IEEE float32.

    float32 inputs: yes, otherwise GPUs round them to TF32 and results drift from the torch
    reference. bfloat16 under the interpreter: yes, its bf16 ``tl.dot`` returns garbage
    (triton 3.9); on a GPU bf16 and fp16 dots run natively."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())


def block_d(head_dim: int) -> int:
    """Head-dim tile: the next power of two (masked past ``head_dim``), at least 16 for ``tl.dot``."""
    return max(16, triton.next_power_of_2(head_dim))


def tile_n(head_dim: int) -> int:
    """Key-tile rows: 64, halved for heads wider than 128 so a tile's registers still fit."""
    return 64 if head_dim <= 128 else 32


def head_stride_ok(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[N, heads, D]`` with unit stride on D (a row stride is fine); copied otherwise."""
    return x if x.stride(-1) == 1 else x.contiguous()


@triton.jit
def dot(a, b, F32: tl.constexpr):
    """``a @ b`` with float32 accumulation; ``F32`` casts both to float32 and keeps IEEE precision."""
    if F32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def soft_cap(s, cap):
    """``cap * tanh(s / cap)`` (Gemma 2's logit soft-capping), tanh written via the sigmoid."""
    return cap * (2.0 * tl.sigmoid(2.0 * s / cap) - 1.0)


@triton.jit
def softmax_step(m_i, s):
    """One online-softmax step over a score tile ``s`` ``[M, N]`` (masked entries -inf).

    Returns (new running max, probabilities ``[M, N]``, rescale factor for the old sums).
    A row with no finite score so far keeps max -inf and gets zeros, never NaN."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    return m_new, p, alpha
