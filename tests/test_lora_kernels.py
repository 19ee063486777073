"""The multi-LoRA segmented matmuls (core_kernels.lora: ``sgmv_shrink`` / ``sgmv_expand``)
against their plain-torch references.

Without a GPU they run in triton's interpreter (TRITON_INTERPRET=1, set below before any
kernel module is imported), on small shapes: segments of 0, 1, 17, 40 and 70 tokens (one and
several token tiles, ragged ends), slots mixed with -1 (no adapter), adapters of rank 8 and 16
zero-padded in pools of max rank 16 or 32, K of 64, 96 and 300, N of 48 and 130 (a ragged column
tile), float32 (tight) and bfloat16 (loose), ``h`` a strided column slice and ``y`` a column
slice of a wider output whose other columns must stay untouched. The ``gpu`` test repeats this
in bf16 at Llama-sized widths and under CUDA-graph capture and replay with new slot assignments.
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

from core_kernels.lora import sgmv_expand, sgmv_expand_ref, sgmv_shrink, sgmv_shrink_ref  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def segments(lens: list[int], slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(``seg_start`` ``[B+1]``, ``seg_slot`` ``[B]``), both int32 on the test device."""
    start = torch.tensor([0] + lens, device=DEV).cumsum(0).to(torch.int32)
    return start, torch.tensor(slots, dtype=torch.int32, device=DEV)


def adapter_pool(ranks: list[int], max_rank: int, k: int, n: int, dtype: torch.dtype,
                 gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` ``[S, R, K]`` and ``b`` ``[S, N, R]`` for adapters of the given ranks, zero past each
    adapter's own rank (how a pool of one max rank holds smaller adapters)."""
    a = torch.randn(len(ranks), max_rank, k, generator=gen) * k**-0.5
    b = torch.randn(len(ranks), n, max_rank, generator=gen) * max_rank**-0.5
    for s, r in enumerate(ranks):
        a[s, r:] = 0
        b[s, :, r:] = 0
    return a.to(DEV, dtype), b.to(DEV, dtype)


def check(lens: list[int], slots: list[int], ranks: list[int], max_rank: int, k: int, n: int, dtype: torch.dtype,
          max_seg_len: int | None = None, seed: int = 0) -> None:
    """Shrink then expand (into a column slice of a wider output, from a strided slice of a
    wider ``h``) against the references; the output's other columns and the rows without an
    adapter stay exactly as they were."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    seg_start, seg_slot = segments(lens, slots)
    msl = max(lens) if max_seg_len is None else max_seg_len
    a, b = adapter_pool(ranks, max_rank, k, n, dtype, gen)
    x = torch.randn(t, k, generator=gen).to(DEV, dtype)

    out = torch.full((t, max_rank), 7.0, dtype=dtype, device=DEV)  # every row gets written, -1 rows with zeros
    ref = torch.empty_like(out)
    sgmv_shrink(x, a, seg_start, seg_slot, msl, out)
    sgmv_shrink_ref(x, a, seg_start, seg_slot, msl, ref)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    no_adapter = torch.repeat_interleave(seg_slot.long(), torch.tensor(lens, device=DEV)) < 0
    assert (out[no_adapter] == 0).all()

    # h: the middle rank-wide slice of a [T, 3R] shrink output (three fused projections)
    h_wide = torch.randn(t, 3 * max_rank, generator=gen).to(DEV, dtype)
    h = h_wide[:, max_rank : 2 * max_rank]
    y_wide = torch.randn(t, n + 40, generator=gen).to(DEV, dtype)  # y: columns 16..16+n
    before = y_wide.clone()
    y = y_wide[:, 16 : 16 + n]
    y_ref = y.clone()
    sgmv_expand(h, b, seg_start, seg_slot, msl, y)
    sgmv_expand_ref(h, b, seg_start, seg_slot, msl, y_ref)
    torch.testing.assert_close(y.float(), y_ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(y_wide[:, :16], before[:, :16]) and torch.equal(y_wide[:, 16 + n :], before[:, 16 + n :])
    assert torch.equal(y_wide[no_adapter], before[no_adapter])


# --------------------------------------------------------------------------- interpreter (or GPU) at small shapes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k,n", [(64, 48), (96, 130)])
@pytest.mark.parametrize("max_rank", [16, 32])
def test_mixed_segments_match_the_reference(dtype, k, n, max_rank):
    # slots 0 and 2 hold rank-8 adapters, 1 and 3 rank 16; the 0-token segment has an adapter
    check(lens=[17, 0, 1, 40, 1, 17], slots=[2, 0, -1, 1, 3, -1], ranks=[8, 16, 8, 16], max_rank=max_rank,
          k=k, n=n, dtype=dtype)


def test_several_token_tiles_per_segment_and_an_oversized_grid():
    # 70 tokens: two 64-row tiles; K=300: three K tiles, the last ragged; max_seg_len past the
    # longest segment only adds programs that exit
    check(lens=[70, 3, 0, 20], slots=[1, -1, 0, 0], ranks=[16, 8], max_rank=16, k=300, n=48, dtype=torch.float32,
          max_seg_len=150, seed=1)


def test_max_rank_128_spans_two_rank_tiles():
    # shrink: two 64-wide column tiles of R; expand: two 64-deep R tiles in its loop
    check(lens=[5, 9, 1], slots=[1, 0, -1], ranks=[128, 40], max_rank=128, k=96, n=130, dtype=torch.float32, seed=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_batch_one_token_per_segment(dtype):
    check(lens=[1] * 6, slots=[3, -1, 0, 0, 2, 1], ranks=[8, 16, 16, 8], max_rank=16, k=96, n=130, dtype=dtype, seed=2)


def test_all_segments_without_adapter_leave_y_alone_and_zero_the_shrink():
    check(lens=[5, 1, 9], slots=[-1, -1, -1], ranks=[16], max_rank=16, k=64, n=48, dtype=torch.float32, seed=3)


def test_no_tokens_launches_nothing():
    a = torch.ones(2, 16, 64, device=DEV)
    b = torch.ones(2, 48, 16, device=DEV)
    seg_start, seg_slot = segments([0, 0], [0, 1])
    out, y = torch.empty(0, 16, device=DEV), torch.empty(0, 48, device=DEV)
    sgmv_shrink(torch.empty(0, 64, device=DEV), a, seg_start, seg_slot, 0, out)
    sgmv_expand(torch.empty(0, 16, device=DEV), b, seg_start, seg_slot, 0, y)
    seg_start, seg_slot = segments([], [])  # no segments at all
    sgmv_shrink(torch.empty(0, 64, device=DEV), a, seg_start, seg_slot, 0, out)


def test_shape_mismatches_are_refused():
    seg_start, seg_slot = segments([2], [0])
    x, a = torch.randn(2, 64, device=DEV), torch.randn(1, 16, 64, device=DEV)
    with pytest.raises(ValueError, match="sgmv_shrink"):
        sgmv_shrink(x, a, seg_start, seg_slot, 2, torch.empty(2, 8, device=DEV))
    with pytest.raises(ValueError, match="seg_start"):
        sgmv_shrink(x, a, seg_start[:1], seg_slot, 2, torch.empty(2, 16, device=DEV))
    with pytest.raises(ValueError, match="sgmv_expand"):
        sgmv_expand(torch.randn(2, 16, device=DEV), torch.randn(1, 48, 8, device=DEV), seg_start, seg_slot, 2,
                    torch.empty(2, 48, device=DEV))


# --------------------------------------------------------------------------- compiled for a GPU


def compile_for_sm90() -> None:
    """Compile both kernels (bf16 tensor-core dots and the float32 IEEE path, both token tiles)
    to sm_90 cubins: needs no GPU (triton ships ptxas) and catches what the interpreter never
    checks (tl.dot tile shapes, types through the loops). Run with TRITON_INTERPRET=0."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from core_kernels import lora

    def build(jit, ptrs: dict[str, str], consts: dict) -> None:
        sig = {p.name: "constexpr" if p.name in consts else ptrs.get(p.name, "i32") for p in jit.params}
        cex = {(i,): consts[p.name] for i, p in enumerate(jit.params) if p.name in consts}
        triton.compile(ASTSource(fn=jit, signature=sig, constexprs=cex), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4))

    seg = {"SegStart": "*i32", "SegSlot": "*i32"}
    for dt, f32, bt in (("bf16", False, 16), ("bf16", False, 64), ("fp32", True, 16)):
        build(lora._shrink_kernel, {"X": f"*{dt}", "A": f"*{dt}", "Out": f"*{dt}", **seg},
              dict(BLOCK_T=bt, BLOCK_R=16, BLOCK_K=lora.BLOCK_K, F32=f32))
        build(lora._expand_kernel, {"H": f"*{dt}", "B": f"*{dt}", "Y": f"*{dt}", **seg},
              dict(BLOCK_T=bt, BLOCK_N=lora.BLOCK_N, BLOCK_R=64, F32=f32))


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the other tests compile and run the kernels")
def test_kernels_compile_for_an_h100_without_one():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    code = "from tests.test_lora_kernels import compile_for_sm90; compile_for_sm90()"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


# --------------------------------------------------------------------------- realistic shapes (GPU)


@pytest.mark.gpu
@needs_cuda
def test_lora_kernels_at_llama_8b_shapes_and_in_a_cuda_graph():
    dtype = torch.bfloat16
    ranks = [16, 64, 8, 32] * 4  # 16 slots, a max rank of 64
    for k, n in ((4096, 4096), (4096, 1024)):
        # prefill + decode mix (T = 512), then a plain decode batch
        check(lens=[300, 1, 0, 150, 1, 1, 57, 2], slots=[3, -1, 5, 0, 15, 9, 1, -1], ranks=ranks, max_rank=64,
              k=k, n=n, dtype=dtype)
        check(lens=[1] * 32, slots=[i % 17 - 1 for i in range(32)], ranks=ranks, max_rank=64, k=k, n=n, dtype=dtype)
    check(lens=[200, 1, 311], slots=[2, 7, -1], ranks=[16] * 16, max_rank=16, k=4096, n=4096, dtype=dtype)

    # CUDA graph: persistent buffers, captured once, replayed with new slots (and segment bounds)
    gen = torch.Generator().manual_seed(4)
    k, n, r, t = 4096, 1024, 64, 48
    a, b = adapter_pool(ranks, r, k, n, dtype, gen)
    x = torch.randn(t, k, generator=gen).to(DEV, dtype)
    y0 = torch.randn(t, n, generator=gen).to(DEV, dtype)
    seg_start, seg_slot = segments([1] * t, [0] * t)
    h, y = torch.empty(t, r, dtype=dtype, device=DEV), y0.clone()

    def step() -> None:
        sgmv_shrink(x, a, seg_start, seg_slot, 4, h)
        sgmv_expand(h, b, seg_start, seg_slot, 4, y)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for rep in range(3):
        lens = [1] * t if rep != 1 else [4] * (t // 4) + [0] * (t - t // 4)  # max_seg_len 4 sized the grid
        slots = torch.randint(-1, len(ranks), (t,), generator=gen).tolist()
        new_start, new_slot = segments(lens, slots)
        seg_start.copy_(new_start)
        seg_slot.copy_(new_slot)
        y.copy_(y0)
        graph.replay()
        torch.cuda.synchronize()
        h_ref, y_ref = torch.empty_like(h), y0.clone()
        sgmv_shrink_ref(x, a, seg_start, seg_slot, 4, h_ref)
        sgmv_expand_ref(h_ref, b, seg_start, seg_slot, 4, y_ref)
        torch.testing.assert_close(h.float(), h_ref.float(), atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(y.float(), y_ref.float(), atol=3e-2, rtol=3e-2)
