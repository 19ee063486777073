"""The AVX512-BF16 / VNNI int4 and int8 GEMMs for few rows (``kernels/cpu_gemv.cpp``) against the
dequantized weight (int4: times the int8-quantized activations, which is what the kernel computes)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from core_kernels import cpp_build, cpu_gemv
from core_plugins.quant import packed

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason="this CPU has no AVX512-BF16 and VNNI (or no C++ "
                                "compiler): int4 layers use torch's kernel here")
INT8_ACT_REL = 2 ** -6  # int4 against the exact product: x rounded to int8 per 32 columns, then the output to bf16


def quantized(n: int, k: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, scale, zero = packed.quantize_int4(torch.randn(n, k, generator=g), group)
    return q, scale.bfloat16(), zero.bfloat16()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("n,k,group", [(16, 64, 32), (48, 256, 128), (960, 576, 32), (64, 384, 64), (32, 512, 256)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
def test_matches_the_dequantized_weight(n, k, group, rows):
    q, scale, zero = quantized(n, k, group)
    qw, sz = cpu_gemv.pack(q, scale, zero)
    w = cpu_gemv.unpack(qw, sz)
    assert torch.equal(w, packed.dequantize_int4(q, scale, zero))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    out = cpu_gemv.mm(x, qw, sz)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    assert rel_err(out, cpu_gemv.quantize_rows(x) @ w.T) < 2 ** -8  # the bf16 rounding of the output
    assert rel_err(out, x.float() @ w.T) < INT8_ACT_REL


def test_activations_are_quantized_per_32_columns():
    """Each run of 32 columns has its own scale (its largest |x| / 127): a large run does not coarsen
    the others, and an all-zero run stays zero; the kernel multiplies exactly those values."""
    x = torch.zeros(2, 128)
    x[0, :32] = torch.linspace(-16, 16, 32)
    x[0, 32:64] = torch.linspace(-2, 1, 32)
    x[0, 64:96] = 127.0  # scale 1: exact
    x[1, 96:] = torch.linspace(-1, 1, 32)
    x = x.bfloat16().float()
    xq = cpu_gemv.quantize_rows(x.bfloat16())
    assert torch.equal(xq[0, 64:96], x[0, 64:96]) and torch.equal(xq[0, 96:], torch.zeros(32))
    assert torch.equal(xq[1, :96], torch.zeros(96))
    for row, run, amax in [(0, 0, 16), (0, 1, 2), (1, 3, 1)]:
        err = (xq[row, 32 * run:32 * run + 32] - x[row, 32 * run:32 * run + 32]).abs().max()
        assert 0 < err <= amax / 254 * (1 + 1e-5)  # at most half a code of its own run
    q, scale, zero = quantized(32, 128, 32)
    qw, sz = cpu_gemv.pack(q, scale, zero)
    out = cpu_gemv.mm(x.bfloat16(), qw, sz)
    assert rel_err(out, xq @ cpu_gemv.unpack(qw, sz).T) < 2 ** -8


@pytest.mark.parametrize("n,k", [(16, 64), (48, 96), (960, 576), (64, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
def test_int8_matches_the_dequantized_weight(n, k, rows):
    g = torch.Generator().manual_seed(n + k)
    q, scale = packed.quantize_int8(torch.randn(n, k, generator=g))
    scale = scale.bfloat16()
    qw = cpu_gemv.pack_int8(q)
    assert torch.equal(cpu_gemv.unpack_int8(qw), q)
    x = torch.randn(rows, k, generator=g).bfloat16()
    out = cpu_gemv.mm_int8(x, qw, scale)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    w = q.float() * scale.float()[:, None]
    assert rel_err(out, cpu_gemv.quantize_rows(x) @ w.T) < 2 ** -8
    assert rel_err(out, x.float() @ w.T) < INT8_ACT_REL


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_a_pair_of_weights_in_one_pass_equals_two_calls(rows):
    """The one-op layer's gate and up projections: one parallel pass, the same output bits."""
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
    (qa, sa), (qb, sb) = (cpu_gemv.pack(*quantized(n, 256, 32, seed=n)) for n in (96, 48))
    a, b = torch.ops.core_cpu_gemv.int4_mm_pair(x, qa, sa, qb, sb)
    assert torch.equal(a, cpu_gemv.mm(x, qa, sa)) and torch.equal(b, cpu_gemv.mm(x, qb, sb))
    (ia, ca), (ib, cb) = (packed.quantize_int8(torch.randn(n, 256, generator=torch.Generator().manual_seed(n)))
                          for n in (32, 80))
    ia, ib, ca, cb = cpu_gemv.pack_int8(ia), cpu_gemv.pack_int8(ib), ca.bfloat16(), cb.bfloat16()
    a, b = torch.ops.core_cpu_gemv.int8_mm_pair(x, ia, ca, ib, cb)
    assert torch.equal(a, cpu_gemv.mm_int8(x, ia, ca)) and torch.equal(b, cpu_gemv.mm_int8(x, ib, cb))
    with pytest.raises(RuntimeError, match="int4_mm_pair"):
        torch.ops.core_cpu_gemv.int4_mm_pair(x, qa, sa, *cpu_gemv.pack(*quantized(16, 256, 128)))  # other group size


@pytest.mark.parametrize("rows", [5, 6, 11, 13])
def test_rows_are_independent_and_a_strided_input_is_fine(rows):
    """Every row's output has the bits of that row alone, whichever group of rows a pass of the
    kernel takes it in (6 at a time, then 3, 2 or 1)."""
    q, scale, zero = quantized(64, 128, 32)
    qw, sz = cpu_gemv.pack(q, scale, zero)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()[:, ::2]
    full = cpu_gemv.mm(x, qw, sz)
    assert all(torch.equal(full[i : i + 1], cpu_gemv.mm(x[i : i + 1], qw, sz)) for i in range(rows))


def test_bad_inputs_are_clear_errors():
    q, scale, zero = quantized(32, 64, 32)
    qw, sz = cpu_gemv.pack(q, scale, zero)
    with pytest.raises(RuntimeError, match="bf16 or float32"):
        cpu_gemv.mm(torch.randn(1, 64).half(), qw, sz)
    with pytest.raises(RuntimeError, match="Half for Float x .*got BFloat16"):  # float32 x, scales packed for bf16
        cpu_gemv.mm(torch.randn(1, 64), qw, sz)
    with pytest.raises(RuntimeError, match="columns"):
        cpu_gemv.mm(torch.randn(1, 96).bfloat16(), qw, sz)
    q8 = cpu_gemv.pack_int8(packed.quantize_int8(torch.randn(32, 64))[0])
    with pytest.raises(RuntimeError, match="bf16 or float32"):
        cpu_gemv.mm_int8(torch.randn(1, 64).half(), q8, torch.ones(32).bfloat16())
    with pytest.raises(RuntimeError, match="x's dtype"):
        cpu_gemv.mm_int8(torch.randn(1, 64), q8, torch.ones(32).bfloat16())
    with pytest.raises(RuntimeError, match="scale"):
        cpu_gemv.mm_int8(torch.randn(1, 64).bfloat16(), q8, torch.ones(16).bfloat16())



@pytest.mark.parametrize("n,k", [(16, 64), (96, 576), (960, 576)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 70])
def test_int8_blocks_are_float32_products_of_the_q8_0_weight(n, k, rows):
    """The LM head's format: int8 codes with a scale per row and run of 32 columns (GGUF's Q8_0),
    float32 out; each row of x its own product (the same alone or in a batch)."""
    g = torch.Generator().manual_seed(n + rows)
    q, scale = packed.quantize_int8_blocks(torch.randn(n, k, generator=g))
    qw, sc = cpu_gemv.pack_int8(q), cpu_gemv.pack_block_scales(scale)
    assert sc.dtype == torch.float16 and torch.equal(cpu_gemv.unpack_block_scales(sc), scale)
    w = packed.dequantize_int8_blocks(q, scale).double()
    x = torch.randn(rows, k, generator=g).bfloat16()
    out = cpu_gemv.mm_int8_blocks(x, qw, sc)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    assert rel_err(out, x.double() @ w.T) < INT8_ACT_REL
    # rows the int8 runs hold exactly (a largest |code| of 127 per run, power-of-two steps): the
    # product is exact up to float32 sums, far inside a bf16 output's 2 ** -8
    codes = torch.randint(-127, 128, (rows, k // 32, 32), generator=g)
    codes[..., 0] = 127
    exact = (codes * 2.0 ** -torch.randint(0, 6, (rows, k // 32, 1), generator=g)).reshape(rows, k).bfloat16()
    assert torch.equal(cpu_gemv.quantize_rows(exact), exact.float())
    assert rel_err(cpu_gemv.mm_int8_blocks(exact, qw, sc), exact.double() @ w.T) < 1e-6
    for m in range(0, rows, 3):
        assert torch.equal(out[m], cpu_gemv.mm_int8_blocks(x[m:m + 1], qw, sc)[0])


def test_int8_block_logits_keep_differences_below_a_bf16_step():
    """Two head rows one code apart in a run of small scale: their logits (~40) differ by ~1e-3, a
    hundredth of a bf16 step there. The int8-blocks head keeps the difference, so the argmax is the
    larger row, where bf16 logits tie and argmax picks the smaller token id (issue 41)."""
    k = 128
    g = torch.Generator().manual_seed(0)
    x = torch.ones(1, k).bfloat16()
    q = torch.randint(0, 100, (16, k), generator=g, dtype=torch.int8)
    scale = torch.full((16, k // 32), 0.01)
    scale[:, 3] = 1e-3  # the last run: fine steps
    q[1] = q[0]
    q[1, 100] += 1  # one code more, in the fine run
    out = cpu_gemv.mm_int8_blocks(x, cpu_gemv.pack_int8(q), cpu_gemv.pack_block_scales(scale))
    diff = (out[0, 1] - out[0, 0]).item()
    assert diff == pytest.approx(scale[1, 3].half().item(), rel=1e-3)
    assert out[0, 0].bfloat16() == out[0, 1].bfloat16()  # in bf16 the two would tie
    head = packed.PackedHead(torch.randn(16, k).bfloat16(), blocks=(q, scale))
    assert head.quant_format == "int8_blocks" and "dense_weight" not in head.__dict__
    logits = head(x)
    assert logits.dtype == torch.float32 and logits[0, 1] > logits[0, 0]
    assert torch.equal(packed.dequantize(head), packed.dequantize_int8_blocks(q, scale.half().float()))

def test_bf16_int8_layers_and_heads_use_it():
    q, scale = packed.quantize_int8(torch.randn(64, 128))
    layer = torch.nn.Module()
    layer.bias = None
    packed.set_int8(layer, q, scale, torch.bfloat16, torch.device("cpu"))
    assert hasattr(layer, "qweight_int8_cpu") and not hasattr(layer, "qweight_int8")
    assert torch.equal(packed.dequantize(layer), q.float() * scale.bfloat16().float()[:, None])
    x = torch.randn(3, 128).bfloat16()
    assert rel_err(packed.packed_linear(layer, x), x.float() @ packed.dequantize(layer).T) < INT8_ACT_REL
    head = packed.PackedHead(torch.randn(96, 128).bfloat16())
    assert hasattr(head, "qweight_int8_cpu") and head.quant_format == "int8_blocks"
    assert "dense_weight" not in head.__dict__  # float32 logits from the same codes at every row count
    x = torch.randn(300, 128).bfloat16()
    assert head(x).dtype == torch.float32
    assert rel_err(head(x), x.float() @ packed.dequantize(head).T) < INT8_ACT_REL


def test_bf16_int4_layers_use_it():
    q, scale, zero = quantized(64, 128, 32)
    layer = torch.nn.Module()
    layer.bias = None
    packed.set_int4(layer, q, scale, zero, torch.bfloat16)
    assert hasattr(layer, "qweight_int4_cpu") and not hasattr(layer, "qweight_int4")
    assert torch.equal(packed.dequantize(layer), packed.dequantize_int4(q, scale, zero))
    x = torch.randn(2, 128).bfloat16()
    assert rel_err(packed.packed_linear(layer, x), x.float() @ packed.dequantize(layer).T) < INT8_ACT_REL


BUILD_WITH = textwrap.dedent("""
    import sys, torch
    from core_kernels import cpp_build, cpu_gemv
    from core_plugins.quant import packed
    cpp_build.flags = lambda: ["-O3", "-fopenmp", *sys.argv[1:]]
    cpp_build.load(cpu_gemv.PREFIX, cpu_gemv.SOURCE)
    if not torch.ops.core_cpu_gemv.supported():
        try:
            torch.ops.core_cpu_gemv.int4_mm(torch.zeros(1, 64).bfloat16(), torch.zeros(2, 8, 16, 4, dtype=torch.uint8),
                                             torch.zeros(2, 2, 2, 16).bfloat16())
        except RuntimeError as e:
            print("unsupported:", str(e).splitlines()[0])
        sys.exit(0)
    g = torch.Generator().manual_seed(0)
    q, s, z = packed.quantize_int4(torch.randn(96, 256, generator=g), 32)
    qw, sz = cpu_gemv.pack(q, s, z)
    x = torch.randn(3, 256, generator=g).bfloat16()
    want = cpu_gemv.quantize_rows(x) @ cpu_gemv.unpack(qw, sz).T
    err = ((cpu_gemv.mm(x, qw, sz).float() - want).abs().max() / want.abs().max()).item()
    q8, s8 = packed.quantize_int8(torch.randn(96, 256, generator=g))
    s8 = s8.bfloat16()
    want = cpu_gemv.quantize_rows(x) @ (q8.float() * s8.float()[:, None]).T
    err8 = ((cpu_gemv.mm_int8(x, cpu_gemv.pack_int8(q8), s8).float() - want).abs().max() / want.abs().max()).item()
    print("err", max(err, err8))
""")


@pytest.mark.parametrize("flags,expect", [(["-march=native"], "err"),
                                          (["-march=native", "-mno-avx512vnni"], "unsupported: int4_mm: this build has no AVX512-BF16 and AVX512-VNNI"),
                                          (["-march=haswell"], "unsupported: int4_mm: this build has no AVX512-BF16 and AVX512-VNNI")],
                         ids=["native", "without_vnni", "avx2_only"])
def test_other_instruction_sets_build(flags, expect):
    """Built as the engine builds it, the kernels compute the quantized product; builds without
    AVX512-VNNI (e.g. for an AVX2 machine) compile and refuse with the reason."""
    proc = subprocess.run([sys.executable, "-c", BUILD_WITH, *flags], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout.strip().splitlines()[-1]
    assert out.startswith(expect), out
    if expect == "err":
        assert float(out.split()[1]) < 2 ** -7
