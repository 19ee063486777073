"""GPTQ checkpoints (AutoGPTQ / GPTQModel layout, 4-bit), served through the int4 group-wise path.

Per linear layer: ``qweight`` int32 ``[K/8, N]`` (eight 4-bit rows per int32 along the input
dimension, nibble i = row 8r + i), ``qzeros`` int32 ``[K/G, N/8]`` (eight columns per int32,
nibble i = column 8c + i), ``scales`` fp16 ``[K/G, N]`` and ``g_idx`` int32 ``[K]`` (the group of
each input row). ``w[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]``, where the stored zero
is ``z - 1`` in the original ``gptq`` checkpoint format and ``z`` itself in ``gptq_v2``.

With ``desc_act`` (act-order) the groups are not contiguous in k: the input columns are
permuted so that they are (``x`` is permuted the same way per call), then it is the tinygemm
convention with ``zero = (8 - z) * s``: exact up to rounding the scale/zero pair.
"""

from __future__ import annotations

from typing import Any

import torch

from core import hookimpl
from core.errors import ModelLoadError
from core_plugins.quant import packed
from core_plugins.quant.awq import PACK, check_layout, pack_cols, quantize_zero_point, shard_loader

SEQUENTIAL = tuple(range(PACK))


def unpack_rows(packed_rows: torch.Tensor) -> torch.Tensor:
    """int32 ``[R/8, C]`` -> uint8 ``[R, C]``: nibble i of each int32 is row 8r + i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed_rows.device)
    nib = (packed_rows[:, None, :] >> shifts[None, :, None]) & 0xF  # [R/8, 8, C]
    return nib.reshape(-1, packed_rows.shape[1]).to(torch.uint8)


def unpack_cols(packed_cols: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, C/8]`` -> uint8 ``[R, C]``: nibble i of each int32 is column 8c + i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed_cols.device)
    return ((packed_cols[..., None] >> shifts) & 0xF).reshape(packed_cols.shape[0], -1).to(torch.uint8)


class GPTQ:
    """``--quantization gptq`` / a config.json ``quantization_config`` with ``quant_method: gptq``."""

    devices = ("cpu", "cuda")

    def __init__(self, group_size: int = 128, zero_offset: int = 1) -> None:
        self.group_size, self.zero_offset = group_size, zero_offset

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GPTQ:
        bits = config.get("bits", 4)
        if bits != 4:
            raise ModelLoadError(f"GPTQ checkpoint with bits={bits}: only 4-bit GPTQ is supported")
        group = int(config.get("group_size", 128))
        if group <= 0:
            raise ModelLoadError(f"GPTQ checkpoint with group_size={group}: per-channel GPTQ is not supported "
                                 f"(the int4 kernel takes groups of 32-256)")
        fmt = str(config.get("checkpoint_format", "gptq")).lower()
        return cls(group, zero_offset=0 if fmt == "gptq_v2" else 1)

    def create_weights(self, layer: torch.nn.Module, in_features: int, out_features: int, bias: bool,
                       dtype: torch.dtype) -> None:
        g = self.group_size
        check_layout("gptq", layer, in_features, g)
        if in_features % PACK:
            raise ModelLoadError(f"gptq: in_features {in_features} is not a multiple of 8")
        shapes = {"qweight": ((in_features // PACK, out_features), torch.int32, 1),
                  "qzeros": ((in_features // g, out_features // PACK), torch.int32, PACK),
                  "scales": ((in_features // g, out_features), torch.float32, 1)}
        for name, (shape, dt, pack) in shapes.items():
            p = torch.nn.Parameter(torch.zeros(shape, dtype=dt), requires_grad=False)
            p.keep_dtype = True
            p.weight_loader = shard_loader(layer, 1, pack)
            setattr(layer, name, p)
        g_idx = torch.nn.Parameter(torch.zeros(in_features, dtype=torch.int32), requires_grad=False)
        g_idx.weight_loader = lambda param, loaded, shard=None: _load_g_idx(layer, param, loaded, shard)
        layer.g_idx = g_idx
        layer.g_idx_loaded = False
        layer.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        layer.act_dtype = dtype

    def checkpoint_tensors(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """This layout for a float ``[N, K]`` weight (what AutoGPTQ writes without act-order; for the
        conformance kit)."""
        q, z, s = quantize_zero_point(weight, self.group_size)
        k = weight.shape[1]
        return {"qweight": pack_cols(q.contiguous(), SEQUENTIAL).t().contiguous(),  # rows 8r + i in nibble i
                "qzeros": pack_cols(((z.int() - self.zero_offset) & 0xF).t().contiguous(), SEQUENTIAL),
                "scales": s.t().half().contiguous(), "g_idx": (torch.arange(k) // self.group_size).int()}

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        g = self.group_size
        q = unpack_rows(layer.qweight.data).t()  # [N, K]
        z = unpack_cols(layer.qzeros.data).float() + self.zero_offset  # [K/G, N]
        s = layer.scales.data.float()
        g_idx = layer.g_idx.data.long()
        perm = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[perm], torch.arange(len(perm), device=perm.device) // g):  # (sorted or not)
            raise ModelLoadError(f"gptq: g_idx does not assign {g} input rows to each group")
        if torch.equal(perm, torch.arange(len(perm), device=perm.device)):
            perm = None
        if perm is not None:
            q = q[:, perm]
        zero = ((8 - z) * s).t()
        del layer.g_idx_loaded
        packed.set_int4(layer, q.contiguous(), s.t(), zero, layer.act_dtype)
        layer.register_buffer("input_perm", perm)  # act-order: x is permuted to the same column order per call

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        if layer.input_perm is not None:
            x = x.index_select(-1, layer.input_perm)
        return packed.packed_linear(layer, x)

    def dequantize(self, layer: torch.nn.Module) -> torch.Tensor:
        """The weight in the checkpoint's input order (undoing the act-order permutation)."""
        w = packed.dequantize(layer)
        if layer.input_perm is None:
            return w
        out = torch.empty_like(w)
        out[:, layer.input_perm] = w
        return out


def _load_g_idx(layer: torch.nn.Module, param: torch.Tensor, loaded: torch.Tensor, shard: object) -> None:
    """Every shard of a fused layer sees the same input, so their g_idx must agree."""
    if loaded.shape != param.shape:
        raise ValueError(f"shape mismatch: g_idx {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    if layer.g_idx_loaded and not torch.equal(param.data, loaded.to(param.device)):
        raise ValueError("the shards of a fused layer have different g_idx (act-order); they cannot share one GEMM")
    param.data.copy_(loaded)
    layer.g_idx_loaded = True


@hookimpl
def register_quant_methods(register) -> None:
    register("gptq", GPTQ)
