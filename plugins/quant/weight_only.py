"""Weight-only int8 / int4 quantized at load from a dense checkpoint: SGLang's
``--torchao-config int8wo`` and ``int4wo-<group>`` (32, 64, 128, 256).

int8wo: per-output-channel symmetric int8. int4wo-G: asymmetric min/max 4-bit per group of G
input columns (torchao's recipe). Activations stay in the serving dtype. A layer the kernel
cannot take (int4: ``in_features % G`` or ``out_features % 16``; int8: ``in_features % 16``)
stays dense; start-up logs the count of layers per format.

Unlike SGLang's torchao filter (``proj`` layers only), the LM head is served as per-channel int8
too (the input embedding stays dense: one row per token). At batch 1 the head is a fifth of
SmolLM2's weights and, once the layers are packed, most of the bytes a decode step reads: with a
dense head int8wo decoded 1.3x faster than bf16 here instead of ~2x. ``--quantization none``
keeps everything dense.
"""

from __future__ import annotations

import torch

from core import hookimpl
from core_plugins.quant import packed
from core_plugins.quant.unquantized import Unquantized


class Int8WeightOnly(packed.PackedMethod, Unquantized):
    """Loads the dense weight, then packs it as per-channel int8."""

    devices = ("cpu", "cuda")

    def pack_lm_head(self, embedding: torch.nn.Module) -> torch.nn.Module:
        return packed.PackedHead(embedding.weight.data)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        q, scale = packed.quantize_int8(layer.weight.data)
        packed.set_int8(layer, q, scale, layer.weight.dtype)


class Int4WeightOnly(Int8WeightOnly):
    """Loads the dense weight, then packs it as group-wise int4 (``group_size`` input columns per
    scale); the LM head as int8 (4-bit heads cost more quality for less gain: llama.cpp's Q4 files
    keep theirs at 6-8 bits)."""

    group_size = 128

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        w = layer.weight.data
        n, k = w.shape
        if not packed.int4_supported(n, k, self.group_size):
            layer.quant_format = "dense"
        else:
            q, scale, zero = packed.quantize_int4(w, self.group_size)
            packed.set_int4(layer, q, scale, zero, w.dtype)


class Int4WO32(Int4WeightOnly):
    group_size = 32


class Int4WO64(Int4WeightOnly):
    group_size = 64


class Int4WO128(Int4WeightOnly):
    group_size = 128


class Int4WO256(Int4WeightOnly):
    group_size = 256


TORCHAO_CONFIGS = {"int8wo": Int8WeightOnly, "int4wo-32": Int4WO32, "int4wo-64": Int4WO64,
                   "int4wo-128": Int4WO128, "int4wo-256": Int4WO256}


@hookimpl
def register_quant_methods(register) -> None:
    for name, cls in TORCHAO_CONFIGS.items():
        register(name, cls)
