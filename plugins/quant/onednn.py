"""bf16 weights packed once into oneDNN's blocked layout, for the CPU's dense GEMMs.

``F.linear`` on a plain ``[out, in]`` bf16 weight has oneDNN reorder the weight into its blocked
layout on every call, so a decode step reads each weight twice and writes it once. Packed at load
(``torch.ops.mkldnn._reorder_linear_weight``, what inductor's freezing pass does), the GEMM reads
it once. Measured on the 2-core AVX-512 VM (avx512_bf16, no AMX), one thread, the four GEMMs of a
SmolLM2 layer: 1.8x faster at 1 row, 1.6x at 8, 1.13x at 64, even from 512 rows on; the 49152x576
LM head 2.6x at 1 row. float32 gains nothing from MKL's packing here, so only bf16 is packed.

The packed copy lives beside the plain weight (tests, reloads and tensor parallelism keep using
that one), within the dense-copy memory budget of ``packed.py``. ``CORE_ONEDNN_PREPACK=0`` turns
packing off.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F


@functools.cache
def bf16_supported() -> bool:
    """oneDNN's bf16 reorder needs AVX512BW/VL/DQ or AVX-NE-CONVERT; on an AVX2-only CPU (where
    ``--dtype auto`` picks float32, but a user may still ask for bfloat16) it raises."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def wanted(w: torch.Tensor) -> bool:
    """Whether ``w`` is a weight this module packs: a 2-D bf16 CPU tensor, with oneDNN's bf16 path."""
    return (w.device.type == "cpu" and w.dtype == torch.bfloat16 and w.dim() == 2
            and os.environ.get("CORE_ONEDNN_PREPACK", "1") != "0" and bf16_supported())


def prepack(w: torch.Tensor) -> torch.Tensor:
    """The oneDNN-blocked copy of ``w [out, in]`` (an opaque ``torch._mkldnn`` tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), 1)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [..., in] @ w^T + bias`` for a plain or a packed ``w``."""
    if not w.is_mkldnn:
        return F.linear(x, w, bias)
    shape = x.shape
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]).contiguous(), w, bias, "none", [], "")
    return y.reshape(*shape[:-1], y.shape[-1])
