"""Write a forward's new K/V rows into the paged pool: ``pool[loc[t]] = new[t]`` for K and V
in one launch, cast to the pool's dtype."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from core_kernels.common import head_stride_ok


@triton.jit
def _store_kv_kernel(
    K, V, KPool, VPool, Loc,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kp, stride_kph, stride_vp, stride_vph,
    HKV: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Loc + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < HKV) & (d < D)
    k = tl.load(K + t * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(KPool + slot * stride_kp + h * stride_kph + d, k.to(KPool.dtype.element_ty), mask=mask)
    v = tl.load(V + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(VPool + slot * stride_vp + h * stride_vph + d, v.to(VPool.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, loc: torch.Tensor) -> None:
    """``k``/``v`` ``[T, Hkv, D]`` (any row stride) into ``k_pool``/``v_pool`` ``[slots, Hkv, D]``
    at rows ``loc`` ``[T]`` (int32/int64, distinct). One program per token."""
    t, hkv, d = k.shape
    if v.shape != k.shape or k_pool.shape[1:] != (hkv, d) or v_pool.shape != k_pool.shape or loc.shape != (t,):
        raise ValueError(f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, pool {tuple(k_pool.shape)}, loc {tuple(loc.shape)}")
    if t == 0:
        return
    k, v = head_stride_ok(k), head_stride_ok(v)
    _store_kv_kernel[(t,)](
        k, v, k_pool, v_pool, loc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        HKV=hkv, D=d, BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(d),
    )
