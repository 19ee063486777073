"""GGUF kept quantized: a GGUF file's linear weights are repacked at load, never widened to bf16.

The loader (``core.engine.model_loader.loader``) feeds each ``Linear`` weight as its raw GGUF rows
(``<layer>.qweight``, uint8 ``[rows, bytes_per_row]``, already row-permuted the way transformers
reads the file) plus ``<layer>.qweight_type`` (the GGML type). Per checkpoint tensor:

- Q4_0, Q4_1, Q4_K are group-32 asymmetric 4-bit, so they become the int4 format *exactly*:
  Q4_0 ``w = d (q - 8)``; Q4_1 ``w = d q + m`` (scale d, zero m + 8d); Q4_K sub-block j
  ``w = d sc_j q - dmin m_j`` (scale d sc_j, zero 8 d sc_j - dmin m_j). The CPU kernels keep each
  group's scale and minimum (``zero - 8 scale``) in fp16 beside float32 activations, so Q4_0 and
  Q4_1 stay exact there (Q4_K's products round to fp16); beside bf16 ones the scale and zero, in
  bf16 (each rounded to bf16, as a bf16 model's weights are).
- Other quantized types (Q8_0, Q5_x, Q6_K, Q2_K, Q3_K, Q5_K, ...) are dequantized exactly and
  re-quantized to per-channel int8 (one extra rounding of at most half an int8 step per row).
- F32 / F16 / BF16 tensors stay dense.

A fused layer (q/k/v, gate/up) takes the widest format among its shards (int4 < int8 < dense).
When the file's LM head (``output.weight``, or ``token_embd.weight`` when tied) is quantized, the
head is served packed (``packed.PackedHead``; the input embedding stays dense): on
``kernels/cpu_gemv`` as int8 blocks with float32 logits, a Q8_0 head with the file's own codes and
scales (another type dequantized and re-quantized per 32 columns), elsewhere per-channel int8.
"""

from __future__ import annotations

from typing import Any

import torch

from core import hookimpl
from core.engine.model_loader.gguf_cache import raw_rows
from core.errors import ModelLoadError
from core_plugins.quant import packed

# GGML type ids (gguf.GGMLQuantizationType), spelled out so this module imports without gguf.
F32, F16, Q4_0, Q4_1, Q8_0, Q4_K, BF16 = 0, 1, 2, 3, 8, 12, 30
FLOAT_TYPES = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}
INT4_TYPES = (Q4_0, Q4_1, Q4_K)


class GGUFQuant(packed.PackedMethod):
    """Raw GGUF blocks in, int4 / int8 / dense out (see the module docstring)."""

    devices = ("cpu", "cuda")
    gguf_raw = True  # the loader feeds raw GGUF rows as <layer>.qweight + <layer>.qweight_type

    def __init__(self, head_type: int | None = None, gguf_file: str | None = None, head: list | None = None) -> None:
        self.head_type = head_type
        self.gguf_file, self.head = gguf_file, head
        self.quantize_lm_head = head_type is not None and head_type not in FLOAT_TYPES

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GGUFQuant:
        """``config`` from the loader: ``head_type`` (the GGML type of the file's LM head), ``gguf_file``
        (the file) and ``head`` (``[name, byte offset, GGML type, rows, bytes]`` of the head's rows in it)."""
        return cls(config.get("head_type"), config.get("gguf_file"), config.get("head"))

    def create_weights(self, layer: torch.nn.Module, in_features: int, out_features: int, bias: bool,
                       dtype: torch.dtype) -> None:
        shards = max(1, len(layer.output_sizes))
        layer.qweight = torch.nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        layer.qweight_type = torch.nn.Parameter(torch.full((shards,), -1, dtype=torch.int32), requires_grad=False)
        layer.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        layer.gguf_shards = {}  # shard index -> raw rows
        layer.qweight.weight_loader = lambda param, loaded, shard=None: _stash(layer, loaded, shard)
        layer.qweight_type.weight_loader = lambda param, loaded, shard=None: _set_type(layer, loaded, shard)
        layer.act_dtype = dtype

    def checkpoint_tensors(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """A float ``[N, K]`` weight as the loader feeds a Q4_1 GGUF tensor (for the conformance kit)."""
        import gguf

        raw = gguf.quants.quantize(weight.float().cpu().numpy(), gguf.GGMLQuantizationType.Q4_1)
        return {"qweight": torch.from_numpy(raw), "qweight_type": torch.tensor([Q4_1], dtype=torch.int32)}

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        types = layer.qweight_type.tolist()
        parts = [decode(layer.gguf_shards[i], types[i], layer.in_features) for i in range(len(types))]
        del layer.gguf_shards
        fmt = max((p[0] for p in parts), key=packed.FORMATS.index)
        dtype = layer.act_dtype
        if fmt == "int4":
            q, scale, zero = (torch.cat([p[i] for p in parts]) for i in (1, 2, 3))
            packed.set_int4(layer, q, scale, zero, dtype)
            return
        w = torch.cat([packed.dequantize_int4(*p[1:]) if p[0] == "int4" else p[1] for p in parts])
        if fmt == "int8":
            q, scale = packed.quantize_int8(w)
            packed.set_int8(layer, q, scale, dtype)
        else:
            packed.set_dense(layer, w, dtype)

    def pack_lm_head(self, embedding: torch.nn.Module) -> torch.nn.Module | None:
        """The LM head packed when the file's head is quantized (else it stays dense), from the file's
        own blocks where they are the table the model loaded."""
        if not self.quantize_lm_head:
            return None
        blocks = head_blocks(self.gguf_file, self.head, embedding) if self.gguf_file and self.head else None
        return packed.PackedHead(embedding.weight.data, blocks)


def head_blocks(gguf_file: str, head: list, embedding: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The file's LM head (``head``: where its rows lie, from the loader) as int8 blocks ``(q [rows, K],
    scale [rows, K/32])`` for ``embedding``'s rows (its vocab-parallel share, zero past the vocab): a
    Q8_0 head exactly, another type dequantized and re-quantized per 32 columns. None (the table is
    quantized instead) where the file's head is not the table the model loaded: a check by value,
    as the loader's tensor table checks."""
    _, offset, ggml_type, vocab, nbytes = head
    table = embedding.weight.data
    rows, k = table.shape
    if k % 32 or not vocab or nbytes % vocab:
        return None
    try:
        raw = raw_rows(gguf_file, [offset, ggml_type, vocab, nbytes])
    except ModelLoadError:  # the file ends early: the table is packed instead
        return None
    start = getattr(embedding, "vocab_start", 0)
    n = max(0, min(rows, vocab - start))
    raw = raw[start:start + n]
    if ggml_type == Q8_0:
        if raw.shape[1] != k // 32 * 34:
            return None
        b = raw.reshape(n, k // 32, 34)
        q, scale = b[..., 2:].contiguous().view(torch.int8).reshape(n, k), _f16(b[..., 0:2])
        w = packed.dequantize_int8_blocks(q, scale)
    else:
        fmt, *parts = decode(raw, ggml_type, k)
        w = packed.dequantize_int4(*parts) if fmt == "int4" else parts[0]
        q, scale = packed.quantize_int8_blocks(w)
    if not torch.equal(w.to(table.dtype), table[:n]):
        return None
    pad = rows - n
    return (torch.cat([q, q.new_zeros(pad, k)]), torch.cat([scale, scale.new_zeros(pad, k // 32)])) if pad else (q, scale)


def _stash(layer: torch.nn.Module, raw: torch.Tensor, shard: object) -> None:
    i = layer.shard_index(shard)
    rows = layer.output_sizes[i]
    if raw.dim() != 2 or raw.shape[0] != rows:
        raise ValueError(f"GGUF rows {tuple(raw.shape)} do not match the layer's {rows} output rows")
    layer.gguf_shards[i] = raw


def _set_type(layer: torch.nn.Module, loaded: torch.Tensor, shard: object) -> None:
    layer.qweight_type.data[layer.shard_index(shard)] = int(loaded.reshape(-1)[0])


# --------------------------------------------------------------------------- raw blocks -> formats


def decode(raw: torch.Tensor, ggml_type: int, k: int) -> tuple:
    """One tensor's raw rows ``[N, bytes]`` -> ``("int4", q, scale, zero)`` (group 32),
    ``("int8", w)`` or ``("dense", w)`` with ``w`` float32 ``[N, k]`` (the exactly dequantized values)."""
    n = raw.shape[0]
    if ggml_type in FLOAT_TYPES:
        return "dense", raw.contiguous().view(FLOAT_TYPES[ggml_type]).reshape(n, k).float()
    if ggml_type in (Q4_0, Q4_1):
        return ("int4", *_q4_legacy(raw, k, ggml_type == Q4_1))
    if ggml_type == Q4_K:
        return ("int4", *_q4_k(raw, k))
    return "int8", dequantize_numpy(raw, ggml_type, k)


def dequantize_numpy(raw: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """gguf's reference dequantization (numpy), for the types without an exact packed form."""
    import gguf

    try:
        qtype = gguf.GGMLQuantizationType(ggml_type)
        w = gguf.quants.dequantize(raw.contiguous().numpy(), qtype)
    except (ValueError, NotImplementedError) as e:
        raise ModelLoadError(f"GGUF tensor type {ggml_type} cannot be read: {e}") from None
    return torch.from_numpy(w.copy()).reshape(raw.shape[0], k)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 from the last dimension's 2 bytes, as float32 (squeezed)."""
    return b.contiguous().view(torch.float16).float().squeeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 values: low nibbles are elements 0-15, high nibbles 16-31 (GGML's layout)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _q4_legacy(raw: torch.Tensor, k: int, has_min: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = raw.shape[0]
    bs = 20 if has_min else 18
    b = raw.reshape(n, k // 32, bs)
    d = _f16(b[..., 0:2])
    off = 4 if has_min else 2
    q = _nibbles(b[..., off:off + 16]).reshape(n, k)
    zero = _f16(b[..., 2:4]) + 8 * d if has_min else torch.zeros_like(d)
    return q, d, zero


def _q4_k(raw: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K super-blocks of 256: fp16 d and dmin, 8 six-bit (scale, min) pairs packed in 12 bytes,
    128 bytes of nibbles (per 64 values: 32 bytes, low nibbles first 32, high nibbles next 32)."""
    n = raw.shape[0]
    b = raw.reshape(n, k // 256, 144)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    s = b[..., 4:16].reshape(n, -1, 3, 4).to(torch.int32)
    lo, mid, hi = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], -1)  # [n, blocks, 8]
    mn = torch.cat([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], -1)
    qs = b[..., 16:].reshape(n, -1, 4, 32)
    q = torch.stack([qs & 0x0F, qs >> 4], dim=3).reshape(n, k)  # chunk j: sub-blocks 2j, 2j+1
    scale = d[..., None] * sc
    zero = 8 * scale - dmin[..., None] * mn
    return q, scale.reshape(n, -1), zero.reshape(n, -1)


@hookimpl
def register_quant_methods(register) -> None:
    register("gguf", GGUFQuant)
