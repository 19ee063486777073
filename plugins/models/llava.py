"""LLaVA (1.5-style): a CLIP vision tower (patch embedding, a class token, learned positions,
pre-norm transformer blocks with quick-GELU MLPs), the features of one of its layers
(``vision_feature_layer``, -2 by default; the class token dropped for the "default"
``vision_feature_select_strategy``, kept for "full"), a projector (linear, activation, linear)
into the language model's embedding space, and a Llama language model whose image-token rows
take the projected features.

What the engine calls (``core.engine.multimodal``): ``encode_images(pixel_values)`` once per
request (images of the tower's one fixed size, so no grids) and ``forward`` with
``ForwardBatch.mm_rows`` / ``mm_embeds``. LLaVA's positions are plain 1-D rotary: no
``mrope_positions``. A forward with image rows splices them in after the token lookup and runs
the layers on the result (the CPU one-op layers too: they take the spliced rows); a CPU
``decode_step`` (which looks the tokens up itself) serves only batches without image rows.

Checkpoint keys: what transformers saves (``vision_tower.*``, ``multi_modal_projector.*``,
``language_model.model.*``, ``language_model.lm_head.*``), its in-memory names
(``model.vision_tower.*``, ``model.multi_modal_projector.*``, ``model.language_model.*``,
``lm_head.*``), and the original LLaVA-HF layout with ``vision_tower.vision_model.*``. The tower's
layers past the feature layer and its ``post_layernorm`` are never used, so never built or loaded.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from core import hookimpl
from core.interfaces import ForwardBatch, ModelContext
from core.layers import VocabEmbedding, load_packed_weights
from core_plugins.models.llama import LlamaForCausalLM, LlamaModel

ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


def _activation(name: str, what: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported {what} {name!r}; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


# --------------------------------------------------------------------------- vision tower


class CLIPAttention(nn.Module):
    """Full (non-causal) multi-head attention within each image, with biased projections. The
    checkpoint's ``q_proj`` / ``k_proj`` / ``v_proj`` load into ``q`` / ``k`` / ``v`` (the language
    model's loader packs every ``q_proj`` it sees into a ``qkv_proj``)."""

    def __init__(self, dim: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim, dtype=dtype)
        self.k = nn.Linear(dim, dim, dtype=dtype)
        self.v = nn.Linear(dim, dim, dtype=dtype)
        self.out_proj = nn.Linear(dim, dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape  # [images, tokens, dim]
        q, k, v = (p(x).view(n, t, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v)  # scale head_dim ** -0.5, as CLIP's
        return self.out_proj(out.transpose(1, 2).reshape(n, t, d))


class CLIPEncoderLayer(nn.Module):
    """Pre-norm block: LayerNorm, attention, LayerNorm, MLP (fc1, activation, fc2); submodules
    named as the checkpoint's keys (plain ``nn`` layers, never quantized)."""

    def __init__(self, vc: Any, dtype: torch.dtype) -> None:
        super().__init__()
        dim, eps = vc.hidden_size, vc.layer_norm_eps
        self.self_attn = CLIPAttention(dim, vc.num_attention_heads, dtype)
        self.layer_norm1 = nn.LayerNorm(dim, eps=eps, dtype=dtype)
        self.layer_norm2 = nn.LayerNorm(dim, eps=eps, dtype=dtype)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(dim, vc.intermediate_size, dtype=dtype)
        self.mlp.fc2 = nn.Linear(vc.intermediate_size, dim, dtype=dtype)
        self.act = _activation(vc.hidden_act, "vision hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp.fc2(self.act(self.mlp.fc1(self.layer_norm2(x))))


class CLIPVisionTower(nn.Module):
    """``[N, C, H, W]`` images (``H = W = image_size``) -> the hidden states after each of the
    first ``depth`` layers (index 0: the embeddings after ``pre_layrnorm``), ``[N, 1 + patches, dim]``."""

    def __init__(self, vc: Any, depth: int, dtype: torch.dtype) -> None:
        super().__init__()
        dim, p = vc.hidden_size, vc.patch_size
        self.image_size, self.patch_size = vc.image_size, p
        self.num_patches = (vc.image_size // p) ** 2
        self.embeddings = nn.Module()
        self.embeddings.class_embedding = nn.Parameter(torch.zeros(dim, dtype=dtype))
        self.embeddings.patch_embedding = nn.Conv2d(vc.num_channels, dim, p, stride=p, bias=False, dtype=dtype)
        self.embeddings.position_embedding = nn.Embedding(self.num_patches + 1, dim, dtype=dtype)
        self.pre_layrnorm = nn.LayerNorm(dim, eps=vc.layer_norm_eps, dtype=dtype)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(CLIPEncoderLayer(vc, dtype) for _ in range(depth))

    def forward(self, pixel_values: torch.Tensor, keep: set[int]) -> dict[int, torch.Tensor]:
        """The hidden states at the indices ``keep`` (0..depth)."""
        e = self.embeddings
        if tuple(pixel_values.shape[-2:]) != (self.image_size, self.image_size):
            raise ValueError(f"images of {tuple(pixel_values.shape[-2:])} pixels; the vision tower takes "
                             f"{self.image_size}x{self.image_size} (the processor resizes and crops to it)")
        x = e.patch_embedding(pixel_values.to(e.patch_embedding.weight.device, e.patch_embedding.weight.dtype))
        x = x.flatten(2).transpose(1, 2)  # [N, patches, dim], row-major patches
        cls = e.class_embedding.expand(x.shape[0], 1, -1)
        x = self.pre_layrnorm(torch.cat([cls, x], dim=1) + e.position_embedding.weight)
        out = {0: x} if 0 in keep else {}
        for i, layer in enumerate(self.encoder.layers, start=1):
            x = layer(x)
            if i in keep:
                out[i] = x
        return out


class MultiModalProjector(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, act: str, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, out_dim, bias=bias, dtype=dtype)
        self.linear_2 = nn.Linear(out_dim, out_dim, bias=bias, dtype=dtype)
        self.act = _activation(act, "projector_hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


# --------------------------------------------------------------------------- language model


class LlavaTextModel(LlamaModel):
    """Llama's stack with the image rows' embeddings replaced. A batch without image rows is
    Llama's forward (the CPU decode stack included); one with them runs the layers on the spliced
    embeddings (as one-op layers where the CPU has them)."""

    def forward(self, batch: ForwardBatch, head: VocabEmbedding | None = None) -> torch.Tensor:
        if batch.mm_rows is None:
            return super().forward(batch, head)
        self.__dict__.pop("_step_logits", None)
        x = self.embed_tokens(batch.input_ids)
        x = x.index_copy(0, batch.mm_rows.to(x.device), batch.mm_embeds.to(x.device, x.dtype))
        fused = x.device.type == "cpu" and batch.tree_mask is None and not batch.lora
        return self.norm(self._layers(x, batch, fused, self.capture_layers))


def _feature_layers(config: Any) -> list[int]:
    """``vision_feature_layer`` (an int or a list) as hidden-state indices 0..num_hidden_layers."""
    n = config.vision_config.num_hidden_layers
    layers = config.vision_feature_layer
    layers = [layers] if isinstance(layers, int) else list(layers)
    out = [i % (n + 1) for i in layers]
    if any(not -(n + 1) <= i <= n for i in layers):
        raise ValueError(f"vision_feature_layer {config.vision_feature_layer} out of range for a tower of {n} layers")
    return out


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """``forward`` / ``compute_logits`` / ``load_weights`` as every model, plus ``encode_images``,
    ``image_token_id`` and ``tokens_per_image``. ``config`` is the language model's config;
    ``vision_config`` the tower's."""

    def __init__(self, config: Any, ctx: ModelContext) -> None:
        nn.Module.__init__(self)
        text, vc = config.get_text_config(), config.vision_config
        self.config, self.vision_config = text, vc
        token = getattr(config, "image_token_id", None)
        self.image_token_id = int(token if token is not None else config.image_token_index)
        self.strategy = getattr(config, "vision_feature_select_strategy", "default")
        if self.strategy not in ("default", "full"):
            raise ValueError(f"unsupported vision_feature_select_strategy {self.strategy!r}; supported: default, full")
        self.feature_layers = _feature_layers(config)
        self.tokens_per_image = (vc.image_size // vc.patch_size) ** 2 + (self.strategy == "full")
        self.model = LlavaTextModel(text, ctx, self.layer_cls, **self.attn_options)
        self.vision_tower = CLIPVisionTower(vc, max(self.feature_layers), ctx.dtype)
        self.multi_modal_projector = MultiModalProjector(
            vc.hidden_size * len(self.feature_layers), text.hidden_size, getattr(config, "projector_hidden_act", "gelu"),
            bool(getattr(config, "multimodal_projector_bias", True)), ctx.dtype)
        self.tied = bool(getattr(text, "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = VocabEmbedding(text.vocab_size, text.hidden_size, ctx.dtype)

    def decode_step(self, inputs: Any, attn_backend: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Llama's CPU decode step, except for a batch with image rows (the step looks its
        tokens up itself, so it would miss the image embeddings): None there."""
        if getattr(inputs, "mm_rows", None) is not None:
            return None
        return super().decode_step(inputs, attn_backend)

    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        """``[N * tokens_per_image, hidden]``: every image's projected features, in image order
        (``image_grid_thw`` is unused: the tower takes images of one size)."""
        states = self.vision_tower(pixel_values, set(self.feature_layers))
        feats = [states[i][:, 1:] if self.strategy == "default" else states[i] for i in self.feature_layers]
        out = self.multi_modal_projector(torch.cat(feats, dim=-1))
        return out.reshape(-1, out.shape[-1]).to(self.model.embed_tokens.weight.dtype)

    def skip_weight(self, name: str) -> bool:
        if "rotary_emb.inv_freq" in name or (self.tied and name == "lm_head.weight"):
            return True
        if name.startswith("vision_tower.post_layernorm."):
            return True
        if name.startswith("vision_tower.encoder.layers."):  # layers past the feature layer: never run
            return int(name.split(".")[3]) >= len(self.vision_tower.encoder.layers)
        return False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], partial: bool = False) -> None:
        load_packed_weights(self, ((_our_name(n), t) for n, t in weights), self.packed_modules, self.skip_weight,
                            partial=partial)


_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


def _our_name(name: str) -> str:
    """A checkpoint key in this model's names (see the module docstring for the layouts)."""
    for prefix, ours in _PREFIXES:
        if name.startswith(prefix):
            name = ours + name[len(prefix):]
            break
    if name.startswith("vision_tower.vision_model."):
        name = "vision_tower." + name[len("vision_tower.vision_model."):]
    if name.startswith("vision_tower."):
        for proj in ("q", "k", "v"):
            name = name.replace(f".self_attn.{proj}_proj.", f".self_attn.{proj}.")
    return name


@hookimpl
def register_models(register) -> None:
    register("LlavaForConditionalGeneration", LlavaForConditionalGeneration)
