"""Llama architecture (Llama 2/3, SmolLM2, ...), wired from core's shared layers."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from core import hookimpl
from core.interfaces import AttentionLayerSpec, ForwardBatch, ModelContext
from core.layers import Attention, GatedMLP, Linear, RMSNorm, RotaryEmbedding, VocabEmbedding, load_packed_weights


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_id: int, ctx: ModelContext, rotary: RotaryEmbedding) -> None:
        super().__init__()
        h, kv = config.num_attention_heads, config.num_key_value_heads
        d = getattr(config, "head_dim", None) or config.hidden_size // h
        bias = getattr(config, "attention_bias", False)
        self.q_size, self.kv_size = h * d, kv * d
        self.qkv_proj = Linear(config.hidden_size, [h * d, kv * d, kv * d], bias, ctx.quant_method, ctx.dtype, ("q", "k", "v"))
        self.o_proj = Linear(h * d, config.hidden_size, bias, ctx.quant_method, ctx.dtype)
        self.rotary = rotary  # shared by all layers: one cos/sin cache
        self.attn = Attention(AttentionLayerSpec(layer_id, h, kv, d, scaling=d**-0.5))

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        s = self.attn.spec
        q, k = self.rotary(batch.positions, q.view(-1, s.num_heads, s.head_dim), k.view(-1, s.num_kv_heads, s.head_dim))
        return self.o_proj(self.attn(q, k, v, batch))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, ctx: ModelContext, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, ctx, rotary)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, ctx.quant_method, ctx.dtype,
                            bias=getattr(config, "mlp_bias", False))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config, ctx: ModelContext) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, ctx.dtype)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary = RotaryEmbedding(config, head_dim, config.max_position_embeddings)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, ctx, rotary) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        for layer in self.layers:
            x = layer(x, batch)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
    }

    def __init__(self, config, ctx: ModelContext) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, ctx)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = VocabEmbedding(config.vocab_size, config.hidden_size, ctx.dtype)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        return torch.nn.functional.linear(hidden, w).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def skip(name: str) -> bool:
            return "rotary_emb.inv_freq" in name or (self.tied and name == "lm_head.weight")

        load_packed_weights(self, weights, self.packed_modules, skip)


@hookimpl
def register_models(register) -> None:
    register("LlamaForCausalLM", LlamaForCausalLM)
