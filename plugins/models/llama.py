"""Llama architecture (Llama 2/3, SmolLM2, ...), wired from core's shared layers.

The classes take keyword options (projection biases, q/k norm, attention scaling,
soft-capping, norm offset) so that Llama-like families (Qwen2/3, Mistral, Gemma, ...)
stay short files that subclass or reuse them; every option defaults to Llama."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from core import hookimpl
from core_kernels import cpu_decode
from core.interfaces import AttentionLayerSpec, ForwardBatch, ModelContext
from core.layers import (Attention, GatedMLP, QKVParallelLinear, RMSNorm, RotaryEmbedding, RowParallelLinear,
                         VocabEmbedding, load_packed_weights)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config, layer_id: int) -> int | None:
    """The layer's attention window: from ``layer_types`` where the config has them
    (Qwen2/3, Gemma 2/3), else ``sliding_window`` on every layer (Mistral)."""
    window = getattr(config, "sliding_window", None) or None
    types = getattr(config, "layer_types", None)
    if types is not None:
        return window if types[layer_id] == "sliding_attention" else None
    return window


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_id: int, ctx: ModelContext, rotary: RotaryEmbedding, *, qkv_bias: bool | None = None,
                 o_bias: bool | None = None, qk_norm: bool = False, norm_offset: float = 0.0, scaling: float | None = None,
                 logit_cap: float = 0.0, sliding_window: int | None | str = "config") -> None:
        super().__init__()
        h, kv = config.num_attention_heads, config.num_key_value_heads
        d = head_dim_of(config)
        bias = getattr(config, "attention_bias", False)
        qkv_bias = bias if qkv_bias is None else qkv_bias
        o_bias = bias if o_bias is None else o_bias
        # heads split over tensor-parallel ranks by the shared layers: sizes below are this rank's
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, h, kv, qkv_bias, ctx.quant_method, ctx.dtype)
        self.q_size, self.kv_size = self.qkv_proj.output_sizes[:2]
        self.o_proj = RowParallelLinear(h * d, config.hidden_size, o_bias, ctx.quant_method, ctx.dtype)
        if qk_norm:  # per-head RMS norm of q and k before rotary (Qwen3, Gemma 3)
            self.q_norm = RMSNorm(d, config.rms_norm_eps, norm_offset)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, norm_offset)
        self.qk_norm = qk_norm
        self.rotary = rotary  # shared by all layers of a kind: one cos/sin cache
        window = sliding_window_of(config, layer_id) if sliding_window == "config" else sliding_window
        self.attn = Attention(AttentionLayerSpec(layer_id, h, kv, d, scaling=d**-0.5 if scaling is None else scaling,
                                                 sliding_window=window, logit_cap=logit_cap or 0.0))

    def forward(self, x: torch.Tensor, batch: ForwardBatch, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The attention block's output, plus ``residual`` when given (added by ``o_proj``)."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        s = self.attn.spec
        q, k = q.view(-1, s.num_heads, s.head_dim), k.view(-1, s.num_kv_heads, s.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(batch.positions, q, k)
        return self.o_proj(self.attn(q, k, v, batch), residual)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, ctx: ModelContext, rotary: RotaryEmbedding, **attn_options: Any) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, ctx, rotary, **attn_options)
        self.mlp = self.make_mlp(config, layer_id, ctx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_mlp(self, config, layer_id: int, ctx: ModelContext) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, ctx.quant_method, ctx.dtype,
                        bias=getattr(config, "mlp_bias", False))

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # (the op's attention is causal: a verify of draft trees takes the Python path below; so do
        # LoRA adapters, which the one-op layer's projections do not apply: only the stack's do)
        if (x.device.type == "cpu" and batch.tree_mask is None and not batch.lora
                and (fast := self._cpu_decode(batch.attn_backend)) is not None):
            h, mlp_out = cpu_decode.run(fast, x, batch)
            return h + mlp_out
        # the residual adds happen in the output projections (one GEMM each on a GPU: core.layers)
        x = self.self_attn(self.input_layernorm(x), batch, residual=x)
        if isinstance(self.mlp, GatedMLP):
            return self.mlp(self.post_attention_layernorm(x), residual=x)
        return x + self.mlp(self.post_attention_layernorm(x))

    def weights_updated(self) -> None:
        self.__dict__.pop("_cpu_plan", None)

    def _cpu_decode(self, backend: Any) -> dict[str, Any] | None:
        """This layer as one C++ op (``kernels/cpu_decode``), planned once per attention backend."""
        cached = self.__dict__.get("_cpu_plan")
        if cached is None or cached[0] is not backend:
            plan = cpu_decode.plan(self, backend) if type(self).forward is LlamaDecoderLayer.forward else None
            cached = self.__dict__["_cpu_plan"] = (backend, plan)
        return cached[1]


class LlamaModel(nn.Module):
    # Residual-stream inputs of these layers (``len(layers)``: the stream after the last layer,
    # before the final norm) are kept as ``captured`` (their concatenation along the last dim, in
    # this order) by every forward: the features an EAGLE draft model reads. Set after construction.
    capture_layers: tuple[int, ...] = ()

    def __init__(self, config, ctx: ModelContext, layer_cls: type[nn.Module] = LlamaDecoderLayer, **attn_options: Any) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, ctx.dtype)
        rotary = RotaryEmbedding(config, head_dim_of(config), config.max_position_embeddings)
        self.layers = nn.ModuleList(layer_cls(config, i, ctx, rotary, **attn_options) for i in range(config.num_hidden_layers))
        if ctx.device.type == "cpu":
            cpu_decode.available()  # build the one-op layer now (once per machine), not in the first, watched step
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, batch: ForwardBatch, head: VocabEmbedding | None = None) -> torch.Tensor:
        """The final hidden states. With ``head`` (the LM head, whose ``logits`` are the model's
        plain logits), a CPU decode through the one-op stack runs the head too and keeps its
        logits for :meth:`step_logits`."""
        self.__dict__.pop("_step_logits", None)
        x = self.embed_tokens(batch.input_ids)
        capture = self.capture_layers  # (the fused stack keeps no layer inputs: captures take the per-layer path)
        # the C++ ops attend causally: a verify of draft trees (batch.tree_mask) takes the Python
        # layers; a batch with LoRA adapters (batch.lora) does unless the stack serves it (only the
        # stack adds adapters)
        fused = x.device.type == "cpu" and batch.tree_mask is None
        if (fused and not capture and (stack := self._cpu_stack(batch.attn_backend, head)) is not None
                and x.shape[0] < stack["max_rows"] and (not batch.lora or cpu_decode.serves_lora(stack))):
            if x.shape[0] == len(batch.seq_lens_cpu) and x.shape[0] < stack["head_rows"]:  # one row per sequence: all sample
                hidden, logits = cpu_decode.run_stack_head(stack, x, batch)
                self.__dict__["_step_logits"] = (hidden, logits)
                return hidden
            h, mlp_out = cpu_decode.run_stack(stack, x, batch)
            return self.norm(h + mlp_out)
        return self.norm(self._layers(x, batch, fused and not batch.lora, capture))

    def _layers(self, x: torch.Tensor, batch: ForwardBatch, fused: bool, capture: tuple[int, ...] = ()) -> torch.Tensor:
        """The residual stream after every layer, each run as one C++ op where it has one and
        ``fused`` allows; with ``capture``, the stream at the input of those layers (``len(layers)``:
        after the last) is kept as ``self.captured``, concatenated in that order."""
        n = len(self.layers)
        if capture and any(not 0 <= i <= n for i in capture):
            raise ValueError(f"capture_layers {capture} out of range for {n} layers (0..{n})")
        stream: dict[int, torch.Tensor] = {}
        pending = None  # a one-op layer's MLP output, added by the next one-op layer with its first norm
        for i, layer in enumerate(self.layers):
            if capture and i in capture:
                stream[i] = x if pending is None else x + pending
            plan = getattr(layer, "_cpu_decode", None)
            if fused and plan is not None and (fast := plan(batch.attn_backend)) is not None:
                x, pending = cpu_decode.run(fast, x, batch, pending)
                continue
            if pending is not None:
                x, pending = x + pending, None
            x = layer(x, batch)
        x = x if pending is None else x + pending
        if capture:
            stream[n] = x
            self.captured = torch.cat([stream[i] for i in capture], dim=-1)
        return x

    def _cpu_stack(self, backend: Any, head: VocabEmbedding | None) -> dict[str, Any] | None:
        """Every layer as one C++ op (``kernels/cpu_decode.run_stack``), with the final norm and
        ``head`` where they can join it, and the token table where the lookup is plain; planned
        once per attention backend and head."""
        cached = self.__dict__.get("_cpu_stack_plan")
        if cached is None or cached[0] is not backend or cached[1] is not head:
            plans = [layer._cpu_decode(backend) if hasattr(layer, "_cpu_decode") else None for layer in self.layers]
            packed = head.head() if head is not None and head.tp.size == 1 else None
            emb = self.embed_tokens
            table = emb.weight if type(emb).forward is VocabEmbedding.forward and emb.tp.size == 1 else None
            plan = cpu_decode.plan_stack(plans, self.norm, packed, table)
            cached = self.__dict__["_cpu_stack_plan"] = (backend, head, plan)
        return cached[2]

    def weights_updated(self) -> None:
        self.__dict__.pop("_cpu_stack_plan", None)

    def step_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The logits the last forward computed with the stack, if ``hidden`` is what it returned."""
        step = self.__dict__.pop("_step_logits", None)
        return step[1] if step is not None and step[0] is hidden else None


class LlamaForCausalLM(nn.Module):
    """Subclasses change ``attn_options`` (keyword options of :class:`LlamaAttention`),
    ``layer_cls`` or ``packed_modules``; the rest is shared."""

    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
    }
    attn_options: dict[str, Any] = {}
    layer_cls: type[nn.Module] = LlamaDecoderLayer
    decode_lora = True  # decode_step(s) see batches with LoRA adapters too (and serve them where the stack adds them)

    def __init__(self, config, ctx: ModelContext) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, ctx, self.layer_cls, **self.attn_options)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = VocabEmbedding(config.vocab_size, config.hidden_size, ctx.dtype)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        head = self._stack_head()
        return self.model(batch) if head is None else self.model(batch, head)

    def _stack_head(self) -> VocabEmbedding | None:
        """The head that joins the CPU decode stack: only where compute_logits is this plain one."""
        if type(self).compute_logits is not LlamaForCausalLM.compute_logits or hasattr(self, "classify"):
            return None
        return self.model.embed_tokens if self.tied else self.lm_head

    def _decode_stack(self, inputs: Any, attn_backend: Any) -> tuple[dict[str, Any], int] | None:
        """(the CPU decode stack's plan, the vocabulary size) where the stack serves ``inputs``'s
        batch (a decode: one token per sequence, every one sampling; never while the model
        captures layer inputs, which only the per-layer path keeps; with LoRA adapters only where
        the stack adds them), else None. What serves is
        decided once per attention backend (this runs every step, where each attribute lookup
        through nn.Module costs)."""
        cached = self.__dict__.get("_decode_plan")
        if cached is None or cached[0] is not attn_backend:
            head = self._stack_head() if isinstance(self.model, LlamaModel) else None
            stack = self.model._cpu_stack(attn_backend, head) if head is not None else None
            cached = (attn_backend, stack if stack is not None and stack["embeds"] else None, self.config.vocab_size,
                      self.model)
            self.__dict__["_decode_plan"] = cached
        _, stack, vocab, model = cached
        b = len(inputs.seq_lens)
        if (stack is None or model.capture_layers or b >= stack["max_rows"] or b >= stack["head_rows"]
                or len(inputs.input_ids) != b or not isinstance(inputs.positions, list) or not isinstance(inputs.out_cache_loc, list)
                or inputs.kv_indices.device.type != "cpu" or (getattr(inputs, "lora", False) and not cpu_decode.serves_lora(stack))
                or (inputs.logit_rows != [(0, b)] and inputs.logit_rows != [list(range(b))])):  # (a prefill of one token each)
            return None
        return stack, vocab

    def decode_step(self, inputs: Any, attn_backend: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``CausalLM.decode_step``: a CPU decode step as one call of the decode stack
        (``kernels/cpu_decode.decode``) where it serves the batch; else None."""
        if (served := self._decode_stack(inputs, attn_backend)) is None:
            return None
        return cpu_decode.decode(served[0], inputs.input_ids, inputs.positions, inputs.out_cache_loc, inputs.kv_indices,
                                 inputs.seq_lens, served[1], getattr(inputs, "lora", False))

    def decode_steps(self, inputs: Any, attn_backend: Any, steps: int, stop_ids: list[int]) -> list[list[int]] | None:
        """``CausalLM.decode_steps``: up to ``steps`` greedy CPU decode steps as one call of the
        decode stack (``kernels/cpu_decode.decode_steps``) where it serves the batch; else None."""
        if (served := self._decode_stack(inputs, attn_backend)) is None:
            return None
        return cpu_decode.decode_steps(served[0], inputs.input_ids, inputs.positions, inputs.out_cache_loc,
                                       inputs.kv_indices, inputs.seq_lens, served[1], steps, stop_ids,
                                       getattr(inputs, "lora", False))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if isinstance(self.model, LlamaModel) and (logits := self.model.step_logits(hidden)) is not None:
            return logits.float()
        head = self.model.embed_tokens if self.tied else self.lm_head
        return head.logits(hidden).float()

    def skip_weight(self, name: str) -> bool:
        return "rotary_emb.inv_freq" in name or (self.tied and name == "lm_head.weight")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], partial: bool = False) -> None:
        load_packed_weights(self, weights, self.packed_modules, self.skip_weight, partial=partial)

    def weights_updated(self) -> None:
        self.__dict__.pop("_decode_plan", None)  # (the plans below hold the packed copies that were rebuilt)


@hookimpl
def register_models(register) -> None:
    register("LlamaForCausalLM", LlamaForCausalLM)
