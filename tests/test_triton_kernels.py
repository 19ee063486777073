"""The Triton kernels (core_kernels) against a plain float64 torch reference.

Without a GPU they run in triton's interpreter (TRITON_INTERPRET=1, set below before any
kernel module is imported), on tiny shapes: GQA and MQA (more query heads per kv head than
one program's 16 rows), head_dim 64 and 128, page sizes 1 and 16 (slots scattered over
shuffled pages), cached prefixes, a sliding window, logit soft-capping, several KV splits,
and mixed decode/prefill rows. The ``gpu`` tests repeat this at realistic shapes in bf16.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # triton reads it when a kernel module is imported
pytest.importorskip("triton")

from core_kernels.decode_attention import decode_attention, num_kv_splits_for  # noqa: E402
from core_kernels.extend_attention import extend_attention  # noqa: E402
from core_kernels.kv_indices import build_kv_indices  # noqa: E402
from core_kernels.store_kv import store_kv  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def scatter_slots(lens: list[int], page_size: int, gen: torch.Generator) -> tuple[list[list[int]], int]:
    """Each sequence's token slots on its own pages, pages taken in a shuffled order (page 0,
    the padding page, never); returns (slots per sequence, pool size in slots)."""
    pages_each = [-(-n // page_size) for n in lens]
    num_pages = sum(pages_each) + 2
    order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    out, i = [], 0
    for n, p in zip(lens, pages_each):
        pages = order[i : i + p]
        i += p
        out.append([pages[j // page_size] * page_size + j % page_size for j in range(n)])
    return out, num_pages * page_size


def table_of(slots: list[list[int]]) -> torch.Tensor:
    """The ``[B, max_len]`` request -> token table rows (0-padded)."""
    width = max(1, max(len(s) for s in slots))
    return torch.tensor([s + [0] * (width - len(s)) for s in slots], dtype=torch.int64, device=DEV)


def reference(q, keys, vals, q_pos, scale, cap=0.0, window=None):
    """float64 softmax attention of q ``[n, H, D]`` at absolute positions ``q_pos`` over
    keys/vals ``[L, Hkv, D]`` at positions 0..L-1 (causal, windowed, capped)."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1)
    v = vals.double().repeat_interleave(group, 1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    if cap:
        s = cap * torch.tanh(s / cap)
    j = torch.arange(keys.shape[0], device=q.device)
    ok = j[None, :] <= q_pos[:, None]
    if window:
        ok &= j[None, :] > q_pos[:, None] - window
    s = s.masked_fill(~ok[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)


# --------------------------------------------------------------------------- store / indices


def test_store_kv_writes_only_the_given_slots_cast_to_the_pool_dtype():
    t, hkv, d = 5, 2, 24  # D not a power of two: the tile is masked
    wide = torch.randn(t, 3 * hkv * d, device=DEV)
    k = wide[:, : hkv * d].view(t, hkv, d)  # a strided view, as a fused QKV projection hands it over
    v = wide[:, hkv * d : 2 * hkv * d].view(t, hkv, d)
    k_pool = torch.zeros(16, hkv, d, dtype=torch.float16, device=DEV)
    v_pool = torch.zeros_like(k_pool)
    loc = torch.tensor([9, 3, 15, 4, 1], device=DEV)
    store_kv(k, v, k_pool, v_pool, loc)
    torch.testing.assert_close(k_pool[loc], k.half())
    torch.testing.assert_close(v_pool[loc], v.half())
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[loc.cpu()] = False
    assert not k_pool[untouched.to(DEV)].any() and not v_pool[untouched.to(DEV)].any()
    with pytest.raises(ValueError, match="store_kv"):
        store_kv(k, v[:, :1], k_pool, v_pool, loc)


def test_build_kv_indices_flattens_table_rows_on_the_device():
    table = torch.arange(40, device=DEV).view(4, 10) + 100
    rows = torch.tensor([2, 0, 3], device=DEV)
    lens = torch.tensor([3, 0, 10], device=DEV)
    indptr, indices = build_kv_indices(table, rows, lens, 13, block=4)  # several blocks for the long row
    assert indptr.tolist() == [0, 3, 3, 13]
    assert indices.tolist() == [120, 121, 122] + list(range(130, 140))
    assert indptr.device == indices.device == table.device


# --------------------------------------------------------------------------- decode

DECODE_CASES = {
    # name: (H, Hkv, D, page_size, splits, window, cap, dtype)
    "gqa-d64-page1": (4, 2, 64, 1, 1, None, 0.0, torch.float32),
    "mqa-d128-page16-splits": (24, 1, 128, 16, 4, None, 0.0, torch.float32),  # group 24: two head tiles
    "gqa-page16-window-cap-splits": (8, 2, 64, 16, 3, 7, 2.0, torch.float32),
    "mha-fp16-d80": (2, 2, 80, 1, 2, None, 0.0, torch.float16),  # head_dim not a power of two
}


@pytest.mark.parametrize("case", list(DECODE_CASES), ids=list(DECODE_CASES))
def test_decode_attention_matches_reference(case):
    h, hkv, d, ps, splits, window, cap, dtype = DECODE_CASES[case]
    gen = torch.Generator().manual_seed(list(DECODE_CASES).index(case))
    lens = [1, 9, 40]  # a 1-key sequence leaves some splits empty
    slots, n = scatter_slots(lens, ps, gen)
    k_pool = torch.randn(n, hkv, d, generator=gen).to(DEV, dtype)
    v_pool = torch.randn(n, hkv, d, generator=gen).to(DEV, dtype)
    q = torch.randn(len(lens), h, d, generator=gen).to(DEV, dtype)
    indptr, indices = build_kv_indices(table_of(slots), torch.arange(len(lens), device=DEV),
                                       torch.tensor(lens, device=DEV), sum(lens))
    scale = d**-0.5
    out = decode_attention(q, k_pool, v_pool, indptr, indices, scale=scale, logit_cap=cap, sliding_window=window,
                           num_kv_splits=splits, block_n=16)
    assert out.shape == q.shape and out.dtype == dtype
    for i, s in enumerate(slots):
        idx = torch.tensor(s, device=DEV)
        ref = reference(q[i : i + 1], k_pool[idx], v_pool[idx], torch.tensor([lens[i] - 1], device=DEV), scale, cap, window)
        torch.testing.assert_close(out[i : i + 1].double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_num_kv_splits_fills_the_gpu_only_when_the_batch_is_small():
    assert num_kv_splits_for(1, 8, 4, 4000, num_sms=132) == 16
    assert num_kv_splits_for(256, 8, 4, 4000, num_sms=132) == 1
    assert num_kv_splits_for(1, 8, 4, 100, num_sms=132) == 1  # too short to split


def test_attention_kernels_reject_mismatched_shapes():
    pool = torch.zeros(8, 2, 16, device=DEV)
    indptr = torch.tensor([0, 1], dtype=torch.int32, device=DEV)
    idx = torch.tensor([1], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="decode_attention"):  # 3 query heads over 2 kv heads
        decode_attention(torch.zeros(1, 3, 16, device=DEV), pool, pool, indptr, idx, scale=1.0)
    with pytest.raises(ValueError, match="decode_attention"):
        decode_attention(torch.zeros(1, 2, 16, device=DEV), pool, pool, indptr, idx, scale=1.0, num_kv_splits=0)
    with pytest.raises(ValueError, match="extend_attention"):  # k has the wrong head_dim
        extend_attention(torch.zeros(1, 2, 16, device=DEV), torch.zeros(1, 2, 8, device=DEV), torch.zeros(1, 2, 8, device=DEV),
                         pool, pool, indptr, torch.zeros(2, dtype=torch.int32, device=DEV), idx, 1, scale=1.0)


# --------------------------------------------------------------------------- extend

EXTEND_CASES = {
    # name: (H, Hkv, D, page_size, prefix lens, new lens, window, cap, dtype)
    "gqa-d64-page1-no-prefix": (4, 2, 64, 1, [0, 0], [5, 17], None, 0.0, torch.float32),
    "gqa-d128-page16-prefix-mixed": (4, 2, 128, 16, [16, 3, 0], [4, 1, 20], None, 0.0, torch.float32),
    "mqa-page16-window-cap": (4, 1, 64, 16, [30, 5], [12, 9], 8, 3.0, torch.float32),
    "gqa-bf16-prefix": (4, 2, 64, 1, [7], [9], None, 0.0, torch.bfloat16),
}


@pytest.mark.parametrize("case", list(EXTEND_CASES), ids=list(EXTEND_CASES))
def test_extend_attention_matches_reference(case):
    h, hkv, d, ps, prefix, ext, window, cap, dtype = EXTEND_CASES[case]
    gen = torch.Generator().manual_seed(list(EXTEND_CASES).index(case))
    lens = [p + e for p, e in zip(prefix, ext)]
    slots, n = scatter_slots(lens, ps, gen)
    k_pool = torch.randn(n, hkv, d, generator=gen).to(DEV, dtype)
    v_pool = torch.randn(n, hkv, d, generator=gen).to(DEV, dtype)
    t = sum(ext)
    q = torch.randn(t, h, d, generator=gen).to(DEV, dtype)
    k = torch.randn(t, hkv, d, generator=gen).to(DEV, dtype)
    v = torch.randn(t, hkv, d, generator=gen).to(DEV, dtype)
    qo = torch.tensor([0] + ext, device=DEV).cumsum(0).to(torch.int32)
    indptr, indices = build_kv_indices(table_of(slots), torch.arange(len(lens), device=DEV),
                                       torch.tensor(prefix, device=DEV), sum(prefix))
    scale = d**-0.5
    # 16-row tiles: a sequence spans several query tiles and several key tiles
    out = extend_attention(q, k, v, k_pool, v_pool, qo, indptr, indices, max(ext), scale=scale, logit_cap=cap,
                           sliding_window=window, block_m=16, block_n=16)
    assert out.shape == q.shape and out.dtype == dtype
    for i, s in enumerate(slots):
        a, b = int(qo[i]), int(qo[i + 1])
        pre = torch.tensor(s[: prefix[i]], dtype=torch.int64, device=DEV)
        keys, vals = torch.cat([k_pool[pre], k[a:b]]), torch.cat([v_pool[pre], v[a:b]])
        ref = reference(q[a:b], keys, vals, torch.arange(prefix[i], lens[i], device=DEV), scale, cap, window)
        torch.testing.assert_close(out[a:b].double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


# --------------------------------------------------------------------------- compiled for a GPU


def compile_for_sm90() -> None:
    """Compile each kernel (bf16 with cap and window; the fp32 IEEE-dot path without) to an
    sm_90 cubin. Triton ships its own ptxas, so this needs no GPU; it catches what the
    interpreter never checks (tile shapes for tl.dot, types carried through loops, constexpr
    branches). Run with TRITON_INTERPRET=0."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from core_kernels import decode_attention as da, extend_attention as ea, kv_indices, store_kv
    from core_kernels.common import block_d, tile_n

    def build(jit, ptrs: dict[str, str], consts: dict, **options) -> None:
        sig = {p.name: "constexpr" if p.name in consts else ptrs.get(p.name, "fp32" if p.name in ("scale", "logit_cap") else "i32")
               for p in jit.params}
        cex = {(i,): consts[p.name] for i, p in enumerate(jit.params) if p.name in consts}
        triton.compile(ASTSource(fn=jit, signature=sig, constexprs=cex), target=GPUTarget("cuda", 90, 32), options=options)

    build(store_kv._store_kv_kernel, {"K": "*bf16", "V": "*bf16", "KPool": "*bf16", "VPool": "*bf16", "Loc": "*i64"},
          dict(HKV=1, D=128, BLOCK_H=1, BLOCK_D=128))
    build(kv_indices._gather_rows_kernel, {"Table": "*i64", "Rows": "*i64", "Lens": "*i64", "Indptr": "*i32", "Out": "*i32"},
          dict(BLOCK=512))
    for dt, d, flags in (("bf16", 128, True), ("fp32", 64, False)):
        io = {"Q": f"*{dt}", "KPool": f"*{dt}", "VPool": f"*{dt}"}
        common = dict(GROUP=4, D=d, BLOCK_D=block_d(d), BLOCK_N=tile_n(d), CAP=flags, WINDOW=flags, F32=dt == "fp32")
        build(da._decode_split_kernel, {**io, "KvIndptr": "*i32", "KvIndices": "*i32", "MidO": "*fp32", "MidLse": "*fp32"},
              dict(common, BLOCK_H=da.BLOCK_H), num_warps=4, num_stages=2)
        build(ea._extend_kernel, {**io, "KNew": f"*{dt}", "VNew": f"*{dt}", "QoIndptr": "*i32", "PrefixIndptr": "*i32",
                                  "PrefixIndices": "*i32", "Out": f"*{dt}"},
              dict(common, BLOCK_M=tile_n(d)), num_warps=4 if d <= 64 else 8, num_stages=1)
    build(da._decode_merge_kernel, {"MidO": "*fp32", "MidLse": "*fp32", "Out": "*bf16"}, dict(D=128, BLOCK_D=128, BLOCK_S=1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the other tests compile and run the kernels")
def test_kernels_compile_for_an_h100_without_one():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    code = "from tests.test_triton_kernels import compile_for_sm90; compile_for_sm90()"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


# --------------------------------------------------------------------------- realistic shapes (GPU)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.gpu
@needs_cuda
def test_kernels_at_llama_8b_shapes_on_gpu(dtype, page_size):
    gen = torch.Generator().manual_seed(0)
    h, hkv, d = 32, 8, 128
    prefix, ext = [0, 700, 1500, 31, 2047], [300, 1, 64, 1, 1]
    lens = [p + e for p, e in zip(prefix, ext)]
    slots, n = scatter_slots(lens, page_size, gen)
    k_pool = torch.randn(n, hkv, d, generator=gen).to(DEV, dtype)
    v_pool = torch.randn(n, hkv, d, generator=gen).to(DEV, dtype)
    table, rows = table_of(slots), torch.arange(len(lens), device=DEV)
    # decode: the newest token of each sequence
    q = torch.randn(len(lens), h, d, generator=gen).to(DEV, dtype)
    indptr, indices = build_kv_indices(table, rows, torch.tensor(lens, device=DEV), sum(lens))
    splits = num_kv_splits_for(len(lens), hkv, h // hkv, max(lens), torch.cuda.get_device_properties(DEV).multi_processor_count)
    out = decode_attention(q, k_pool, v_pool, indptr, indices, scale=d**-0.5, num_kv_splits=splits)
    for i, s in enumerate(slots):
        idx = torch.tensor(s, device=DEV)
        ref = reference(q[i : i + 1], k_pool[idx], v_pool[idx], torch.tensor([lens[i] - 1], device=DEV), d**-0.5)
        torch.testing.assert_close(out[i : i + 1].double(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    # extend over the prefixes, with a window and a cap
    t = sum(ext)
    q, k, v = (torch.randn(t, x, d, generator=gen).to(DEV, dtype) for x in (h, hkv, hkv))
    qo = torch.tensor([0] + ext, device=DEV).cumsum(0).to(torch.int32)
    indptr, indices = build_kv_indices(table, rows, torch.tensor(prefix, device=DEV), sum(prefix))
    out = extend_attention(q, k, v, k_pool, v_pool, qo, indptr, indices, max(ext), scale=d**-0.5, logit_cap=30.0,
                           sliding_window=512)
    for i, s in enumerate(slots):
        a, b = int(qo[i]), int(qo[i + 1])
        pre = torch.tensor(s[: prefix[i]], dtype=torch.int64, device=DEV)
        ref = reference(q[a:b], torch.cat([k_pool[pre], k[a:b]]), torch.cat([v_pool[pre], v[a:b]]),
                        torch.arange(prefix[i], lens[i], device=DEV), d**-0.5, 30.0, 512)
        torch.testing.assert_close(out[a:b].double(), ref, atol=TOL[dtype], rtol=TOL[dtype])
