"""The multi-LoRA segmented matmuls (core_kernels.lora: ``sgmv_shrink`` / ``sgmv_expand``)
against their plain-torch references.

Without a GPU they run in triton's interpreter (TRITON_INTERPRET=1, set below before any
kernel module is imported), on small shapes: segments of 0, 1, 17, 40 and 70 tokens (one and
several token tiles, ragged ends), slots mixed with -1 (no adapter), adapters of rank 8 and 16
zero-padded in pools of max rank 16 or 32, K of 64, 96 and 300, N of 48 and 130 (a ragged column
tile), float32 (tight) and bfloat16 (loose), ``h`` a strided column slice and ``y`` a column
slice of a wider output whose other columns must stay untouched. The split-K shrink (K of 300,
700 and 1000 in 2-4 chunks, the last ragged; T of 1 to 40) and a packed layer's two launches
(``sgmv_shrink_split`` / ``sgmv_expand_parts``: unequal parts, ragged and gapped spans, four
parts in two launches, tokens regrouped by slot through a token index) are checked the same way.
The ``gpu`` tests repeat this in bf16 at Llama-sized widths and under CUDA-graph capture and
replay with new slot assignments.
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

from core_kernels.lora import (  # noqa: E402
    k_splits,
    sgmv_expand,
    sgmv_expand_parts,
    sgmv_expand_ref,
    sgmv_shrink,
    sgmv_shrink_ref,
    sgmv_shrink_split,
)

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


# --------------------------------------------------------------------------- split-K shrink


@pytest.mark.parametrize("lens,slots", [
    ([1], [2]),
    ([1] * 40, [i % 5 - 1 for i in range(40)]),  # a decode batch, every fifth row on no adapter
    ([3, 0, 16, 1, 9, 11], [0, 1, -1, 2, 1, 3]),  # T=40 in segments of up to 16: 16-row tiles
    ([40], [1]),  # a 64-row tile (no split by default; forced below)
], ids=["t1", "decode40", "mixed40", "seg40"])
@pytest.mark.parametrize("k,splits", [(300, 2), (300, 3), (1000, None), (1000, 3)])
def test_split_k_shrink_matches_the_reference(lens, slots, k, splits):
    # K=300: 3 tiles of 128 in 2 chunks (256 + 44) or 3 (the last ragged); K=1000: 8 tiles, by
    # default 4 chunks for 16-row tiles (k_splits), or 3 (3 + 3 + 2 tiles, the last ragged)
    gen = torch.Generator().manual_seed(len(lens) + k)
    t = sum(lens)
    seg_start, seg_slot = segments(lens, slots)
    a, _ = adapter_pool([16, 8, 16, 4], 16, k, 16, torch.float32, gen)
    x = torch.randn(t, k, generator=gen).to(DEV)
    out, ref = torch.full((t, 16), 7.0, device=DEV), torch.empty(t, 16, device=DEV)
    sgmv_shrink(x, a, seg_start, seg_slot, max(lens), out, splits=splits)
    sgmv_shrink_ref(x, a, seg_start, seg_slot, max(lens), ref)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    part = sgmv_shrink_split(x, a, seg_start, seg_slot, max(lens), splits=splits)
    want = splits or (k_splits(k, t, max(lens)))
    assert part.shape == (want, t, 16) and part.dtype == torch.float32
    torch.testing.assert_close(part.sum(0), ref, atol=1e-4, rtol=1e-4)
    no_adapter = torch.repeat_interleave(seg_slot.long(), torch.tensor(lens, device=DEV)) < 0
    assert (part[:, no_adapter] == 0).all()


def test_split_k_shrink_in_bf16():
    check(lens=[1] * 9, slots=[3, -1, 0, 0, 2, 1, 1, -1, 3], ranks=[8, 16, 16, 8], max_rank=16, k=700, n=48,
          dtype=torch.bfloat16, seed=6)  # K=700: 6 tiles, 3 chunks by default
    assert k_splits(700, 9, 1) == 3


def test_split_count_follows_the_token_tile():
    assert k_splits(4096, 64, 1) == k_splits(14336, 256, 16) == 16  # decode: up to 16 chunks of 2+ tiles
    assert k_splits(4096, 64, 17) == 1 and k_splits(4096, 2048, 1) == 1  # 64-row tiles; many tokens
    assert k_splits(1000, 8, 1) == 4 and k_splits(300, 8, 1) == 1 and k_splits(64, 1, 1) == 1


# --------------------------------------------------------------------------- a packed layer in two launches


def grouped(lens: list[int], slots: list[int], chunk: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The tokens of ``lens`` / ``slots`` regrouped by slot into segments of at most ``chunk``
    positions, as ``LoRAPool`` groups a decode: (seg_start, seg_slot, tok_index, max_seg_len);
    tokens on no adapter are in no segment."""
    starts = [sum(lens[:i]) for i in range(len(lens))]
    order = sorted((s, starts[i] + j) for i, s in enumerate(slots) if s >= 0 for j in range(lens[i]))
    seg_start, seg_slot = [], []
    for i, (s, _) in enumerate(order):
        if not seg_slot or seg_slot[-1] != s or i - seg_start[-1] == chunk:
            seg_start.append(i)
            seg_slot.append(s)
    seg_start.append(len(order))
    longest = max((b - a for a, b in zip(seg_start, seg_start[1:])), default=0)
    as_dev = [torch.tensor(v, dtype=torch.int32, device=DEV) for v in (seg_start, seg_slot, [t for _, t in order])]
    return (*as_dev, longest)


def check_parts(lens: list[int], slots: list[int], ranks: list[int], rank: int, k: int, spans: list[tuple[int, int]],
                n: int, dtype: torch.dtype, splits: int | None = None, group: bool = False, seed: int = 0) -> None:
    """A packed layer's shrink (every part's A stacked: ``[S, P * R, K]``) and one-launch expand
    (B ``[S, n, R]``, part p's rows at ``spans[p]``), from a strided view of the shrink's chunks
    into a column slice of a wider y, against the references part by part. ``group``: the tokens
    regrouped by slot through a token index. y's columns outside the spans, outside the slice,
    and rows on no adapter stay exactly as they were."""
    gen = torch.Generator().manual_seed(seed)
    t, parts = sum(lens), len(spans)
    seg_start, seg_slot = segments(lens, slots)
    msl = max(lens)
    a = torch.cat([adapter_pool(ranks, rank, k, 1, dtype, gen)[0] for _ in spans], dim=1)
    _, b = adapter_pool(ranks, rank, 1, n, dtype, gen)
    x = torch.randn(t, k, generator=gen).to(DEV, dtype)
    k_start, k_slot, tok, k_msl = grouped(lens, slots) if group else (seg_start, seg_slot, None, msl)

    h = sgmv_shrink_split(x, a, k_start, k_slot, k_msl, splits=splits, tok_index=tok)
    h_ref = torch.empty(t, parts * rank, dtype=dtype, device=DEV)
    sgmv_shrink_ref(x, a, seg_start, seg_slot, msl, h_ref)
    no_adapter = torch.repeat_interleave(seg_slot.long(), torch.tensor(lens, device=DEV)) < 0
    covered = ~no_adapter if group else torch.ones_like(no_adapter)
    torch.testing.assert_close(h.float().sum(0)[covered], h_ref.float()[covered], atol=TOL[dtype], rtol=TOL[dtype])

    wide = torch.zeros(h.shape[0], t, parts * rank + 24, dtype=h.dtype, device=DEV)  # h: a strided view
    wide[:, :, 8 : 8 + parts * rank] = h
    h_view = wide[:, :, 8 : 8 + parts * rank]
    y_wide = torch.randn(t, n + 40, generator=gen).to(DEV, dtype)  # y: columns 16..16+n
    before = y_wide.clone()
    y = y_wide[:, 16 : 16 + n]
    sgmv_expand_parts(h_view if h.shape[0] > 1 else h_view[0], b, k_start, k_slot, k_msl, y, spans, tok_index=tok)
    y_ref = before[:, 16 : 16 + n].clone()
    h_sum = h.float().sum(0).to(dtype)
    for p, (start, width) in enumerate(spans):
        sgmv_expand_ref(h_sum[:, p * rank : (p + 1) * rank], b[:, start : start + width], seg_start, seg_slot, msl,
                        y_ref[:, start : start + width])
    torch.testing.assert_close(y.float(), y_ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    outside = torch.ones(n + 40, dtype=torch.bool, device=DEV)
    for start, width in spans:
        outside[16 + start : 16 + start + width] = False
    assert torch.equal(y_wide[:, outside], before[:, outside])
    assert torch.equal(y_wide[no_adapter], before[no_adapter])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("splits", [None, 3])
def test_packed_qkv_decode_in_two_launches(dtype, splits):
    # unequal parts, the first 130 wide (ragged in 64- and 128-column tiles), each its own adapter rank
    check_parts(lens=[1] * 7, slots=[3, -1, 0, 0, 2, 1, 3], ranks=[8, 16, 16, 4], rank=16, k=300,
                spans=[(0, 130), (130, 48), (178, 20)], n=198, dtype=dtype, splits=splits, seed=7)


@pytest.mark.parametrize("splits", [1, 2])
def test_four_parts_with_gaps_in_prefill_tiles(splits):
    # four parts: two launches (three parts each at most); columns 40-48 and past 150 in no span
    check_parts(lens=[17, 0, 40, 1, 5], slots=[1, 0, 2, -1, 1], ranks=[16, 8, 16], rank=16, k=96,
                spans=[(0, 40), (48, 16), (64, 70), (140, 10)], n=160, dtype=torch.float32, splits=splits, seed=8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_decode_grouped_by_slot(dtype):
    # 40 rows, 20 of them on slot 1 (two segments: 16 + 4 positions), 7 on none (in no segment);
    # K=1000: 4 chunks by default
    slots = [1, 2, 1, -1, 0, 1, 3] * 5 + [1] * 5
    check_parts(lens=[1] * 40, slots=slots, ranks=[16, 16, 8, 16], rank=16, k=1000,
                spans=[(0, 64), (64, 32), (96, 32)], n=128, dtype=dtype, group=True, seed=9)
    assert grouped([1] * 40, slots)[3] == 16


def test_grouped_prefill_segments_and_the_one_chunk_shrink():
    check_parts(lens=[5, 9, 1, 20], slots=[0, 1, 0, 1], ranks=[16, 8], rank=16, k=64, spans=[(0, 48)], n=48,
                dtype=torch.float32, group=True, seed=10)


def test_expand_parts_refuses_bad_spans_and_widths():
    seg_start, seg_slot = segments([2], [0])
    h, b, y = torch.randn(2, 32, device=DEV), torch.randn(1, 48, 16, device=DEV), torch.empty(2, 48, device=DEV)
    with pytest.raises(ValueError, match="sgmv_expand_parts"):
        sgmv_expand_parts(h, b, seg_start, seg_slot, 2, y, [(0, 40), (40, 16)])  # past N
    with pytest.raises(ValueError, match="sgmv_expand_parts"):
        sgmv_expand_parts(h, b, seg_start, seg_slot, 2, y, [(0, 48)])  # h holds two parts
    with pytest.raises(ValueError, match="tok_index"):
        sgmv_expand_parts(h, b, seg_start, seg_slot, 2, y, [(0, 24), (24, 24)], tok_index=torch.zeros(2, device=DEV))
    sgmv_expand_parts(h[:0], b, seg_start, seg_slot, 0, y[:0], [(0, 24), (24, 24)])  # no tokens: nothing


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

    seg = {"SegStart": "*i32", "SegSlot": "*i32", "TokIdx": "*i32"}
    for dt, f32, bt, idx in (("bf16", False, 16, True), ("bf16", False, 64, False), ("fp32", True, 16, False)):
        for out in (dt, "fp32"):  # the one-chunk output, the split-K partial sums
            build(lora._shrink_kernel, {"X": f"*{dt}", "A": f"*{dt}", "Out": f"*{out}", **seg},
                  dict(BLOCK_T=bt, BLOCK_R=16, BLOCK_K=lora.BLOCK_K, F32=f32, HAS_IDX=idx))
        bn = lora.BLOCK_N if bt == 64 else lora.BLOCK_N_DECODE
        for h, split_pad in ((dt, 1), ("fp32", lora.MAX_SPLITS)):
            build(lora._expand_kernel, {"H": f"*{h}", "B": f"*{dt}", "Y": f"*{dt}", **seg},
                  dict(BLOCK_T=bt, BLOCK_N=bn, BLOCK_R=64 if split_pad == 1 else 16, SPLITS=split_pad, F32=f32,
                       HAS_IDX=idx))


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the other tests compile and run the kernels")
def test_kernels_compile_for_an_h100_without_one():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    code = "from tests.test_lora_kernels import compile_for_sm90; compile_for_sm90()"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


# --------------------------------------------------------------------------- realistic shapes (GPU)


def captured(step) -> torch.cuda.CUDAGraph:
    """``step``'s launches in a CUDA graph (run once on a side stream first: Triton compiles outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


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

    graph = captured(step)
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


@pytest.mark.gpu
@needs_cuda
def test_packed_layers_at_llama_8b_shapes_grouped_in_a_cuda_graph():
    """``LayerLoRA``'s two launches at Llama-3.1-8B's shapes (qkv, gate_up, down; 16 rank-16 slots;
    64 decode rows grouped by slot, K split in 16 chunks), eagerly, then captured over persistent
    buffers of ``LoRAPool.graph_capacity``'s size and replayed with new groups."""
    dtype, rank, t = torch.bfloat16, 16, 64
    ranks = [rank] * 16
    layers = [(4096, [(0, 4096), (4096, 1024), (5120, 1024)]), (4096, [(0, 14336), (14336, 14336)]),
              (14336, [(0, 4096)])]
    for k, spans in layers:
        check_parts(lens=[1] * t, slots=[i % 17 - 1 for i in range(t)], ranks=ranks, rank=rank, k=k, spans=spans,
                    n=sum(w for _, w in spans), dtype=dtype, group=True)

    gen = torch.Generator().manual_seed(11)
    k, spans = layers[0]
    n, cap = 6144, 16 + t // 16
    a = torch.cat([adapter_pool(ranks, rank, k, 1, dtype, gen)[0] for _ in spans], dim=1)
    _, b = adapter_pool(ranks, rank, 1, n, dtype, gen)
    x = torch.randn(t, k, generator=gen).to(DEV, dtype)
    y0 = torch.randn(t, n, generator=gen).to(DEV, dtype)
    seg_start = torch.zeros(cap + 1, dtype=torch.int32, device=DEV)
    seg_slot = torch.full((cap,), -1, dtype=torch.int32, device=DEV)
    tok = torch.zeros(t, dtype=torch.int32, device=DEV)
    y = y0.clone()

    def step() -> None:
        h = sgmv_shrink_split(x, a, seg_start, seg_slot, 16, tok_index=tok)
        sgmv_expand_parts(h, b, seg_start, seg_slot, 16, y, spans, tok_index=tok)

    graph = captured(step)
    for rep in range(3):
        slots = torch.randint(-1, len(ranks), (t,), generator=gen).tolist() if rep else [3] * 40 + [-1] * 24
        g_start, g_slot, g_tok, _ = grouped([1] * t, slots)
        m = g_slot.shape[0]
        seg_start[: m + 1].copy_(g_start)
        seg_start[m + 1 :].fill_(int(g_start[-1]))
        seg_slot.fill_(-1)
        seg_slot[:m].copy_(g_slot)
        tok[: g_tok.shape[0]].copy_(g_tok)
        y.copy_(y0)
        graph.replay()
        torch.cuda.synchronize()
        ref_start, ref_slot = segments([1] * t, slots)
        h_ref, y_ref = torch.empty(t, 3 * rank, dtype=dtype, device=DEV), y0.clone()
        sgmv_shrink_ref(x, a, ref_start, ref_slot, 1, h_ref)
        for p, (s, w) in enumerate(spans):
            sgmv_expand_ref(h_ref[:, p * rank : (p + 1) * rank], b[:, s : s + w], ref_start, ref_slot, 1,
                            y_ref[:, s : s + w])
        torch.testing.assert_close(y.float(), y_ref.float(), atol=3e-2, rtol=3e-2)
