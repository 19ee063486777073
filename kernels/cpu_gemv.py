"""Group-wise int4, per-channel int8 and int8-blocks (GGUF's Q8_0, float32 output: the LM head)
weights times a few rows of activations: bf16 on CPUs with AVX512-BF16 and AVX512-VNNI, float32
on CPUs with AVX2 and FMA (``cpu_gemv.cpp``).

torch's ``_weight_int4pack_mm_for_cpu`` / ``_weight_int8pack_mm`` read SmolLM2's layers and LM
head at ~15-22 GB/s on one core of the dev VM, under half of what the core can stream, and their
time grows with every activation row. These kernels keep sixteen output rows in the lanes of one
register and read the weight once for several rows (int4 in bf16: 6, float32: 4; int8: 3),
multiplying int8 codes of the activations (per 32 columns, as llama.cpp does) with ``vpdpbusd``
(``cpu_gemv.h`` says how). They are compiled with ``-march=native``;
:func:`available_for` says whether this machine has the instruction sets for a dtype and the
library builds, and callers keep torch's kernels otherwise.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from core_kernels import cpp_build

SOURCE = Path(__file__).with_name("cpu_gemv.cpp")
PREFIX = "core_cpu_gemv"


def available() -> bool:
    """Whether the bf16 kernels run here (AVX512-BF16 and VNNI): builds (first time on this machine)
    and loads the library."""
    return _runs(frozenset({"avx512_bf16", "avx512_vnni"}), "supported")


def available_f32() -> bool:
    """Whether the float32 kernels run here (AVX2 and FMA), as :func:`available` for bf16."""
    return _runs(frozenset({"avx2", "fma"}), "supported_f32")


@functools.cache
def _runs(flags: frozenset[str], supported: str) -> bool:
    """This CPU has ``flags``, the library builds and loads, and its ``supported`` op says the
    build has those kernels."""
    from core.engine.device import cpu_flags

    if not flags <= cpu_flags():
        return False
    return cpp_build.try_load(PREFIX, SOURCE, "cpu_gemv", fallback="torch's kernels") and bool(
        getattr(torch.ops.core_cpu_gemv, supported)())


def available_for(dtype: torch.dtype) -> bool:
    """Whether activations of ``dtype`` have a kernel here."""
    return (dtype == torch.bfloat16 and available()) or (dtype == torch.float32 and available_f32())


def shape_ok(n: int, k: int, group: int) -> bool:
    """int4: N a multiple of 16 and groups of a multiple of 32 columns (the activations' runs)."""
    return n % 16 == 0 and k % group == 0 and group % 32 == 0


def shape_ok_int8(n: int, k: int) -> bool:
    return n % 16 == 0 and k % 32 == 0


# The dtype of an int4 weight's scales and offsets, per activation dtype: fp16 scales and minimums
# beside float32 activations (4 bytes a group of 32 instead of 8: GGUF's Q4_0 / Q4_1 scales and
# minimums are fp16, so exact); bf16 scales and tinygemm zeros beside bf16 (exact for bf16 scales
# and zeros; the kernel forms the minimum in fp32, see cpu_gemv.h).
SZ_DTYPES = {torch.bfloat16: torch.bfloat16, torch.float32: torch.float16}


def act_dtype(sz: torch.Tensor) -> torch.dtype:
    """The activation dtype an int4 weight's ``sz`` (from :func:`pack`) is multiplied with."""
    return torch.float32 if sz.dtype == torch.float16 else sz.dtype


def pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
         dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [N, K]`` codes 0..15 with ``scale``/``zero`` ``[N, K/group]`` (tinygemm convention:
    ``w = (q - 8) * scale + zero``) for activations of ``dtype`` -> ``(qw [N/16, K/8, 16, 4] uint8,
    sz [N/16, K/group, 2, 16])``: per 16-row block and 8 columns, byte ``[i, j]`` holds row i's codes
    of columns j (low nibble) and j + 4; then the block's scales and offsets per group, in
    ``SZ_DTYPES[dtype]``: for bf16 the zeros, for float32 the minimums (``w = q * scale + min``,
    ``min = zero - 8 * scale``)."""
    n, k = q.shape
    v = q.to(torch.uint8).view(n // 16, 16, k // 8, 2, 4)
    qw = (v[:, :, :, 0] | (v[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous()
    scale = scale.float()
    offset = zero.float() if SZ_DTYPES[dtype] == torch.bfloat16 else zero.float() - 8 * scale
    sz = torch.stack([scale, offset]).to(SZ_DTYPES[dtype])
    return qw, sz.view(2, n // 16, 16, -1).permute(1, 3, 0, 2).contiguous()


def unpack(qw: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """The float32 ``[N, K]`` weight the kernel multiplies by."""
    nb, eighths = qw.shape[:2]
    b = qw.permute(0, 2, 1, 3)  # [N/16, 16, K/8, 4]
    q = torch.stack([b & 15, b >> 4], 3).reshape(nb * 16, 8 * eighths).float()
    s, c = sz.float().permute(2, 0, 3, 1).reshape(2, nb * 16, -1)
    g = s.shape[1]
    shift = 8 if sz.dtype == torch.bfloat16 else 0  # tinygemm zeros, w = (q - 8) s + z; else minimums
    return ((q.view(nb * 16, g, -1) - shift) * s[..., None] + c[..., None]).view(nb * 16, 8 * eighths)


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """What the kernels multiply instead of ``x [M, K]`` (bf16), in float32: per run of 32
    columns, ``d * rint(x / d)`` with ``d = amax / 127`` (int8 codes and one scale per run)."""
    m, k = x.shape
    runs = x.float().view(m, k // 32, 32)
    amax = runs.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return ((runs * inv).round() * (amax / 127.0)).view(m, k)


def mm(x: torch.Tensor, qw: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` (bf16 or float32, as :func:`act_dtype` of ``sz``) times the packed weight -> ``[M, N]``."""
    return torch.ops.core_cpu_gemv.int4_mm(x.contiguous(), qw, sz)


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """``q [N, K]`` int8 -> ``[N/16, K/4, 16, 4]`` uint8 ``q + 128``: per 16-row block and 4 columns,
    each row's four bytes. A code of -128 (symmetric quantizers never write one) is stored as -127:
    the float32 kernel negates codes, and -128 has no int8 negation."""
    n, k = q.shape
    u = (q.to(torch.int16).clamp(-127, 127) + 128).to(torch.uint8)
    return u.view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()


def unpack_int8(qw: torch.Tensor) -> torch.Tensor:
    """The int8 ``[N, K]`` codes of :func:`pack_int8`."""
    nb, quads = qw.shape[:2]
    return (qw.permute(0, 2, 1, 3).reshape(nb * 16, 4 * quads).to(torch.int16) - 128).to(torch.int8)


def mm_int8(x: torch.Tensor, qw: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` times ``q * scale[:, None]`` -> ``[M, N]`` in ``scale``'s dtype (bf16 or float32)."""
    return torch.ops.core_cpu_gemv.int8_mm(x.contiguous(), qw, scale)


def pack_block_scales(scale: torch.Tensor) -> torch.Tensor:
    """Per-row-and-run scales ``[N, K/32]`` -> fp16 ``[N/16, K/32, 16]`` (per 16-row block and run,
    the 16 rows' scales): the int8-blocks format's (GGUF's Q8_0, whose scales are fp16)."""
    n, runs = scale.shape
    return scale.to(torch.float16).view(n // 16, 16, runs).transpose(1, 2).contiguous()


def unpack_block_scales(sc: torch.Tensor) -> torch.Tensor:
    """float32 ``[N, K/32]`` from :func:`pack_block_scales`."""
    nb, runs, _ = sc.shape
    return sc.float().transpose(1, 2).reshape(nb * 16, runs)


def mm_int8_blocks(x: torch.Tensor, qw: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` (bf16 or float32) times ``q [N, K]`` (:func:`pack_int8`) scaled per row and run of
    32 columns (``sc`` from :func:`pack_block_scales`) -> float32 ``[M, N]``."""
    return torch.ops.core_cpu_gemv.int8_blocks_mm(x.contiguous(), qw, sc)
