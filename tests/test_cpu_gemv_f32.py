"""The float32 (AVX2) int4 / int8 GEMMs of ``kernels/cpu_gemv.cpp``: what a GGUF or int4wo model runs
on a CPU without native bf16 (``--dtype auto`` picks float32 there). Like the bf16 kernels they
multiply the activations quantized to int8 per 32 columns: the result is the product of the weight
and the quantized row, within float32 summation, and near the exact product."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from core_kernels import cpu_gemv
from core_plugins.quant import packed
from tests.test_cpu_gemv import rel_err

pytestmark = pytest.mark.skipif(not cpu_gemv.available_f32(), reason="this CPU has no AVX2 and FMA (or no C++ "
                                "compiler): float32 int4 layers use torch's kernel here")
QUANT_REL = 2 ** -6  # against the exact product: x rounded to int8 per 32 columns


@pytest.mark.parametrize("n,k,group", [(16, 64, 32), (48, 256, 128), (960, 576, 32), (64, 1536, 64)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 9])
def test_int4_is_the_product_with_the_quantized_row(n, k, group, rows):
    g = torch.Generator().manual_seed(n + rows)
    q, scale, zero = packed.quantize_int4(torch.randn(n, k, generator=g), group)
    qw, sz = cpu_gemv.pack(q, scale, zero, torch.float32)
    assert sz.dtype == torch.float16  # scales and minimums, each rounded to fp16 once
    w = cpu_gemv.unpack(qw, sz)
    assert rel_err(w, packed.dequantize_int4(q, scale, zero)) < 2 ** -10
    x = torch.randn(rows, k, generator=g)
    out = cpu_gemv.mm(x, qw, sz)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    want = cpu_gemv.quantize_rows(x).double() @ w.double().T
    assert rel_err(out, want) < 1e-5
    assert rel_err(out, x.double() @ w.double().T) < QUANT_REL
    assert torch.equal(out[rows - 1:], cpu_gemv.mm(x[rows - 1:], qw, sz))  # rows are independent


def test_fp16_scales_and_minimums_are_exact():
    """GGUF's Q4_1 (w = d q + m with fp16 d and m, zero = m + 8 d in the tinygemm convention) keeps
    exactly its weights: the packed fp16 scale and minimum are d and m."""
    g = torch.Generator().manual_seed(5)
    q = torch.randint(0, 16, (32, 128), generator=g)
    d = (torch.rand(32, 4, generator=g) * 0.05).half().float()
    m = (-torch.rand(32, 4, generator=g) * 0.5).half().float()
    qw, sz = cpu_gemv.pack(q, d, m + 8 * d, torch.float32)
    assert torch.equal(sz.float().permute(2, 0, 3, 1).reshape(2, 32, 4), torch.stack([d, m]))
    want = q.float().view(32, 4, 32) * d[..., None] + m[..., None]
    assert torch.equal(cpu_gemv.unpack(qw, sz), want.view(32, 128))


@pytest.mark.parametrize("n,k", [(16, 64), (48, 96), (960, 576), (64, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_int8_is_the_product_with_the_quantized_row(n, k, rows):
    g = torch.Generator().manual_seed(n + k + rows)
    q, scale = packed.quantize_int8(torch.randn(n, k, generator=g))
    q[:, :4] = torch.tensor([-127, 127, -128, 0], dtype=torch.int8)  # the codes' extremes
    qw = cpu_gemv.pack_int8(q)
    assert cpu_gemv.unpack_int8(qw)[:, 2].eq(-127).all()  # -128 is read as -127 (no int8 negation)
    w = cpu_gemv.unpack_int8(qw).double() * scale.double()[:, None]
    x = torch.randn(rows, k, generator=g)
    x[:, :4] = torch.tensor([-3.0, 3.0, -3.0, -3.0])  # each run's largest values: codes -127 / 127
    out = cpu_gemv.mm_int8(x, qw, scale.float())
    assert out.dtype == torch.float32
    assert rel_err(out, cpu_gemv.quantize_rows(x).double() @ w.T) < 1e-5
    assert rel_err(out, x.double() @ w.T) < QUANT_REL


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_a_pair_of_weights_in_one_pass_equals_two_calls(rows):
    """The one-op layer's gate and up projections in float32: one pass, the same output bits."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 256, generator=g)
    (qa, sa), (qb, sb) = (cpu_gemv.pack(*packed.quantize_int4(torch.randn(n, 256, generator=g), 32), torch.float32)
                          for n in (96, 48))
    a, b = torch.ops.core_cpu_gemv.int4_mm_pair(x, qa, sa, qb, sb)
    assert torch.equal(a, cpu_gemv.mm(x, qa, sa)) and torch.equal(b, cpu_gemv.mm(x, qb, sb))
    (ia, ca), (ib, cb) = (packed.quantize_int8(torch.randn(n, 256, generator=g)) for n in (32, 80))
    ia, ib = cpu_gemv.pack_int8(ia), cpu_gemv.pack_int8(ib)
    a, b = torch.ops.core_cpu_gemv.int8_mm_pair(x, ia, ca, ib, cb)
    assert torch.equal(a, cpu_gemv.mm_int8(x, ia, ca)) and torch.equal(b, cpu_gemv.mm_int8(x, ib, cb))
    with pytest.raises(RuntimeError, match="int4_mm_pair"):  # scales packed for bf16
        torch.ops.core_cpu_gemv.int4_mm_pair(x, qa, sa.bfloat16(), qb, sb)


def test_prefill_sized_gemms_give_each_row_its_own_product():
    """A prefill chunk's rows go through the weight in tiles of 64 (the op's L2 blocking): 150 rows
    are two full tiles and a tail of 22 (five passes of 4 and one of 2). Every row, in any tile and
    pass, has the bits of the same row multiplied alone, for int4, int8 and the gate/up pair."""
    g = torch.Generator().manual_seed(150)
    x = torch.randn(150, 256, generator=g)
    qw, sz = cpu_gemv.pack(*packed.quantize_int4(torch.randn(48, 256, generator=g), 64), torch.float32)
    q8 = cpu_gemv.pack_int8(packed.quantize_int8(torch.randn(32, 256, generator=g))[0])
    s8 = torch.rand(32, generator=g)
    out, out8 = cpu_gemv.mm(x, qw, sz), cpu_gemv.mm_int8(x, q8, s8)
    a, b = torch.ops.core_cpu_gemv.int4_mm_pair(x, qw, sz, qw, sz)
    assert torch.equal(a, out) and torch.equal(b, out)
    for m in (0, 63, 64, 127, 128, 147, 148, 149):
        assert torch.equal(out[m], cpu_gemv.mm(x[m:m + 1], qw, sz)[0]), m
        assert torch.equal(out8[m], cpu_gemv.mm_int8(x[m:m + 1], q8, s8)[0]), m
    assert rel_err(out, cpu_gemv.quantize_rows(x).double() @ cpu_gemv.unpack(qw, sz).double().T) < 1e-5


def test_float32_layers_and_heads_use_it():
    """GGUF / int4wo / int8wo layers in a float32 model pack for the kernel (no dense copy: float32
    has none), and their GEMM at any row count is the kernel's."""
    g = torch.Generator().manual_seed(0)
    q, scale, zero = packed.quantize_int4(torch.randn(64, 128, generator=g), 32)
    layer = torch.nn.Module()
    layer.bias = torch.nn.Parameter(torch.randn(64, generator=g), requires_grad=False)
    packed.set_int4(layer, q, scale, zero, torch.float32)
    assert hasattr(layer, "qweight_int4_cpu") and layer.qscale_zero_cpu.dtype == torch.float16
    assert not hasattr(layer, "dense_weight")
    w = packed.dequantize(layer)
    for rows in (1, 40):
        x = torch.randn(rows, 128, generator=g)
        out = packed.packed_linear(layer, x)
        assert rel_err(out, cpu_gemv.quantize_rows(x) @ w.T + layer.bias) < 1e-5
    q8, s8 = packed.quantize_int8(torch.randn(32, 128, generator=g))
    layer8 = torch.nn.Module()
    layer8.bias = None
    packed.set_int8(layer8, q8, s8, torch.float32, torch.device("cpu"))
    assert hasattr(layer8, "qweight_int8_cpu")
    x = torch.randn(3, 128, generator=g)
    assert rel_err(packed.packed_linear(layer8, x), x.double() @ packed.dequantize(layer8).double().T) < QUANT_REL
    head = packed.PackedHead(torch.randn(96, 128, generator=g))
    assert hasattr(head, "qweight_int8_cpu") and "dense_weight" not in head.__dict__
    assert head.quant_format == "int8_blocks"
    x = torch.randn(5, 128, generator=g)
    assert rel_err(head(x), cpu_gemv.quantize_rows(x).double() @ packed.dequantize(head).double().T) < 1e-5


def test_mismatched_dtypes_are_clear_errors():
    q, scale, zero = packed.quantize_int4(torch.randn(32, 64), 32)
    qw, sz = cpu_gemv.pack(q, scale, zero, torch.float32)
    # bf16 x on float32 weights: the mismatch, or first that this CPU's build has no bf16 kernel
    bf16_kernels = torch.ops.core_cpu_gemv.supported()
    with pytest.raises(RuntimeError, match="BFloat16 for BFloat16 x .*got Half" if bf16_kernels else "no AVX512-BF16"):
        cpu_gemv.mm(torch.randn(1, 64).bfloat16(), qw, sz)
    with pytest.raises(RuntimeError, match="bf16 or float32"):
        cpu_gemv.mm(torch.randn(1, 64).double(), qw, sz)


AVX2_BUILD = textwrap.dedent("""
    import sys, torch
    from core_kernels import cpp_build, cpu_gemv
    from core_plugins.quant import packed
    cpp_build.flags = lambda: ["-O3", "-fopenmp", "-march=haswell"]
    cpp_build.load(cpu_gemv.PREFIX, cpu_gemv.SOURCE)
    assert torch.ops.core_cpu_gemv.supported_f32() and not torch.ops.core_cpu_gemv.supported()
    g = torch.Generator().manual_seed(0)
    q, s, z = packed.quantize_int4(torch.randn(96, 256, generator=g), 32)
    qw, sz = cpu_gemv.pack(q, s, z, torch.float32)
    x = torch.randn(3, 256, generator=g)
    want = cpu_gemv.quantize_rows(x).double() @ cpu_gemv.unpack(qw, sz).double().T
    err = ((cpu_gemv.mm(x, qw, sz) - want).abs().max() / want.abs().max()).item()
    try:
        cpu_gemv.mm(x.bfloat16(), *cpu_gemv.pack(q, s, z))
        print("bf16 ran")
    except RuntimeError as e:
        print("bf16 refused:", str(e).splitlines()[0])
    print("err", err)
""")


def test_an_avx2_build_runs_float32_and_refuses_bf16():
    """What an AVX2-only machine (e.g. an older EPYC) compiles: the float32 kernels, and a clear
    refusal for bf16 activations (which such a machine never picks by itself)."""
    proc = subprocess.run([sys.executable, "-c", AVX2_BUILD], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-2] == "bf16 refused: int4_mm: this build has no AVX512-BF16 and AVX512-VNNI", lines
    assert float(lines[-1].split()[1]) < 1e-5
