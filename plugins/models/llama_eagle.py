"""SGLang's EAGLE draft models: ``LlamaForCausalLMEagle`` (EAGLE / EAGLE-2) and
``LlamaForCausalLMEagle3`` (EAGLE-3), with SGLang's semantics and checkpoint names.

A draft reads the target's hidden states (``features``, one row per input token) besides the
tokens. Both classes serve one interface, which the engine's drafter calls:

* ``forward(batch, features) -> (hidden_for_logits, hidden_for_next_step)``;
* ``compute_logits(hidden)``: float32 logits over the TARGET vocabulary;
* ``feature_size``: the width of ``features`` on a first draft step;
* ``capture_layers(num_target_layers)``: the target layer inputs to capture
  (``LlamaModel.capture_layers``); ``()``: the target's final (normed) hidden states;
* ``share_target(target)``: take the target's token embedding and/or LM head, as SGLang's
  EAGLE worker does (``set_embed_and_head`` / ``set_embed``).

Layers run their plain torch path (no CPU one-op fast path: their forwards differ from
``LlamaDecoderLayer.forward``, so ``cpu_decode`` never plans them).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from core import hookimpl
from core.errors import ModelLoadError
from core.interfaces import ForwardBatch, ModelContext
from core.layers import QKVParallelLinear, RMSNorm, RotaryEmbedding, VocabEmbedding, load_packed_weights
from core_plugins.models.llama import LlamaDecoderLayer, head_dim_of

PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}


def _rotary(config) -> RotaryEmbedding:
    return RotaryEmbedding(config, head_dim_of(config), config.max_position_embeddings)


def _load(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], rename: Callable[[str], str | None],
          optional: set[str]) -> set[str]:
    """Load the draft checkpoint under SGLang's names (``rename``: checkpoint name to parameter
    name, None to skip); returns the ``optional`` parameters it lacked (taken from the target)."""
    named = ((m, t) for n, t in weights if (m := rename(n)) is not None)
    try:
        return optional - load_packed_weights(model, named, PACKED, optional=optional)
    except ModelLoadError as e:
        raise ModelLoadError(f"draft {e}") from None


def _target_head(target: nn.Module) -> VocabEmbedding:
    """The LM head of a ``LlamaForCausalLM`` target (its token table when tied)."""
    return target.model.embed_tokens if getattr(target, "tied", False) else target.lm_head


def _check_table(what: str, table: VocabEmbedding, rows: int, hidden: int) -> None:
    if table.vocab_size != rows or table.weight.shape[-1] != hidden:
        raise ModelLoadError(f"cannot share the target's {what} ({table.vocab_size} x {table.weight.shape[-1]}) "
                             f"with a draft of vocab {rows}, hidden {hidden}")


class _DraftDecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer, always on its torch path; EAGLE's layer 0 has no input norm
    (SafeAILab's ``cnets.py``: the fc output enters attention as is)."""

    def __init__(self, config, layer_id: int, ctx: ModelContext, rotary: RotaryEmbedding) -> None:
        super().__init__(config, layer_id, ctx, rotary)
        if layer_id == 0:
            self.input_layernorm = nn.Identity()

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.self_attn(self.input_layernorm(x), batch, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


class _EagleModel(nn.Module):
    def __init__(self, config, ctx: ModelContext) -> None:
        super().__init__()
        h = config.hidden_size
        self.embed_tokens = VocabEmbedding(config.vocab_size, h, ctx.dtype)
        self.fc = nn.Linear(2 * h, h, bias=True, dtype=ctx.dtype)  # SGLang: nn.Linear(2H, H), bias on
        rotary = _rotary(config)
        self.layers = nn.ModuleList(_DraftDecoderLayer(config, i, ctx, rotary) for i in range(config.num_hidden_layers))


class LlamaForCausalLMEagle(nn.Module):
    """EAGLE / EAGLE-2 draft: ``fc(cat(embed(ids), features))`` through Llama decoder layers;
    the output is the last layer's output (residual included) with no final norm, both for the
    logits and for the next step. Embedding and LM head are always the target's (SGLang's
    worker replaces both with ``set_embed_and_head``; a checkpoint's ``lm_head`` is never read)."""

    def __init__(self, config, ctx: ModelContext) -> None:
        super().__init__()
        self.config = config
        self.model = _EagleModel(config, ctx)
        self.lm_head: VocabEmbedding | None = None  # the target's, from share_target
        self.feature_size: int = config.hidden_size
        self.missing: set[str] = set()
        self._shared = False

    def capture_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """None: EAGLE reads the target's final (post-norm) hidden states."""
        return ()

    def forward(self, batch: ForwardBatch, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._shared and "model.embed_tokens.weight" in self.missing:
            raise RuntimeError("the draft checkpoint has no embed_tokens: call share_target(target) first")
        if features.shape[-1] != self.feature_size:
            raise ValueError(f"EAGLE features are {features.shape[-1]} wide, expected {self.feature_size}")
        x = self.model.fc(torch.cat([self.model.embed_tokens(batch.input_ids), features.to(self.model.fc.weight.dtype)], -1))
        for layer in self.model.layers:
            x = layer(x, batch)
        return x, x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            raise RuntimeError("an EAGLE draft uses the target's LM head: call share_target(target) first")
        return self.lm_head.logits(hidden).float()

    def share_target(self, target: nn.Module) -> None:
        h = self.config.hidden_size
        _check_table("embedding", target.model.embed_tokens, self.config.vocab_size, h)
        head = _target_head(target)
        _check_table("LM head", head, self.config.vocab_size, h)
        self.model.embed_tokens = target.model.embed_tokens
        self.lm_head = head
        self._shared = True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def rename(name: str) -> str | None:
            # SGLang prefixes "model." to every name without "lm_head" and drops lm_head; a name
            # that already has the prefix is taken as is.
            if "lm_head" in name or "rotary_emb.inv_freq" in name:
                return None
            name = name if name.startswith("model.") else "model." + name
            return None if name == "model.layers.0.input_layernorm.weight" else name  # layer 0 has none

        self.missing = _load(self, weights, rename, {"model.embed_tokens.weight", "model.fc.bias"})
        if "model.fc.bias" in self.missing:
            self.model.fc.bias.data.zero_()


class _Eagle3MidLayer(LlamaDecoderLayer):
    """EAGLE-3's decoder layer: attention over ``cat(input_layernorm(embeds), hidden_norm(hidden))``
    (a 2H-wide qkv input, no qkv bias), residual ``hidden``."""

    def __init__(self, config, ctx: ModelContext, rotary: RotaryEmbedding) -> None:
        super().__init__(config, 0, ctx, rotary)
        h = config.hidden_size
        attn = self.self_attn
        attn.qkv_proj = QKVParallelLinear(2 * h, head_dim_of(config), config.num_attention_heads,
                                          config.num_key_value_heads, False, ctx.quant_method, ctx.dtype)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:  # type: ignore[override]
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        x = self.self_attn(x, batch, residual=hidden)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


class _Eagle3Model(nn.Module):
    def __init__(self, config, ctx: ModelContext, target_hidden: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.embed_tokens = VocabEmbedding(config.vocab_size, h, ctx.dtype)
        self.fc = nn.Linear(3 * target_hidden, h, bias=bool(getattr(config, "bias", False)), dtype=ctx.dtype)
        self.midlayer = _Eagle3MidLayer(config, ctx, _rotary(config))
        self.norm = RMSNorm(h, config.rms_norm_eps)


class LlamaForCausalLMEagle3(nn.Module):
    """EAGLE-3 draft: features are ``fc``-projected when not H wide (the first step's three
    concatenated target layers), then one mid layer; ``norm`` of its output feeds the logits and
    the pre-norm output feeds the next step. The LM head may cover a reduced draft vocabulary,
    mapped to target ids by ``d2t`` (``target = draft + d2t[draft]``)."""

    def __init__(self, config, ctx: ModelContext) -> None:
        super().__init__()
        if config.num_hidden_layers != 1:
            raise ModelLoadError(f"an EAGLE-3 draft has one decoder layer; this config has {config.num_hidden_layers}")
        self.config = config
        self.target_hidden: int = getattr(config, "target_hidden_size", None) or config.hidden_size
        self.model = _Eagle3Model(config, ctx, self.target_hidden)
        self.feature_size: int = 3 * self.target_hidden
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        draft_vocab = getattr(config, "draft_vocab_size", None)
        if self.tied and draft_vocab not in (None, config.vocab_size):
            raise ModelLoadError(f"a tied EAGLE-3 head covers the whole vocabulary ({config.vocab_size}), "
                                 f"not draft_vocab_size {draft_vocab}")
        # SGLang: an untied draft without draft_vocab_size takes the target's head
        self.head_from_target = not self.tied and draft_vocab is None
        self.draft_vocab: int = draft_vocab or config.vocab_size
        self.lm_head = None if self.tied else VocabEmbedding(self.draft_vocab, config.hidden_size, ctx.dtype)
        # target id of each draft id (None: the same); d2t replaces it (identity until then: dummy weights)
        hot = torch.arange(self.draft_vocab) if self.draft_vocab != config.vocab_size else None
        self.register_buffer("hot_token_ids", hot, persistent=False)
        self.missing: set[str] = set()
        self._shared = False

    def capture_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """SGLang's ``set_eagle3_layers_to_capture``: the inputs of layers ``id + 1`` for the
        config's ``eagle_config.eagle_aux_hidden_state_layer_ids``, else ``[2, L // 2, L - 3]``;
        its target captures each listed layer once, in layer order."""
        eagle = getattr(self.config, "eagle_config", None) or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else getattr(
            eagle, "eagle_aux_hidden_state_layer_ids", None)
        n = num_target_layers
        layers = tuple(sorted({i + 1 for i in ids} if ids is not None else {2, n // 2, n - 3}))
        if len(layers) != 3 or layers[0] < 0 or layers[-1] > n:
            raise ModelLoadError(f"EAGLE-3 needs 3 distinct target layers to capture, of 0..{n}; got {list(layers)}")
        return layers

    def forward(self, batch: ForwardBatch, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._shared and "model.embed_tokens.weight" in self.missing:
            raise RuntimeError("the draft checkpoint has no embed_tokens: call share_target(target) first")
        m = self.model
        embeds = m.embed_tokens(batch.input_ids)
        hidden = features.to(embeds.dtype)
        if hidden.shape[-1] != embeds.shape[-1]:  # SGLang's test: the first step's target layers
            if hidden.shape[-1] != self.feature_size:
                raise ValueError(f"EAGLE-3 features are {hidden.shape[-1]} wide, expected {embeds.shape[-1]} "
                                 f"or {self.feature_size}")
            hidden = m.fc(hidden)
        out = m.midlayer(embeds, hidden, batch)
        return m.norm(out), out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self._shared and "lm_head.weight" in self.missing:
            raise RuntimeError("this EAGLE-3 draft uses the target's LM head: call share_target(target) first")
        head = self.model.embed_tokens if self.tied else self.lm_head
        logits = head.logits(hidden).float()
        if self.hot_token_ids is None:
            return logits
        out = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        return out.index_copy_(1, self.hot_token_ids, logits)

    def share_target(self, target: nn.Module) -> None:
        """SGLang's worker: ``set_embed`` always (skipped when ``target_hidden_size`` differs
        from the draft's hidden size), ``set_embed_and_head`` for an untied draft without
        ``draft_vocab_size``."""
        h = self.config.hidden_size
        if self.target_hidden == h:
            _check_table("embedding", target.model.embed_tokens, self.config.vocab_size, h)
            self.model.embed_tokens = target.model.embed_tokens
        elif "model.embed_tokens.weight" in self.missing:
            raise ModelLoadError("the EAGLE-3 draft has no embed_tokens and cannot share the target's "
                                 f"(target_hidden_size {self.target_hidden} != hidden_size {h})")
        if self.head_from_target:
            head = _target_head(target)
            _check_table("LM head", head, self.config.vocab_size, h)
            self.lm_head = head
        self._shared = True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        d2t: list[torch.Tensor] = []

        def maps_apart(pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in pairs:  # SGLang: d2t kept aside, t2d dropped
                if "d2t" in name:
                    d2t.append(tensor)
                elif "t2d" not in name:
                    yield name, tensor

        def rename(name: str) -> str | None:
            # SGLang: names with or without the "model." prefix; a tied head is the embedding
            if "rotary_emb.inv_freq" in name or (self.tied and name == "lm_head.weight"):
                return None
            return name if name == "lm_head.weight" or name.startswith("model.") else "model." + name

        optional = {"model.embed_tokens.weight"} | ({"lm_head.weight"} if self.head_from_target else set())
        self.missing = _load(self, maps_apart(weights), rename, optional)
        if "model.embed_tokens.weight" in self.missing and self.target_hidden != self.config.hidden_size:
            raise ModelLoadError("the EAGLE-3 draft has no embed_tokens and cannot share the target's "
                                 f"(target_hidden_size {self.target_hidden} != hidden_size {self.config.hidden_size})")
        self._set_hot_ids(d2t[0] if d2t else None)

    def _set_hot_ids(self, d2t: torch.Tensor | None) -> None:
        vocab = self.config.vocab_size
        if d2t is None:
            if self.draft_vocab != vocab:
                raise ModelLoadError(f"the EAGLE-3 draft vocabulary ({self.draft_vocab}) is smaller than the target's "
                                     f"({vocab}) but the checkpoint has no d2t map")
            return
        if tuple(d2t.shape) != (self.draft_vocab,):
            raise ModelLoadError(f"d2t has shape {tuple(d2t.shape)}, expected ({self.draft_vocab},)")
        ids = d2t.long() + torch.arange(self.draft_vocab)
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ModelLoadError(f"d2t maps draft ids outside the target vocabulary ({vocab})")
        self.hot_token_ids = ids.to(self.model.norm.weight.device)


@hookimpl
def register_models(register) -> None:
    register("LlamaForCausalLMEagle", LlamaForCausalLMEagle)
    register("LlamaForCausalLMEagle3", LlamaForCausalLMEagle3)
