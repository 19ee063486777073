"""fp8 (e4m3) weights with dynamic per-token activation scales: ``--quantization fp8``, GPU only.

Dense bf16/fp16 checkpoints are quantized at load with one scale per output channel
(``amax / 448``). Pre-quantized checkpoints (config.json ``quantization_config`` with
``quant_method: fp8``) load their fp8 weights as they are: with ``weight_scale`` (per tensor or
per output channel) the stored fp8 values are used unchanged; with transformers' block-wise
``weight_scale_inv`` (``weight_block_size``, the DeepSeek / Qwen3-FP8 layout) the blocks are
folded into one scale per output channel, which re-rounds the blocks whose scale is not their
row's largest. A GEMM of up to ``wo_gemm.MAX_ROWS`` rows (decode) multiplies the fp8 weight by
the activations as they are, dequantizing it in registers (``kernels/wo_gemm``: one launch, the
weight read once); a larger one quantizes the activations per token and runs ``torch._scaled_mm``
with row-wise fp32 scales on the fp8 tensor cores, output in the activation dtype.

Needs a CUDA GPU with fp8 tensor cores (compute capability >= 8.9); elsewhere start-up stops
naming the method and the device (torch's CPU ``_scaled_mm`` is a reference kernel: right, but
~15x slower than bf16 on the dev VM, so the unit tests use it and serving refuses it). Written
without a GPU at hand: tests/test_quant_fp8.py runs it where one is (skipped, with the reason, here).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from core import hookimpl
from core.errors import ModelLoadError
from core.layers import fused
from core_plugins.quant.packed import gpu_kernels

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def fp8_unsupported(device: torch.device) -> str | None:
    """Why fp8 GEMMs cannot run on ``device`` (None when they can)."""
    if device.type != "cuda":
        return ("fp8 GEMMs (torch._scaled_mm) need a CUDA GPU with compute capability >= 8.9; on CPU torch has only "
                "a reference kernel, ~15x slower than bf16")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"fp8 GEMMs need compute capability >= 8.9 (Ada, Hopper or newer); this GPU has {major}.{minor}"
    return None


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 ``[N, K]``, float32 scale ``[N]``): one scale per row, ``amax / 448``."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8:
    devices = ("cuda",)

    def __init__(self, prequantized: bool = False, block: tuple[int, int] | None = None) -> None:
        self.prequantized, self.block = prequantized, block

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8:
        if str(config.get("activation_scheme", "dynamic")) != "dynamic":
            raise ModelLoadError("fp8 checkpoint with static activation scales: only dynamic activation scaling is supported")
        block = config.get("weight_block_size")
        return cls(True, tuple(block) if block else None)

    def check_device(self, device: torch.device) -> str | None:
        return fp8_unsupported(device)

    def create_weights(self, layer: torch.nn.Module, in_features: int, out_features: int, bias: bool,
                       dtype: torch.dtype) -> None:
        layer.act_dtype = dtype
        layer.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        if not self.prequantized:
            layer.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
            return
        layer.weight = _param((out_features, in_features), FP8)
        if self.block is not None:
            bn, bk = self.block
            if any(n % bn for n in layer.output_sizes[:-1]):
                raise ModelLoadError(f"fp8: fused shards {layer.output_sizes} are not multiples of the block size {bn}")
            layer.weight_scale_inv = _param((-(-out_features // bn), -(-in_features // bk)), torch.float32)
            layer.weight_scale_inv.weight_loader = _rows_loader(layer, bn)
        else:
            layer.weight_scale = _param((out_features,), torch.float32)
            layer.weight_scale.weight_loader = _rows_loader(layer, 1)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        w = layer.weight.data
        if not self.prequantized:
            q, scale = quantize_rows(w)
        elif self.block is not None:
            bn, bk = self.block
            s = layer.weight_scale_inv.data.repeat_interleave(bn, 0)[: w.shape[0]].repeat_interleave(bk, 1)[:, : w.shape[1]]
            q, scale = quantize_rows(w.float() * s)
        else:
            q, scale = w, layer.weight_scale.data
        for name in ("weight", "weight_scale", "weight_scale_inv"):
            if name in layer._parameters:
                delattr(layer, name)
        n, k = q.shape
        if n % 16 or k % 16:  # _scaled_mm's shape rule: keep such a layer dense
            layer.quant_format = "dense"
            layer.weight = torch.nn.Parameter((q.float() * scale[:, None]).to(layer.act_dtype), requires_grad=False)
            return
        layer.quant_format = "fp8"
        layer.register_buffer("fp8_weight", q.contiguous())
        layer.register_buffer("fp8_scale", scale.float().reshape(1, n).contiguous())

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        if layer.quant_format == "dense":
            return F.linear(x, layer.weight, layer.bias)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.is_cuda and x2.shape[0] <= (wo := gpu_kernels()).MAX_ROWS:  # decode: fp8 weights, bf16 activations
            y = wo.mm(x2, layer.fp8_weight, layer.fp8_scale.view(-1), bias=layer.bias)
            return y.reshape(*shape[:-1], y.shape[-1])
        if (k := fused(x2)) is not None and hasattr(k, "per_token_fp8"):  # a GPU: one launch
            xq, s = k.per_token_fp8(x2, FP8_MAX)
        else:
            s = x2.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX  # per token
            xq = (x2.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        y = torch._scaled_mm(xq, layer.fp8_weight.t(), scale_a=s, scale_b=layer.fp8_scale, out_dtype=x.dtype)
        if layer.bias is not None:
            y = y + layer.bias
        return y.reshape(*shape[:-1], y.shape[-1])

    def dequantize(self, layer: torch.nn.Module) -> torch.Tensor:
        if layer.quant_format == "dense":
            return layer.weight.float()
        return layer.fp8_weight.float() * layer.fp8_scale.reshape(-1, 1)


def _param(shape: tuple[int, ...], dtype: torch.dtype) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
    p.keep_dtype = True  # fp8 weights and fp32 scales load as stored (the engine casts other floats)
    return p


def _rows_loader(layer: torch.nn.Module, rows_per_entry: int):
    """Loads a fused layer's shard of a per-row (or per-row-block) scale; a per-tensor scale
    (a scalar in the checkpoint) is broadcast over the shard's rows."""

    def load(param: torch.Tensor, loaded: torch.Tensor, shard: object = None) -> None:
        if shard is None:
            target = param.data
        else:
            start, size = layer.shard_span(shard)
            target = param.data.narrow(0, start // rows_per_entry, -(-size // rows_per_entry))
        if loaded.numel() == 1:  # per tensor
            loaded = loaded.reshape(()).expand(target.shape)
        elif loaded.dim() == 2 and loaded.shape[1] == 1 and target.dim() == 1:  # per channel, stored [N, 1]
            loaded = loaded.reshape(-1)
        if target.shape != loaded.shape:
            raise ValueError(f"shape mismatch: scale {tuple(target.shape)} vs checkpoint {tuple(loaded.shape)}")
        target.copy_(loaded)

    return load


@hookimpl
def register_quant_methods(register) -> None:
    register("fp8", Fp8)
