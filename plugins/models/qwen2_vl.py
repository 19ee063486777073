"""Qwen2-VL: a vision tower (Conv3d patch embedding, 2D rotary over patch rows and columns,
full attention within each image, a merger of ``spatial_merge_size**2`` patches per token) and
a Qwen2 language model with M-RoPE: three position rows (temporal, height, width), each
rotating its own section (``mrope_section``) of the head's frequency pairs.

What the engine calls (``core.engine.multimodal``): ``encode_images`` once per request,
``mrope_positions`` for a prompt, and ``forward`` with ``ForwardBatch.mm_rows`` /
``mm_embeds`` (image embeddings spliced into the token embeddings) and ``mrope_positions``.
The checkpoint keys are ``visual.*``, ``model.*`` and ``lm_head.*`` (what transformers saves),
or ``model.visual.*`` / ``model.language_model.*``. The CPU one-op decoder layers know 1-D
rotary only, so this model always runs the Python layers."""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from core import hookimpl
from core.interfaces import ForwardBatch, ModelContext
from core.layers import RMSNorm, RotaryEmbedding, VocabEmbedding, load_packed_weights
from core_plugins.models.llama import (LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel,
                                       head_dim_of)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


# --------------------------------------------------------------------------- vision tower


class VisionBlock(nn.Module):
    """Pre-norm transformer block: LayerNorm, attention within each image, LayerNorm, quick-GELU MLP
    (plain ``nn`` layers, never quantized; submodules named as the checkpoint's keys)."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, eps=1e-6, dtype=dtype)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6, dtype=dtype)
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(dim, 3 * dim, dtype=dtype)
        self.attn.proj = nn.Linear(dim, dim, dtype=dtype)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(dim, int(dim * mlp_ratio), dtype=dtype)
        self.mlp.fc2 = nn.Linear(int(dim * mlp_ratio), dim, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
        x = x + self.attn.proj(self._attend(self.norm1(x), cos, sin, seqlens))
        h = self.mlp.fc1(self.norm2(x))
        return x + self.mlp.fc2(h * torch.sigmoid(1.702 * h))  # quick_gelu (the only act Qwen2-VL's tower has)

    def _attend(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.attn.qkv(x).view(n, 3, self.heads, -1).unbind(1)  # [N, heads, d] each
        q = _rotate(q.float(), cos, sin).to(v.dtype)  # rotary in float32, as the reference
        k = _rotate(k.float(), cos, sin).to(v.dtype)
        out = [F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1)).transpose(0, 1)
               for qi, ki, vi in zip(q.split(seqlens), k.split(seqlens), v.split(seqlens))]
        return torch.cat(out).reshape(n, -1)


class VisionTower(nn.Module):
    """Patches ``[N, C * T * P * P]`` (the processor's ``pixel_values``, merge blocks contiguous)
    of images with grids ``[n, 3]`` (t, h, w in patches) -> ``[N / merge**2, hidden]``."""

    name, act = "Qwen2-VL", "quick_gelu"  # (for messages; the only activation its blocks have)

    def __init__(self, vc: Any, dtype: torch.dtype) -> None:
        super().__init__()
        if getattr(vc, "hidden_act", self.act) != self.act:
            raise ValueError(f"unsupported vision hidden_act {vc.hidden_act!r}; {self.name}'s tower uses {self.act}")
        dim, self.heads = self.width(vc), vc.num_heads
        self.in_channels, self.patch_size, self.temporal_patch_size = vc.in_channels, vc.patch_size, vc.temporal_patch_size
        self.spatial_merge_size = m = vc.spatial_merge_size
        self.patch_embed = nn.Module()
        kernel = (vc.temporal_patch_size, vc.patch_size, vc.patch_size)
        self.patch_embed.proj = nn.Conv3d(vc.in_channels, dim, kernel, stride=kernel, bias=False, dtype=dtype)
        self.blocks = nn.ModuleList(self.block(vc, dim, dtype) for _ in range(vc.depth))
        self.merger = nn.Module()
        self.merger.ln_q = self.merger_norm(dim, dtype)
        merged = dim * m * m
        self.merger.mlp = nn.Sequential(nn.Linear(merged, merged, dtype=dtype), nn.GELU(),
                                        nn.Linear(merged, self.out_width(vc), dtype=dtype))
        # 2D rotary: head_dim / 4 frequencies for the patch's row, the same ones for its column
        theta = (getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        half = dim // self.heads // 2
        inv_freq = 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float) / half)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    # what Qwen2.5-VL's tower changes (its subclass)
    @staticmethod
    def width(vc: Any) -> int:
        return vc.embed_dim

    @staticmethod
    def out_width(vc: Any) -> int:
        return vc.hidden_size

    @staticmethod
    def block(vc: Any, dim: int, dtype: torch.dtype) -> nn.Module:
        return VisionBlock(dim, vc.num_heads, vc.mlp_ratio, dtype)

    @staticmethod
    def merger_norm(dim: int, dtype: torch.dtype) -> nn.Module:
        return nn.LayerNorm(dim, eps=1e-6, dtype=dtype)

    def positions(self, grids: list[list[int]]) -> torch.Tensor:
        """``[N, 2]`` (row, column) of every patch, in the processor's order (merge blocks contiguous)."""
        m, out = self.spatial_merge_size, []
        for t, h, w in grids:
            rows = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
            cols = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
            hw = torch.stack([rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()], dim=-1)
            out.append(hw.repeat(t, 1))
        return torch.cat(out).to(self.inv_freq.device)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grids = grid_thw.tolist()
        proj = self.patch_embed.proj
        x = pixel_values.to(proj.weight.device, proj.weight.dtype)
        x = proj(x.view(-1, self.in_channels, self.temporal_patch_size, self.patch_size, self.patch_size))
        x = x.view(x.shape[0], -1)
        freqs = (self.positions(grids)[..., None].float() * self.inv_freq).flatten(1)  # [N, d/2]: rows', columns'
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [N, 1, d]
        cos, sin = emb.cos(), emb.sin()
        seqlens = [h * w for t, h, w in grids for _ in range(t)]  # attention within each frame of each image
        for block in self.blocks:
            x = block(x, cos, sin, seqlens)
        m = self.merger
        return m.mlp(m.ln_q(x).view(-1, m.mlp[0].in_features))


# --------------------------------------------------------------------------- language model


class MRotaryEmbedding(RotaryEmbedding):
    """Rotary over three position rows: ``positions`` ``[3, T]`` (temporal, height, width), the
    head's frequency pairs split by ``mrope_section`` and section ``i`` rotated by row ``i % 3``;
    ``positions`` ``[T]`` rotates all of them by the one row (plain rotary)."""

    def __init__(self, config: Any, head_dim: int, max_positions: int) -> None:
        super().__init__(config, head_dim, max_positions)
        # (transformers' default where the config has none: Qwen2-VL's sections of a 128-wide head)
        section = list((getattr(config, "rope_parameters", None) or {}).get("mrope_section") or [16, 24, 24])
        if sum(section) != self.rotary_dim // 2:
            raise ValueError(f"mrope_section {section} must sum to half the rotary dim ({self.rotary_dim // 2})")
        rows = torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(section)])
        self.register_buffer("rows", torch.cat((rows, rows)).to(self.cos.device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        idx = positions[self.rows].t()  # [T, D]: the position each column rotates by
        cos = self.cos.gather(0, idx).to(q.dtype).unsqueeze(1)
        sin = self.sin.gather(0, idx).to(q.dtype).unsqueeze(1)
        d = self.rotary_dim
        if d < q.shape[-1]:
            return (torch.cat((_rotate(q[..., :d], cos, sin), q[..., d:]), -1),
                    torch.cat((_rotate(k[..., :d], cos, sin), k[..., d:]), -1))
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


class Qwen2VLAttention(LlamaAttention):
    """Qwen2 attention rotated by ``batch.mrope_positions`` where set, else ``batch.positions``."""

    def forward(self, x: torch.Tensor, batch: ForwardBatch, residual: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        s = self.attn.spec
        q, k = q.view(-1, s.num_heads, s.head_dim), k.view(-1, s.num_kv_heads, s.head_dim)
        positions = batch.mrope_positions if batch.mrope_positions is not None else batch.positions
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, batch), residual)


class Qwen2VLDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: Any, layer_id: int, ctx: ModelContext, rotary: RotaryEmbedding, **attn_options: Any) -> None:
        nn.Module.__init__(self)
        self.self_attn = Qwen2VLAttention(config, layer_id, ctx, rotary, **attn_options)
        self.mlp = self.make_mlp(config, layer_id, ctx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def _cpu_decode(self, backend: Any) -> None:
        return None  # the one-op layer rotates by one position row


class Qwen2VLTextModel(LlamaModel):
    """Llama's stack with one M-RoPE table and image embeddings spliced in; always the Python layers."""

    def __init__(self, config: Any, ctx: ModelContext, layer_cls: type[nn.Module], **attn_options: Any) -> None:
        super().__init__(config, ctx, layer_cls, **attn_options)
        rotary = MRotaryEmbedding(config, head_dim_of(config), config.max_position_embeddings)
        for layer in self.layers:
            layer.self_attn.rotary = rotary

    def forward(self, batch: ForwardBatch, head: VocabEmbedding | None = None) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        if batch.mm_rows is not None:
            x = x.index_copy(0, batch.mm_rows.to(x.device), batch.mm_embeds.to(x.device, x.dtype))
        return self.norm(self._layers(x, batch, False, self.capture_layers))


class Qwen2VLForConditionalGeneration(LlamaForCausalLM):
    """``forward`` / ``compute_logits`` / ``load_weights`` as every model, plus ``encode_images``,
    ``mrope_positions`` and ``image_token_id``. ``config`` is the language model's config (the
    one with ``num_hidden_layers``, ``vocab_size``...); ``vision_config`` the tower's."""

    attn_options = {"qkv_bias": True, "o_bias": False}
    layer_cls = Qwen2VLDecoderLayer
    vision_cls: type[nn.Module] = VisionTower  # (Qwen2.5-VL: its own tower on the same language model)

    def __init__(self, config: Any, ctx: ModelContext) -> None:
        nn.Module.__init__(self)
        text = config.get_text_config()
        self.config, self.vision_config = text, config.vision_config
        self.image_token_id = config.image_token_id
        self.model = Qwen2VLTextModel(text, ctx, self.layer_cls, **self.attn_options)
        self.visual = self.vision_cls(config.vision_config, ctx.dtype)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = VocabEmbedding(text.vocab_size, text.hidden_size, ctx.dtype)

    def _stack_head(self) -> None:
        return None

    def decode_step(self, inputs: Any, attn_backend: Any) -> None:
        return None

    def decode_steps(self, inputs: Any, attn_backend: Any, steps: int, stop_ids: list[int]) -> None:
        return None

    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """``[sum over images of t * h * w / merge**2, hidden]``: every image token's embedding, in image order."""
        return self.visual(pixel_values, image_grid_thw).to(self.model.embed_tokens.weight.dtype)

    def mrope_positions(self, input_ids: list[int], image_grid_thw: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        """(``[3, L]`` int64 M-RoPE positions of one sequence, delta): text tokens count on from the
        last position in all three rows; an image's tokens sit at (start, start + row, start + column)
        of its merged grid, and the text after it starts at ``start + max(h, w) / merge``. A later
        token at sequence position ``p`` takes ``p + delta`` in all three rows."""
        m, tok = self.visual.spatial_merge_size, self.image_token_id
        grids = iter([] if image_grid_thw is None else image_grid_thw.tolist())
        parts: list[torch.Tensor] = []
        pos = i = 0
        n = len(input_ids)
        while i < n:
            if input_ids[i] == tok:
                t, h, w = next(grids, (0, 0, 0))
                count = t * (h // m) * (w // m)
                if count == 0 or input_ids[i:i + count] != [tok] * count:
                    raise ValueError(f"image tokens at {i} do not match the image grids {image_grid_thw}")
                tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h // m), torch.arange(w // m), indexing="ij")
                parts.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
                pos, i = pos + max(h, w) // m, i + count
                continue
            j = i
            while j < n and input_ids[j] != tok:
                j += 1
            parts.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos, i = pos + j - i, j
        positions = torch.cat(parts, 1) if parts else torch.zeros(3, 0, dtype=torch.long)
        return positions, (int(positions.max()) + 1 - n) if n else 0

    def skip_weight(self, name: str) -> bool:
        return "rotary_emb.inv_freq" in name or (self.tied and name == "lm_head.weight")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], partial: bool = False) -> None:
        load_packed_weights(self, ((_our_name(n), t) for n, t in weights), self.packed_modules, self.skip_weight,
                            partial=partial)


def _our_name(name: str) -> str:
    """A checkpoint key in this model's names: transformers' newer nesting (``model.visual.*``,
    ``model.language_model.*``) to the saved layout (``visual.*``, ``model.*``)."""
    for prefix, ours in (("model.visual.", "visual."), ("model.language_model.", "model.")):
        if name.startswith(prefix):
            return ours + name[len(prefix):]
    return name


@hookimpl
def register_models(register) -> None:
    register("Qwen2VLForConditionalGeneration", Qwen2VLForConditionalGeneration)
