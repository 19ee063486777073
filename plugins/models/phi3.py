"""Phi-3 (and Phi-3.5 / Phi-4-mini): Llama whose checkpoint already stores the fused
``qkv_proj`` and ``gate_up_proj`` tensors; a packed :class:`~core.layers.Linear` loads a
fused tensor whole, so nothing needs splitting."""

from __future__ import annotations

import torch
from torch import nn

from core import hookimpl
from core.interfaces import ModelContext
from core.layers import ACTIVATIONS, ColumnParallelLinear, RowParallelLinear, gated_act
from core_plugins.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class Phi3MLP(nn.Module):
    def __init__(self, config, ctx: ModelContext) -> None:
        super().__init__()
        i = config.intermediate_size
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {config.hidden_act!r}; known: {', '.join(ACTIVATIONS)}")
        self.act = config.hidden_act
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [i, i], False, ctx.quant_method, ctx.dtype, ("gate", "up"))
        self.down_proj = RowParallelLinear(i, config.hidden_size, False, ctx.quant_method, ctx.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(gated_act(self.act, gate, up))


class Phi3DecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config, layer_id: int, ctx: ModelContext) -> nn.Module:
        return Phi3MLP(config, ctx)


class Phi3ForCausalLM(LlamaForCausalLM):
    packed_modules = {}  # the checkpoint's qkv_proj / gate_up_proj are already fused
    layer_cls = Phi3DecoderLayer


@hookimpl
def register_models(register) -> None:
    register("Phi3ForCausalLM", Phi3ForCausalLM)
