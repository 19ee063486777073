"""Gemma 2 and Gemma 3 (text): sliding-window layers interleaved with global ones (the
config's ``layer_types``), ``(1 + w)`` RMS norms around both attention and MLP, embeddings
scaled by sqrt(hidden), ``query_pre_attn_scalar`` attention scaling, attention and final
logit soft-capping (Gemma 2), q/k norms and a rotary base per layer type (Gemma 3)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from core import hookimpl
from core.interfaces import ForwardBatch, ModelContext
from core.layers import GatedMLP, RMSNorm, RotaryEmbedding
from core_plugins.models.llama import LlamaAttention, LlamaForCausalLM, head_dim_of


def _rotaries(config) -> dict[str, RotaryEmbedding]:
    """One rotary per layer type when ``rope_parameters`` is keyed by layer type (Gemma 3)."""
    d, n = head_dim_of(config), config.max_position_embeddings
    params = getattr(config, "rope_parameters", None) or {}
    if "full_attention" in params or "sliding_attention" in params:
        return {t: RotaryEmbedding(config, d, n, layer_type=t) for t in params}
    return {t: RotaryEmbedding(config, d, n) for t in (None,)}


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, ctx: ModelContext, rotary, **attn_options: Any) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = LlamaAttention(config, layer_id, ctx, rotary, **attn_options)
        self.mlp = GatedMLP(h, config.intermediate_size, config.hidden_activation, ctx.quant_method, ctx.dtype)
        self.input_layernorm = RMSNorm(h, eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(h, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, offset=1.0)
        self.post_feedforward_layernorm = RMSNorm(h, eps, offset=1.0)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), batch))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(nn.Module):
    def __init__(self, config, ctx: ModelContext, qk_norm: bool) -> None:
        super().__init__()
        from core.layers import VocabEmbedding

        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, ctx.dtype)
        # sqrt(hidden) rounded to the model dtype, as in transformers; a buffer on the model's device
        self.register_buffer("normalizer", torch.tensor(config.hidden_size**0.5, dtype=ctx.dtype), persistent=False)
        rotaries = _rotaries(config)
        types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        opts = dict(scaling=config.query_pre_attn_scalar**-0.5, logit_cap=getattr(config, "attn_logit_softcapping", None) or 0.0,
                    qk_norm=qk_norm, norm_offset=1.0)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i, ctx, rotaries.get(types[i], rotaries.get(None)), **opts)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=1.0)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        x = x * self.normalizer
        for layer in self.layers:
            x = layer(x, batch)
        return self.norm(x)


class Gemma2ForCausalLM(LlamaForCausalLM):
    qk_norm = False

    def __init__(self, config, ctx: ModelContext) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.model = GemmaModel(config, ctx, self.qk_norm)
        self.tied = bool(getattr(config, "tie_word_embeddings", True))
        if not self.tied:
            from core.layers import VocabEmbedding

            self.lm_head = VocabEmbedding(config.vocab_size, config.hidden_size, ctx.dtype)
        self.final_cap = getattr(config, "final_logit_softcapping", None) or 0.0

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_cap:
            logits = torch.tanh(logits / self.final_cap) * self.final_cap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True


@hookimpl
def register_models(register) -> None:
    register("Gemma2ForCausalLM", Gemma2ForCausalLM)
    register("Gemma3ForCausalLM", Gemma3ForCausalLM)
