"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention; sparse layers route each
token to ``num_experts_per_tok`` of ``num_experts`` experts (softmax top-k, renormalised
when ``norm_topk_prob``) plus a sigmoid-gated shared expert; ``mlp_only_layers`` and
``decoder_sparse_step`` pick the dense layers. Experts run through core's
:class:`~core.layers.FusedExperts` (a reference torch loop a fused kernel can replace)."""

from __future__ import annotations

import torch
from torch import nn

from core import hookimpl
from core.interfaces import ModelContext
from core.layers import FusedExperts, GatedMLP, Linear, select_experts
from core_plugins.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class Qwen2MoeSparseBlock(nn.Module):
    def __init__(self, config, ctx: ModelContext) -> None:
        super().__init__()
        h = config.hidden_size
        self.top_k, self.renormalize = config.num_experts_per_tok, bool(config.norm_topk_prob)
        self.gate = Linear(h, config.num_experts, False, ctx.quant_method, ctx.dtype)
        self.experts = FusedExperts(config.num_experts, h, config.moe_intermediate_size, config.hidden_act, ctx.dtype)
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        self.shared_expert = GatedMLP(h, shared, config.hidden_act, ctx.quant_method, ctx.dtype) if shared else None
        self.shared_expert_gate = Linear(h, 1, False, ctx.quant_method, ctx.dtype) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, layer_id: int, ctx: ModelContext, rotary, **attn_options) -> None:
        super().__init__(config, layer_id, ctx, rotary, qkv_bias=getattr(config, "qkv_bias", True), o_bias=False)

    def make_mlp(self, config, layer_id: int, ctx: ModelContext) -> nn.Module:
        sparse = (layer_id not in (config.mlp_only_layers or []) and config.num_experts > 0
                  and (layer_id + 1) % config.decoder_sparse_step == 0)
        if sparse:
            return Qwen2MoeSparseBlock(config, ctx)
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, ctx.quant_method, ctx.dtype)


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen2MoeDecoderLayer

    def __init__(self, config, ctx: ModelContext) -> None:
        super().__init__(config, ctx)
        self.packed_modules = {**LlamaForCausalLM.packed_modules, **FusedExperts.packed_modules(config.num_experts)}


@hookimpl
def register_models(register) -> None:
    register("Qwen2MoeForCausalLM", Qwen2MoeForCausalLM)
