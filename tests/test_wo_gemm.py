"""kernels/wo_gemm (fp8 / int8 weights with a scale per output row, few activation rows) against
dequantize-then-matmul in float64, and the int8 layers that use it on a GPU.

Without a GPU the kernel runs in triton's interpreter (TRITON_INTERPRET=1, set before any kernel
module is imported) with its fixed block shape; on a GPU these tests carry the ``gpu`` marker,
run the fixed shape on the small cases and the tuned shapes at Llama-3.1-8B layer widths."""

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
FP8_OK = not torch.cuda.is_available() or torch.cuda.get_device_capability() >= (8, 9)
pytestmark = [pytest.mark.gpu] if torch.cuda.is_available() else []  # every test runs on the GPU there
TOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}  # relative to each row's largest output


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.double() - want).abs().amax(-1) / want.abs().amax(-1).clamp_min(1e-6)).max())


def weights(fmt: str, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight, scale on the kernel's device, the float64 weight they stand for)."""
    if fmt == "int8":
        w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    else:
        w = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(n, generator=gen) * 0.01 + 1e-4
    return w.to(DEV), scale.to(DEV), w.double() * scale.double()[:, None]


@pytest.fixture
def untuned(monkeypatch):
    monkeypatch.setattr(wo_gemm, "TUNED", False)  # many tiny shapes: no tuning runs (and compiles) each


@pytest.mark.skipif(not FP8_OK, reason="fp8 needs compute capability >= 8.9")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 64])  # row tiles of 16, 32 and 64
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_matches_dequantized_matmul(untuned, fmt, rows, dtype):
    gen = torch.Generator().manual_seed(rows)
    n, k = 40, 96  # 40 outputs: a partly masked column block; 96: a partly masked K block
    w, scale, ref_w = weights(fmt, n, k, gen)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    y = wo_gemm.mm(x.to(DEV), w, scale, bias=bias.to(DEV))
    assert y.dtype == dtype and y.shape == (rows, n)
    assert rel_err(y.cpu(), x.double() @ ref_w.T + bias.double()) < TOL[dtype]
    y = wo_gemm.mm(x.to(DEV), w, scale)
    assert rel_err(y.cpu(), x.double() @ ref_w.T) < TOL[dtype]


def test_no_rows_and_bad_shapes():
    w, scale, _ = weights("int8", 16, 64, torch.Generator().manual_seed(2))
    assert wo_gemm.mm(torch.zeros(0, 64, device=DEV), w, scale).shape == (0, 16)
    with pytest.raises(ValueError, match="does not match"):
        wo_gemm.mm(torch.zeros(2, 48, device=DEV), w, scale)
    with pytest.raises(ValueError, match="does not match"):
        wo_gemm.mm(torch.zeros(2, 2, 64, device=DEV), w, scale)
    with pytest.raises(ValueError, match="at most"):
        wo_gemm.mm(torch.zeros(wo_gemm.MAX_ROWS + 1, 64, device=DEV), w, scale)
    with pytest.raises(ValueError, match="scale"):
        wo_gemm.mm(torch.zeros(2, 64, device=DEV), w, scale[:8])


# --------------------------------------------------------------------------- on a GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
def test_cuda_int8_layer_uses_the_kernel_for_few_rows(monkeypatch):
    calls = []
    real = wo_gemm.mm
    monkeypatch.setattr(wo_gemm, "mm", lambda x, *a, **k: calls.append(x.shape[0]) or real(x, *a, **k))
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(512, 1024, generator=gen)
    layer = torch.nn.Module()
    layer.bias = None
    layer.anchor = torch.nn.Parameter(torch.zeros(1, device="cuda"), requires_grad=False)
    q, s = packed.quantize_int8(w)
    packed.set_int8(layer, q, s, torch.bfloat16)
    ref = q.double() * s.bfloat16().double()[:, None]
    for rows in (1, 16, 64, 300):
        x = torch.randn(rows, 1024, generator=gen).to(torch.bfloat16)
        assert rel_err(packed.packed_linear(layer, x.cuda()).cpu(), x.double() @ ref.T) < 2 * 2 ** -7
    assert calls == [1, 16, 64], "up to MAX_ROWS rows through wo_gemm, 300 through cuBLAS"


@needs_cuda
@pytest.mark.skipif(not FP8_OK, reason="needs fp8 (compute capability >= 8.9)")
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])  # Llama-3.1-8B: qkv, down
def test_tuned_at_llama_8b_widths(fmt, n, k):
    gen = torch.Generator().manual_seed(n)
    w, scale, ref_w = weights(fmt, n, k, gen)
    for rows in (1, 8):
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        assert rel_err(wo_gemm.mm(x.cuda(), w, scale).cpu(), x.double() @ ref_w.T) < 2 * 2 ** -7
