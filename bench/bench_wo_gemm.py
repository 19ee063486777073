"""The weight-only GEMM kernel (``kernels/wo_gemm``: fp8 and int8 rows) against bf16 cuBLAS and
torch's own quantized paths (fp8 ``_scaled_mm`` after the per-token activation quantization,
tinygemm int4, which int4wo uses) at Llama-3.1-8B layer widths, on a GPU: GPU time per call
(replayed from a CUDA graph) and the weight bytes read per second.

    python bench/bench_wo_gemm.py            # rows 1 and 16
    python bench/bench_wo_gemm.py 1,8,64
"""

from __future__ import annotations

import sys

import torch
import triton

from core_kernels import wo_gemm
from core_kernels.fused_ops import per_token_fp8
from core_plugins.quant import packed
from core_plugins.quant.fp8 import quantize_rows

if not torch.cuda.is_available():
    sys.exit("bench_wo_gemm: needs a CUDA GPU")
rows_list = [int(r) for r in (sys.argv[1] if len(sys.argv) > 1 else "1,16").split(",")]
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336), "lm_head": (128256, 4096)}
gen = torch.Generator(device="cuda").manual_seed(0)


def scaled_mm(xq: tuple[torch.Tensor, torch.Tensor], w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch._scaled_mm(xq[0], w.t(), scale_a=xq[1], scale_b=scale.reshape(1, -1), out_dtype=torch.bfloat16)


def timed(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=20)  # ms of GPU time: replayed from a graph, no launch cost


print(f"{torch.cuda.get_device_name()}; ms per call (weight GB/s)")
print(f"{'layer':8} {'rows':>4} {'bf16':>16} {'fp8 wo_gemm':>16} {'fp8 scaled_mm':>16} {'int8 wo_gemm':>16} "
      f"{'int4 tinygemm':>16}")
for name, (n, k) in SHAPES.items():
    w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
    f8, s8 = quantize_rows(w)  # the fp8 plugin's per-row quantization
    i8, si8 = packed.quantize_int8(w)
    int4 = torch.nn.Module()  # a layer in int4wo-128's format (tinygemm on CUDA)
    int4.bias, int4.anchor = None, torch.nn.Parameter(torch.zeros(1, device="cuda"), requires_grad=False)
    packed.set_int4(int4, *packed.quantize_int4(w, 128), torch.bfloat16)
    for rows in rows_list:
        x = torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        runs = {
            "bf16": (lambda: torch.nn.functional.linear(x, w), 2 * n * k),
            "fp8": (lambda: wo_gemm.mm(x, f8, s8), n * k),
            "fp8sm": (lambda: scaled_mm(per_token_fp8(x), f8, s8), n * k),  # with the activation quantization
            "int8": (lambda: wo_gemm.mm(x, i8, si8), n * k),
            "tiny": (lambda: packed.packed_linear(int4, x), n * k // 2),
        }
        cells = []
        for key, (fn, nbytes) in runs.items():
            try:
                ms = timed(fn)
                cells.append(f"{ms:7.4f} ({nbytes / ms / 1e6:5.0f})")
            except Exception as e:  # noqa: BLE001 - a path this GPU lacks is reported, not fatal
                cells.append(f"{type(e).__name__:>16}")
        print(f"{name:8} {rows:4d} " + " ".join(f"{c:>16}" for c in cells))
        print("   wo_gemm blocks:", wo_gemm._TUNED.best_config)
