"""AWQ checkpoints (AutoAWQ's GEMM layout), served through the int4 group-wise path.

Per linear layer the checkpoint holds ``qweight`` int32 ``[K, N/8]`` and ``qzeros`` int32
``[K/G, N/8]`` (eight 4-bit values per int32 along the output dimension, nibble i holding
column ``AWQ_ORDER[i]`` of its 8), and ``scales`` fp16 ``[K/G, N]``; ``w[n, k] = (q[k, n] -
z[k/G, n]) * s[k/G, n]``. That is the tinygemm convention with ``zero = (8 - z) * s``, so
repacking is exact up to rounding the scale/zero pair to the activation dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from core import hookimpl
from core.errors import ModelLoadError
from core_plugins.quant import packed

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column (within 8) stored in nibble i
PACK = 8


def unpack_cols(packed_cols: torch.Tensor, order: tuple[int, ...] = AWQ_ORDER) -> torch.Tensor:
    """int32 ``[R, C/8]`` -> uint8 ``[R, C]``: nibble i of each int32 is column ``order[i]`` of its 8."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed_cols.device)
    nib = (packed_cols[..., None] >> shifts) & 0xF  # [R, C/8, 8] by nibble
    cols = torch.empty_like(nib)
    cols[..., list(order)] = nib
    return cols.reshape(packed_cols.shape[0], -1).to(torch.uint8)


def pack_cols(values: torch.Tensor, order: tuple[int, ...] = AWQ_ORDER) -> torch.Tensor:
    """uint8 ``[R, C]`` (0-15) -> int32 ``[R, C/8]``, the inverse of :func:`unpack_cols`."""
    v = values.to(torch.int32).reshape(values.shape[0], -1, PACK)[..., list(order)]
    out = torch.zeros(v.shape[:-1], dtype=torch.int32, device=v.device)
    for i in range(PACK):
        out |= v[..., i] << (4 * i)
    return out


def quantize_zero_point(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AWQ / GPTQ style asymmetric 4-bit with integer zero points, per group of ``group`` input
    columns: ``(q [N, K], z [N, K/G], s [N, K/G])`` with ``w ~ (q - z) * s``, ``s`` fp16-representable."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    s = ((hi - lo) / 15).clamp_min(1e-5).half().float()
    z = torch.round(-lo / s).clamp(0, 15)
    q = torch.clamp(torch.round(wg / s[..., None]) + z[..., None], 0, 15)
    return q.reshape(n, k).to(torch.uint8), z.to(torch.uint8), s


def shard_loader(layer: torch.nn.Module, dim: int, pack: int):
    """A weight loader that copies a packed layer's shard into its slice along ``dim``, whose
    entries each cover ``pack`` output columns."""

    def load(param: torch.Tensor, loaded: torch.Tensor, shard: object = None) -> None:
        if shard is None:
            target = param.data
        else:
            start, size = layer.shard_span(shard)
            target = param.data.narrow(dim, start // pack, size // pack)
        if target.shape != loaded.shape:
            raise ValueError(f"shape mismatch: parameter slice {tuple(target.shape)} vs checkpoint {tuple(loaded.shape)}")
        target.copy_(loaded)

    return load


def check_layout(method: str, layer: torch.nn.Module, in_features: int, group: int) -> None:
    if in_features % group or any(n % PACK for n in layer.output_sizes):
        raise ModelLoadError(f"{method}: a layer of shape {in_features} -> {layer.output_sizes} does not fit "
                             f"group size {group} and 8 values per int32")


class AWQ(packed.PackedMethod):
    """``--quantization awq`` / a config.json ``quantization_config`` with ``quant_method: awq``."""

    devices = ("cpu", "cuda")

    def __init__(self, group_size: int = 128) -> None:
        self.group_size = group_size

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AWQ:
        bits = config.get("bits", config.get("w_bit", 4))
        version = str(config.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm" or not config.get("zero_point", True):
            raise ModelLoadError(f"AWQ checkpoint with bits={bits}, version={version!r}, "
                                 f"zero_point={config.get('zero_point', True)}: only 4-bit GEMM-layout AWQ with zero "
                                 f"points is supported")
        return cls(int(config.get("group_size", config.get("q_group_size", 128))))

    def create_weights(self, layer: torch.nn.Module, in_features: int, out_features: int, bias: bool,
                       dtype: torch.dtype) -> None:
        g = self.group_size
        check_layout("awq", layer, in_features, g)
        shapes = {"qweight": ((in_features, out_features // PACK), torch.int32, PACK),
                  "qzeros": ((in_features // g, out_features // PACK), torch.int32, PACK),
                  "scales": ((in_features // g, out_features), torch.float32, 1)}
        for name, (shape, dt, pack) in shapes.items():
            p = torch.nn.Parameter(torch.zeros(shape, dtype=dt), requires_grad=False)
            p.keep_dtype = True  # scales stay float32 until repacked (the engine casts other floats to the model dtype)
            p.weight_loader = shard_loader(layer, 1, pack)
            setattr(layer, name, p)
        layer.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        layer.act_dtype = dtype

    def checkpoint_tensors(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """This layout for a float ``[N, K]`` weight (what AutoAWQ writes; for the conformance kit)."""
        q, z, s = quantize_zero_point(weight, self.group_size)
        return {"qweight": pack_cols(q.t()), "qzeros": pack_cols(z.t()), "scales": s.t().half().contiguous()}

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        q = unpack_cols(layer.qweight.data).t()  # [N, K]
        z = unpack_cols(layer.qzeros.data).t().float()  # [N, K/G]
        s = layer.scales.data.t().float()
        packed.set_int4(layer, q.contiguous(), s, (8 - z) * s, layer.act_dtype)


@hookimpl
def register_quant_methods(register) -> None:
    register("awq", AWQ)
