"""The default quantization method: plain dense weights in the serving dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core import hookimpl


class Unquantized:
    """Dense ``[out, in]`` weight, applied with one GEMM."""

    devices = ("cpu", "cuda")

    def create_weights(self, layer: torch.nn.Module, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        layer.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        layer.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        return None


@hookimpl
def register_quant_methods(register) -> None:
    register("none", Unquantized)
