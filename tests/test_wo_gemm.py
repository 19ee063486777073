"""kernels/wo_gemm (weight-only quantized GEMM: fp8 / int8 rows, group-wise int4) against
dequantize-then-matmul in float64, and the quant layers that use it on a GPU.

Without a GPU the kernel runs in triton's interpreter (TRITON_INTERPRET=1, set before any kernel
module is imported) with its fixed block shape; on a GPU (``gpu`` tests) the autotuned shapes
run, at the Llama-3.1-8B layer widths too."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel module is first imported
pytest.importorskip("triton")

from core_kernels import wo_gemm  # noqa: E402
from core_plugins.quant import packed  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
FP8_OK = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
pytestmark = [pytest.mark.gpu] if torch.cuda.is_available() else []  # every test runs on the GPU there
TOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}  # relative to each row's largest output


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.double() - want).abs().amax(-1) / want.abs().amax(-1).clamp_min(1e-6)).max())


def weights(fmt: str, n: int, k: int, group: int, dtype: torch.dtype, gen: torch.Generator):
    """(kernel arguments, the float64 weight they stand for)."""
    if fmt == "int4":
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        scale = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.001).to(dtype)
        zero = (torch.randn(n, k // group, generator=gen) * 0.05).to(dtype)
        ref = packed.dequantize_int4(codes, scale, zero).double()
        return (wo_gemm.pack_int4(codes).to(DEV), scale.to(DEV), zero.to(DEV)), ref
    if fmt == "int8":
        w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    else:
        w = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(n, generator=gen) * 0.01 + 1e-4
    return (w.to(DEV), scale.to(DEV), None), w.double() * scale.double()[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 5, 17, 70])  # row blocks of 1 and 4 (no tensor cores), 16, 32 and 128
@pytest.mark.parametrize("fmt,group", [("fp8", 0), ("int8", 0), ("int4", 32), ("int4", 128)])
def test_matches_dequantized_matmul(fmt, group, rows, dtype):
    if fmt == "fp8" and DEV.type == "cuda" and not FP8_OK:
        pytest.skip("fp8 needs compute capability >= 8.9")
    gen = torch.Generator().manual_seed(rows * 7 + group)
    n, k = (48, 256) if fmt == "int4" else (40, 96)  # 40 rows: a partly masked column block
    (w, scale, zero), ref_w = weights(fmt, n, k, group, dtype, gen)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    y = wo_gemm.mm(x.to(DEV), w, scale, zero, bias=bias.to(DEV), group=group)
    assert y.dtype == dtype and y.shape == (rows, n)
    ref = x.double() @ ref_w.T + bias.double()
    assert rel_err(y.cpu(), ref) < TOL[dtype]


def test_int4_packing_round_trips():
    codes = torch.randint(0, 16, (8, 64), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    p = wo_gemm.pack_int4(codes)
    assert p.shape == (8, 32) and p.dtype == torch.uint8
    assert int(p[0, 0]) == int(codes[0, 0]) | int(codes[0, 1]) << 4, "even column in the low nibble"
    assert torch.equal(wo_gemm.unpack_int4(p), codes)


def test_no_rows_and_bad_shapes():
    gen = torch.Generator().manual_seed(2)
    (w, scale, zero), _ = weights("int4", 16, 64, 32, torch.float32, gen)
    assert wo_gemm.mm(torch.zeros(0, 64, device=DEV), w, scale, zero, group=32).shape == (0, 16)
    with pytest.raises(ValueError, match="does not match"):
        wo_gemm.mm(torch.zeros(2, 48, device=DEV), w, scale, zero, group=32)
    with pytest.raises(ValueError, match="group"):
        wo_gemm.mm(torch.zeros(2, 64, device=DEV), w, scale, zero, group=64)
    with pytest.raises(ValueError, match="want"):
        wo_gemm.mm(torch.zeros(2, 2, 64, device=DEV), w, scale, zero, group=32)


# --------------------------------------------------------------------------- on a GPU


class Holder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = None
        self.anchor = torch.nn.Parameter(torch.zeros(1, device="cuda"), requires_grad=False)


@needs_cuda
@pytest.mark.parametrize("rows", [1, 16, 64, 300])
def test_cuda_int4_and_int8_layers_use_the_kernel(rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(512, 1024, generator=gen)
    x = torch.randn(rows, 1024, generator=gen).to(torch.bfloat16).cuda()
    layer = Holder()
    q, scale, zero = packed.quantize_int4(w, 128)
    packed.set_int4(layer, q, scale, zero, torch.bfloat16)
    assert layer.quant_format == "int4" and hasattr(layer, "qweight_int4_gpu")
    ref_w = packed.dequantize_int4(q, scale.bfloat16(), zero.bfloat16()).double()
    torch.testing.assert_close(packed.dequantize(layer).cpu().double(), ref_w, atol=1e-2, rtol=2 ** -7)
    assert rel_err(packed.packed_linear(layer, x).cpu(), x.cpu().double() @ ref_w.T) < 2 * 2 ** -7
    layer8 = Holder()
    q8, s8 = packed.quantize_int8(w)
    packed.set_int8(layer8, q8, s8, torch.bfloat16)
    ref8 = q8.double() * s8.bfloat16().double()[:, None]
    assert rel_err(packed.packed_linear(layer8, x).cpu(), x.cpu().double() @ ref8.T) < 2 * 2 ** -7


@pytest.mark.skipif(not FP8_OK, reason="needs a CUDA GPU with fp8 (compute capability >= 8.9)")
@pytest.mark.parametrize("fmt,group", [("fp8", 0), ("int8", 0), ("int4", 128)])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (28672, 4096)])  # Llama-3.1-8B: qkv, down, gate+up
def test_llama_8b_widths(fmt, group, n, k):
    gen = torch.Generator().manual_seed(n)
    (w, scale, zero), ref_w = weights(fmt, n, k, group, torch.bfloat16, gen)
    for rows in (1, 8):
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        y = wo_gemm.mm(x.cuda(), w, scale, zero, group=group)
        assert rel_err(y.cpu(), x.double() @ ref_w.T) < 2 * 2 ** -7
