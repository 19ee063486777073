"""Packed weight-only GEMMs shared by the quantization plugins.

Every quantized ``Linear`` ends in one of three formats, whatever its method (int8wo, int4wo,
GGUF, AWQ, GPTQ) started from:

- ``int8``: per-output-channel symmetric int8, ``w = q * scale[n]``. CPU GEMM
  ``torch._weight_int8pack_mm``; it needs ``in_features % 16 == 0`` (other widths crash or
  return garbage in torch 2.13), so such layers stay dense.
- ``int4``: group-wise asymmetric 4-bit in torch's tinygemm convention
  ``w = (q - 8) * scale[n, g] + zero[n, g]``, ``q`` in [0, 15], groups of 32/64/128/256 input
  columns. CPU GEMM ``torch._weight_int4pack_mm_for_cpu`` (needs ``out_features % 16 == 0``),
  CUDA ``torch._weight_int4pack_mm`` (bf16 activations, sm80+). On a GPU, int8 GEMMs of up to
  ``wo_gemm.MAX_ROWS`` rows run ``kernels/wo_gemm`` (the int8 weight read once).
- ``dense``: the weight in the activation dtype, for shapes the kernels refuse.

The LM head (``PackedHead``) has a fourth on ``kernels/cpu_gemv``: ``int8_blocks``, int8 with one
scale per row and run of 32 columns (GGUF's Q8_0), float32 logits.

On CPUs with AVX512-BF16 and AVX512-VNNI for bf16 activations, and with AVX2 and FMA for float32
ones (the dtype ``--dtype auto`` picks where the CPU has no native bf16), int8 and int4 layers are
packed for ``kernels/cpu_gemv`` instead (buffers ``qweight_int8_cpu`` / ``qweight_int4_cpu``),
which multiplies them by the activations quantized to int8 per 32 columns, as llama.cpp does (the
product of the weight and the quantized row, within ~0.4 % of each run's largest value).

Why these kernels: on the 2-core AVX-512 (avx512_bf16, no AMX) dev VM, one thread, SmolLM2-135M
shapes at batch 1, torch's int8 / int4 kernels ran the 1536x576 GEMMs in 31 / 35 us against 82 us
for oneDNN's bf16 GEMM, and ours are 2-3x faster than torch's again at one row; on two threads
ours stay ahead of oneDNN's bf16 GEMM up to ~64 rows (the LM head to 256 and beyond), so they pay
off in decode, not in long prefills. torch's kernels are ~50x slower with float32 activations
(its reference path): serve them in bf16/fp16.
"""

from __future__ import annotations

import functools
import time

import structlog
import torch
import torch.nn.functional as F

from core.engine.device import cpu_flags
from core_kernels import cpu_gemv
from core_plugins.quant import onednn

INT4_GROUP_SIZES = (32, 64, 128, 256)

# On CPU the packed kernels win while a GEMM is a few rows (decode: they read 4-8x fewer bytes),
# but their time grows with the rows while oneDNN's bf16 GEMM barely does: against a bf16 weight
# packed in oneDNN's layout (``onednn.py``) they lose from 4 rows on (SmolLM2 layer shapes, one
# thread, 2-core AVX-512 VM: 170 against 144 us at 4 rows, 335 against 205 at 8), against a plain
# weight from about 16. So on CPU a layer also keeps its weight in the activation dtype, within a
# memory budget, and GEMMs of DENSE_MIN_ROWS rows or more (PLAIN_DENSE_MIN_ROWS for an unpacked
# copy) use it. None disables the copy (the tests of the packed kernels do).
# With this machine's own kernels (``kernels/cpu_gemv``, int8 activations on AVX512-VNNI, without
# AMX) the packed layers keep up with oneDNN's bf16 GEMM far longer: two threads, Zen 5, int4
# [3072, 576] 240 against 256 us at 64 rows (and ahead to 256), [576, 1536] even at 64 (138 / 137)
# and behind from 96; so layers go dense from 65 rows there. On Zen 4, which runs AVX-512 on 256-bit
# units, the int8 kernels stay ~25 % ahead of oneDNN's bf16 GEMM up to 2048 rows (two threads, SmolLM2's
# shapes), so a copy would only cost memory: whether oneDNN wins at DENSE_PROBE_ROWS is timed once per
# process (_dense_beats_gemv), and where it does not the layers keep no copy. With AMX oneDNN's bf16
# GEMMs are several times faster, so from 4. The int8 LM head never goes dense there (see PackedHead).
DENSE_MIN_ROWS: int | None = 4
GEMV_DENSE_MIN_ROWS = 65  # layers on kernels/cpu_gemv, CPUs without AMX where oneDNN wins (set on the layer when packed)
DENSE_PROBE_ROWS = 256  # _dense_beats_gemv's GEMM: a prefill's size
PLAIN_DENSE_MIN_ROWS = 16
DENSE_COPY_RAM_FRACTION = 0.2
FORMATS = ("int4", "int8", "dense")  # narrowest first: a packed layer takes its widest shard's


# --------------------------------------------------------------------------- quantizers (float -> ints)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8: ``(q [N, K] int8, scale [N] float32)`` with ``w ~ q * scale[:, None]``."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-10) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_int8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF's Q8_0 recipe per row and run of 32 columns: ``(q [N, K] int8, scale [N, K/32] float32)``,
    the scales rounded to fp16 (as Q8_0 stores them) before the codes are taken against them."""
    n, k = w.shape
    runs = w.float().reshape(n, k // 32, 32)
    scale = (runs.abs().amax(-1) / 127).half().float()
    q = torch.round(runs / scale.clamp(min=1e-30)[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(n, k), scale


def dequantize_int8_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``[N, K]`` from :func:`quantize_int8_blocks`'s form."""
    n, k = q.shape
    return (q.float().reshape(n, k // 32, 32) * scale.float()[..., None]).reshape(n, k)


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise asymmetric min/max 4-bit (torchao's int4 weight-only recipe):
    ``(q [N, K] uint8 in [0, 15], scale [N, K/group], zero [N, K/group])`` in the tinygemm convention."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-10)
    q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(n, k), scale, lo + 8 * scale


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """float32 ``[N, K]`` from the tinygemm convention; the group size is ``K / scale.shape[1]``."""
    n, k = q.shape
    g = scale.shape[1]
    w = (q.float().reshape(n, g, k // g) - 8) * scale.float()[..., None] + zero.float()[..., None]
    return w.reshape(n, k)


# --------------------------------------------------------------------------- packing onto a layer


def _clear(layer: torch.nn.Module) -> None:
    """Drop whatever the method loaded (dense weight, checkpoint tensors) before the packed form goes on."""
    for name in list(layer._parameters):
        if name != "bias":
            delattr(layer, name)


def set_dense(layer: torch.nn.Module, w: torch.Tensor, dtype: torch.dtype) -> None:
    device = _device(layer)
    _clear(layer)
    layer.quant_format = "dense"
    layer.weight = torch.nn.Parameter(w.to(device=device, dtype=dtype).contiguous(), requires_grad=False)


class _DenseBudget:
    """Bytes of dense copies this process may still keep (a share of physical memory)."""

    def __init__(self) -> None:
        self.left: int | None = None

    def take(self, nbytes: int) -> bool:
        if self.left is None:
            import psutil

            self.left = int(psutil.virtual_memory().total * DENSE_COPY_RAM_FRACTION)
        if nbytes > self.left:
            return False
        self.left -= nbytes
        return True

    def give(self, nbytes: int) -> None:
        """A copy of ``nbytes`` taken before was dropped."""
        if self.left is not None:
            self.left += nbytes


DENSE_BUDGET = _DenseBudget()


def _dense_wanted(device: torch.device, dtype: torch.dtype) -> bool:
    """See DENSE_MIN_ROWS: big GEMMs go dense on CPU, for activations the CPU multiplies natively."""
    return bool(DENSE_MIN_ROWS) and device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)


def onednn_copy(w: torch.Tensor) -> torch.Tensor | None:
    """``w`` packed in oneDNN's layout, within the dense-copy budget; None where it is not packed."""
    if onednn.wanted(w) and DENSE_BUDGET.take(w.numel() * w.element_size()):
        return onednn.prepack(w)
    return None


def _keep_dense_copy(layer: torch.nn.Module, dense: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
    """The weight in the activation dtype beside the packed one, within the memory budget (a plain
    attribute, not a buffer: in bf16 it is oneDNN's opaque packed tensor, see ``onednn.py``)."""
    if _dense_wanted(device, dtype) and DENSE_BUDGET.take(dense.numel() * torch.finfo(dtype).bits // 8):
        w = dense.to(device=device, dtype=dtype).contiguous()
        layer.__dict__["dense_weight"] = onednn.prepack(w) if onednn.wanted(w) else w


def set_int8(layer: torch.nn.Module, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
             device: torch.device | None = None, dense_copy: bool = True) -> None:
    """Per-channel int8; falls back to dense (exact dequantized values) where the kernel cannot run."""
    if q.shape[1] % 16:
        return set_dense(layer, q.float() * scale.float()[:, None], dtype)
    device = device or _device(layer)
    _clear(layer)
    layer.quant_format = "int8"
    n, k = q.shape
    if device.type == "cpu" and cpu_gemv.shape_ok_int8(n, k) and cpu_gemv.available_for(dtype):
        layer.register_buffer("qweight_int8_cpu", cpu_gemv.pack_int8(q))  # this machine's own kernel
        layer.dense_min_rows = _gemv_dense_min_rows(dtype)
        dense_copy = dense_copy and layer.dense_min_rows is not None
    else:
        layer.register_buffer("qweight_int8", q.to(device).contiguous())
    layer.register_buffer("qscale", scale.to(device=device, dtype=dtype))
    if dense_copy and _dense_wanted(device, dtype):
        _keep_dense_copy(layer, q.float() * scale.float()[:, None], dtype, device)


def int4_supported(out_features: int, in_features: int, group: int) -> bool:
    return group in INT4_GROUP_SIZES and in_features % group == 0 and out_features % 16 == 0


def set_int4(layer: torch.nn.Module, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
             dtype: torch.dtype) -> None:
    """Group-wise int4 (tinygemm convention); dense where the shape does not suit the kernel."""
    n, k = q.shape
    group = k // scale.shape[1]
    if not int4_supported(n, k, group):
        return set_dense(layer, dequantize_int4(q, scale, zero), dtype)
    device = _device(layer)
    _clear(layer)
    layer.quant_format = "int4"
    layer.group_size = group
    q = q.to(device)
    if device.type == "cpu" and cpu_gemv.shape_ok(n, k, group) and cpu_gemv.available_for(dtype):
        # this machine's own kernel: 2-3x torch's at one row in bf16 (``kernels/cpu_gemv.py``)
        qw, sz = cpu_gemv.pack(q, scale, zero, dtype)
        layer.register_buffer("qweight_int4_cpu", qw)
        layer.register_buffer("qscale_zero_cpu", sz)
        layer.dense_min_rows = _gemv_dense_min_rows(dtype)
        if _dense_wanted(device, dtype) and layer.dense_min_rows is not None:
            _keep_dense_copy(layer, dequantize_int4(q, scale, zero), dtype, device)
        return None
    if device.type == "cuda":
        # tinygemm's CUDA layout tiles K by inner_k_tiles * 16: the largest tiling this K allows
        tiles = next(t for t in (8, 4, 2) if k % (t * 16) == 0)
        packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), tiles)
    else:
        packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
    layer.register_buffer("qweight_int4", packed)
    sz = torch.stack([scale.float(), zero.float()], -1).transpose(0, 1).contiguous()  # [K/group, N, 2]
    layer.register_buffer("qscale_zero", sz.to(device=device, dtype=dtype))
    if _dense_wanted(device, dtype):
        _keep_dense_copy(layer, dequantize_int4(q.cpu(), scale, zero), dtype, device)


def _device(layer: torch.nn.Module) -> torch.device:
    for t in list(layer.parameters(recurse=False)) + list(layer.buffers(recurse=False)):
        return t.device
    return torch.device("cpu")


# --------------------------------------------------------------------------- GEMMs


def _dense_from(layer: torch.nn.Module, dense: torch.Tensor) -> int | None:
    """Rows from which this layer's GEMM uses its dense copy (None: never)."""
    if not DENSE_MIN_ROWS:
        return None
    lo = max(DENSE_MIN_ROWS, getattr(layer, "dense_min_rows", 0) or 0)
    return lo if dense.is_mkldnn else max(lo, PLAIN_DENSE_MIN_ROWS)


def _gemv_dense_min_rows(dtype: torch.dtype) -> int | None:
    """Rows from which a layer on kernels/cpu_gemv switches to its dense copy (None: it keeps none)."""
    if "amx_bf16" in cpu_flags():
        return 0
    return GEMV_DENSE_MIN_ROWS if not _dense_wanted(torch.device("cpu"), dtype) or _dense_beats_gemv(dtype) else None


def _dense_beats_gemv(dtype: torch.dtype) -> bool:
    """Whether oneDNN's GEMM over a dense copy beats the int4 gemv kernel at DENSE_PROBE_ROWS rows here,
    by 10 % or more (timed once per dtype and thread count: ``_probe``)."""
    return _probe(dtype, torch.get_num_threads())


@functools.cache
def _probe(dtype: torch.dtype, threads: int) -> bool:
    """``_dense_beats_gemv`` for ``threads`` threads: best of 5, SmolLM2's [1536, 576] shape, ~20 ms.
    On a tie the layers keep no copy: it saves their size in memory."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (1536, 576), generator=g, dtype=torch.int32)
    scale, zero = torch.rand(1536, 576 // 32, generator=g) / 64 + 1e-3, torch.zeros(1536, 576 // 32)
    qw, sz = cpu_gemv.pack(q, scale, zero, dtype)
    w = cpu_gemv.unpack(qw, sz).to(dtype).contiguous()
    dense = onednn.prepack(w) if onednn.wanted(w) else w
    x = torch.randn(DENSE_PROBE_ROWS, 576, generator=g).to(dtype)

    def best(f) -> float:
        f()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            f()
            times.append(time.perf_counter() - t)
        return min(times)

    gemv = best(lambda: cpu_gemv.mm(x.to(cpu_gemv.act_dtype(sz)), qw, sz))
    onednn_s = best(lambda: onednn.linear(x, dense, None))
    kept = onednn_s < 0.9 * gemv
    structlog.get_logger(__name__).info("packed.dense_copies", kept=kept, rows=DENSE_PROBE_ROWS, threads=threads,
                                        gemv_us=round(gemv * 1e6), dense_us=round(onednn_s * 1e6))
    return kept


def packed_linear(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ W^T (+ bias)`` in ``x.dtype`` for whichever format the layer holds."""
    fmt = layer.quant_format
    if fmt == "dense":
        return F.linear(x, layer.weight, layer.bias)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    dense = getattr(layer, "dense_weight", None)
    if dense is not None and (lo := _dense_from(layer, dense)) and x2.shape[0] >= lo:
        return onednn.linear(x, dense, layer.bias)
    if fmt == "int4":
        if (qw := getattr(layer, "qweight_int4_cpu", None)) is not None:
            sz = layer.qscale_zero_cpu
            y = cpu_gemv.mm(x2.to(cpu_gemv.act_dtype(sz)), qw, sz).to(x2.dtype)
        elif x2.is_cuda:
            y = torch._weight_int4pack_mm(x2, layer.qweight_int4, layer.group_size, layer.qscale_zero)
        else:
            y = torch._weight_int4pack_mm_for_cpu(x2, layer.qweight_int4, layer.group_size, layer.qscale_zero)
    elif (qw := getattr(layer, "qweight_int8_cpu", None)) is not None:
        y = cpu_gemv.mm_int8(x2.to(layer.qscale.dtype), qw, layer.qscale).to(x2.dtype)
    elif x2.is_cuda:
        wo = gpu_kernels()
        if x2.shape[0] <= wo.MAX_ROWS:  # read the int8 weight once, dequantized in registers
            y = wo.mm(x2, layer.qweight_int8, layer.qscale, bias=layer.bias)
            return y.reshape(*shape[:-1], y.shape[-1])
        y = F.linear(x2, layer.qweight_int8.to(x2.dtype)) * layer.qscale  # many rows: cuBLAS
    else:
        y = torch._weight_int8pack_mm(x2, layer.qweight_int8, layer.qscale)
    if layer.bias is not None:
        y = y + layer.bias
    return y.reshape(*shape[:-1], y.shape[-1])



def dequantize(layer: torch.nn.Module) -> torch.Tensor:
    """The float32 ``[N, K]`` weight the layer's GEMM multiplies by. int4 is read back through the
    kernel with an identity input, so it is exactly what the kernel uses (in the activation dtype)."""
    fmt = layer.quant_format
    if fmt == "dense":
        return layer.weight.float()
    if fmt == "int8":
        q = layer.qweight_int8 if hasattr(layer, "qweight_int8") else cpu_gemv.unpack_int8(layer.qweight_int8_cpu)
        return q.float() * layer.qscale.float()[:, None]
    if fmt == "int8_blocks":
        return dequantize_int8_blocks(cpu_gemv.unpack_int8(layer.qweight_int8_cpu),
                                      cpu_gemv.unpack_block_scales(layer.qscale_blocks))
    if (qw := getattr(layer, "qweight_int4_cpu", None)) is not None:
        return cpu_gemv.unpack(qw, layer.qscale_zero_cpu)
    sz = layer.qscale_zero
    eye = torch.eye(sz.shape[0] * layer.group_size, dtype=sz.dtype, device=sz.device)
    if eye.is_cuda:
        w_t = torch._weight_int4pack_mm(eye, layer.qweight_int4, layer.group_size, sz)
    else:
        w_t = torch._weight_int4pack_mm_for_cpu(eye, layer.qweight_int4, layer.group_size, sz)
    return w_t.float().t().contiguous()


def gpu_kernels():
    """``core_kernels.wo_gemm`` (Triton), imported on first use on a GPU."""
    from core_kernels import wo_gemm

    return wo_gemm


CpuLinearArgs = tuple[int, torch.Tensor | None, torch.Tensor | None, int, torch.Tensor | None]


def cpu_linear_args(layer: torch.nn.Module) -> CpuLinearArgs | None:
    """For C++ callers (``kernels/cpu_decode``): ``(kind, a, b, max_rows, dense)``. GEMMs of
    fewer than ``max_rows`` rows run ``kernels/cpu_gemv`` (kind 0 = int4: a = codes, b = scales
    and offsets, see ``cpu_gemv.pack``; 1 = int8: a = codes, b = scales), larger ones ``dense``
    (oneDNN-packed or plain; None: gemv for every size); kind 2 = dense only (a and b None). None
    where neither applies."""
    if layer.quant_format == "dense":
        return 2, None, None, 0, layer.weight
    dense = getattr(layer, "dense_weight", None)
    lo = _dense_from(layer, dense) if dense is not None else None
    big, dense = (lo, dense) if lo else (1 << 30, None)
    if (qw := getattr(layer, "qweight_int4_cpu", None)) is not None:
        return 0, qw, layer.qscale_zero_cpu, big, dense
    if (qw := getattr(layer, "qweight_int8_cpu", None)) is not None:
        return 1, qw, layer.qscale, big, dense
    return None


class PackedMethod:
    """``apply`` and ``dequantize`` for quant methods whose layers end in one of the formats above."""

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(layer, x)

    def cpu_linear_args(self, layer: torch.nn.Module) -> CpuLinearArgs | None:
        return cpu_linear_args(layer)

    def dequantize(self, layer: torch.nn.Module) -> torch.Tensor:
        return dequantize(layer)


class PackedHead(torch.nn.Module):
    """An LM head GEMM over an int8 copy of the ``[vocab, hidden]`` table (the table itself stays,
    for embedding lookups: one row per token, so its width costs nothing per step).

    On ``kernels/cpu_gemv`` the copy keeps one scale per row and run of 32 columns (GGUF's Q8_0;
    ``blocks``: a checkpoint's own codes and scales, else quantized from the table) and the logits
    come out in float32: a per-row scale (one per 576 values for SmolLM2) and bf16 logits left
    ~6 % of teacher-forced positions with exact top-2 ties that argmax broke by token id (issue 41;
    docs/benchmarks.md has the agreement figures). Elsewhere (GPUs, CPUs without the kernels) it
    is per-channel int8 in the activation dtype, as any int8 layer."""

    def __init__(self, weight: torch.Tensor, blocks: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.bias = None
        n, k = weight.shape
        if weight.device.type == "cpu" and cpu_gemv.shape_ok_int8(n, k) and cpu_gemv.available_for(weight.dtype):
            q, scale = blocks if blocks is not None else quantize_int8_blocks(weight)
            self.quant_format = "int8_blocks"
            self.register_buffer("qweight_int8_cpu", cpu_gemv.pack_int8(q))
            self.register_buffer("qscale_blocks", cpu_gemv.pack_block_scales(scale))
            self.row_invariant = True  # (each row's logits the same for any row count: batch-invariant as it is)
            return  # no dense copy: every batch size gets the same float32 logits from the same codes
        if blocks is not None:
            weight = dequantize_int8_blocks(*blocks).to(weight.dtype)
        q, scale = quantize_int8(weight)
        set_int8(self, q, scale, weight.dtype, weight.device, dense_copy=False)
        self.dense_min_rows = 0
        if self.quant_format == "int8" and _dense_wanted(weight.device, weight.dtype):
            # the table is kept anyway: big GEMMs use it directly (a plain reference, not a parameter),
            # or its oneDNN-packed copy within the budget
            copy = onednn_copy(weight)
            self.__dict__["dense_weight"] = weight if copy is None else copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_format != "int8_blocks":
            return packed_linear(self, x)
        shape = x.shape
        y = cpu_gemv.mm_int8_blocks(x.reshape(-1, shape[-1]), self.qweight_int8_cpu, self.qscale_blocks)
        return y.reshape(*shape[:-1], y.shape[-1])

    def cpu_linear_args(self) -> CpuLinearArgs | None:
        """For ``kernels/cpu_decode``, which can run the head with the decoder stack (kind 3: int8 blocks)."""
        if self.quant_format == "int8_blocks":
            return 3, self.qweight_int8_cpu, self.qscale_blocks, 1 << 30, None
        return cpu_linear_args(self)
