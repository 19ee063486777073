"""The default quantization method: plain dense weights in the serving dtype.

On CPU in bf16 each weight (and the LM head) is also packed once into oneDNN's layout, within the
dense-copy memory budget, because that GEMM runs up to 2.6x faster at decode batch sizes
(``onednn.py``)."""

from __future__ import annotations

import torch

from core import hookimpl
from core_plugins.quant import onednn, packed


class Unquantized:
    """Dense ``[out, in]`` weight, applied with one GEMM."""

    devices = ("cpu", "cuda")
    dense = True  # apply is F.linear over layer.weight: the shared layers may fuse it on a GPU

    def create_weights(self, layer: torch.nn.Module, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        layer.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        layer.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return onednn.linear(x, layer.__dict__.get("onednn_weight", layer.weight), layer.bias)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if layer.__dict__.pop("onednn_weight", None) is not None:  # (again after a weight update: its bytes back)
            packed.DENSE_BUDGET.give(layer.weight.numel() * layer.weight.element_size())
        if (w := packed.onednn_copy(layer.weight)) is not None:
            layer.__dict__["onednn_weight"] = w

    def cpu_linear_args(self, layer: torch.nn.Module) -> tuple[int, None, None, int, torch.Tensor]:
        """Dense only (kind 2), for ``kernels/cpu_decode``: see ``packed.PackedMethod.cpu_linear_args``."""
        return 2, None, None, 0, layer.__dict__.get("onednn_weight", layer.weight)

    def pack_lm_head(self, embedding: torch.nn.Module) -> torch.nn.Module | None:
        w = packed.onednn_copy(embedding.weight)
        return None if w is None else PackedDenseHead(w)


class PackedDenseHead(torch.nn.Module):
    """The LM head over the oneDNN-packed copy of the embedding table."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.__dict__["onednn_weight"] = w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn.linear(x, self.__dict__["onednn_weight"], None)

    def table_updated(self, embedding: torch.nn.Module) -> None:
        """The table changed in place (a weight update): packed again, the same size."""
        self.__dict__["onednn_weight"] = onednn.prepack(embedding.weight)


@hookimpl
def register_quant_methods(register) -> None:
    register("none", Unquantized)
