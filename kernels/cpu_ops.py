"""Two of the fused per-layer ops of ``kernels/fused_ops.py`` for CPU tensors, same signatures:
one C++ loop each (``cpu_ops.cpp``) for RMS norm and for rotary of q and k. No ``gated_act``:
torch's vectorised silu and mul are as fast on the CPU. Also the KV store (``store_kv``, for the
``cpu`` attention backend), the slot table's padding (``zero_past``), the sampler's greedy ``argmax``, ``sample_rows`` and ``sample_sorted``; ``add_rms_norm`` (a residual add
and the next norm in one pass) is called from the one-op layer (``kernels/cpu_decode``).

On the CPU the torch ops' cost is dispatch, not arithmetic: norms and rotary took ~1.9 ms of a
10 ms SmolLM2 decode step at batch 1, ~1.1 ms as these loops. The library compiles once per
machine at first use (``core_kernels.cpp_build``); :func:`available` is False, with the reason
logged once, where it cannot be built, and callers then keep the torch ops.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from core_kernels import cpp_build

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
PREFIX = "core_cpu_ops"


@functools.cache
def available() -> bool:
    """Build (first time on this machine) and load the library; False where that fails."""
    return cpp_build.try_load(PREFIX, SOURCE, "cpu_ops", fallback="torch ops")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """RMS norm over the last dim of ``x`` (any leading shape), as ``core.layers.RMSNorm``."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    return torch.ops.core_cpu_ops.rms_norm(x2, weight.contiguous(), eps, offset).view(x.shape)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """``k_cache[loc] = k; v_cache[loc] = v`` (rows of the caches' row shape; dtypes converted)."""
    k = k.to(k_cache.dtype).reshape(k.shape[0], *k_cache.shape[1:])
    v = v.to(v_cache.dtype).reshape(v.shape[0], *v_cache.shape[1:])
    torch.ops.core_cpu_ops.store_kv(k_cache, v_cache, loc, k, v)


def zero_past(table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """A copy of int64 ``table [B, n]`` (contiguous rows) with each row's columns from its
    ``seq_lens`` entry on set to 0: ``table.masked_fill(arange(n) >= seq_lens[:, None], 0)``."""
    return torch.ops.core_cpu_ops.zero_past(table, seq_lens)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` for float32 or bfloat16 ``[rows, n]``: the first index of each row's maximum (NaN first)."""
    return torch.ops.core_cpu_ops.argmax(x if x.stride(-1) == 1 else x.contiguous())


def sample_rows(x: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Per row of float32 ``x`` ``[rows, n]``: the token at ``u`` of softmax(x / temperature) by the
    inverse CDF in column order (``Sampler``'s rows without filters), ``fallback`` where the row
    has no finite distribution."""
    return torch.ops.core_cpu_ops.sample_rows(x if x.stride(-1) == 1 else x.contiguous(), temperature, u, fallback)


def sample_sorted(probs: torch.Tensor, order: torch.Tensor, cols: torch.Tensor, fallback: torch.Tensor,
                  complete: bool) -> torch.Tensor:
    """``Sampler``'s filtered rows over candidates sorted most likely first: the token each row's
    top-k / top-p / min-p prefix gives at its uniform (``cols``: temperature, top_k, top_p, min_p,
    u), as ``sampler._pick_sorted`` does; -1 where the prefix may reach past the candidates
    (unless ``complete``)."""
    return torch.ops.core_cpu_ops.sample_sorted(probs, order, cols, fallback, complete)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX-layout rotary of ``q`` ``[T, H, D]`` and ``k`` ``[T, Hkv, D]`` (row strides free) at
    ``positions``, from float32 caches ``[max_pos, rotary_dim]``; new contiguous tensors."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    try:
        return torch.ops.core_cpu_ops.rotary(positions.to(torch.int64).contiguous(), q, k, cos, sin, rotary_dim)
    except RuntimeError as e:  # the op's shape checks: the same ValueError as the GPU kernel
        raise ValueError(f"rotary: {str(e).splitlines()[0]}") from None
