"""Qwen2.5-VL: Qwen2-VL's language model (M-RoPE, ``mrope_positions``, the image splice; for
images the positions are Qwen2-VL's, ``second_per_grid_ts`` only spaces video frames) with a new
vision tower: RMSNorm, a SwiGLU MLP, attention within windows of ``window_size`` pixels except in
the ``fullatt_block_indexes`` blocks (within the whole image), and a merger to ``out_hidden_size``.

Windows are squares of ``window_size / patch_size / spatial_merge_size`` merged tokens. The tower
reorders its patches window by window (merge blocks kept together) after the patch embedding, so
each window's patches are contiguous, and puts the merged tokens back in the processor's order
after the merger. The checkpoint keys are Qwen2-VL's (``visual.*``, ``model.*``, ``lm_head.*``, or
transformers' nested ``model.visual.*`` / ``model.language_model.*``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
import torch.nn.functional as F

from core import hookimpl
from core.layers import RMSNorm
from core_plugins.models.qwen2_vl import Qwen2VLForConditionalGeneration, VisionBlock, VisionTower


class Qwen2_5_VisionBlock(VisionBlock):
    """Pre-norm block: RMSNorm, attention within each of ``seqlens``' spans (Qwen2-VL's), RMSNorm,
    SwiGLU MLP with biases (``gate_proj`` / ``up_proj`` / ``down_proj``)."""

    def __init__(self, dim: int, heads: int, intermediate: int, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.heads = heads
        self.norm1 = RMSNorm(dim, 1e-6).to(dtype)
        self.norm2 = RMSNorm(dim, 1e-6).to(dtype)
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(dim, 3 * dim, dtype=dtype)
        self.attn.proj = nn.Linear(dim, dim, dtype=dtype)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(dim, intermediate, dtype=dtype)
        self.mlp.up_proj = nn.Linear(dim, intermediate, dtype=dtype)
        self.mlp.down_proj = nn.Linear(intermediate, dim, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
        x = x + self.attn.proj(self._attend(self.norm1(x), cos, sin, seqlens))
        h = self.norm2(x)
        return x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


class Qwen2_5_VisionTower(VisionTower):
    """Patches ``[N, C * T * P * P]`` (merge blocks contiguous) of images with grids ``[n, 3]`` ->
    ``[N / merge**2, out_hidden_size]``, in the processor's order."""

    name, act = "Qwen2.5-VL", "silu"

    def __init__(self, vc: Any, dtype: torch.dtype) -> None:
        super().__init__(vc, dtype)
        m = self.spatial_merge_size
        self.window = vc.window_size // m // vc.patch_size  # a window's side, in merged tokens
        if self.window < 1:
            raise ValueError(f"window_size {vc.window_size} is smaller than one merged token "
                             f"({m} x {vc.patch_size} pixels)")
        self.full_attention = frozenset(vc.fullatt_block_indexes)

    @staticmethod
    def width(vc: Any) -> int:
        return vc.hidden_size

    @staticmethod
    def out_width(vc: Any) -> int:
        return vc.out_hidden_size

    @staticmethod
    def block(vc: Any, dim: int, dtype: torch.dtype) -> nn.Module:
        return Qwen2_5_VisionBlock(dim, vc.num_heads, vc.intermediate_size, dtype)

    @staticmethod
    def merger_norm(dim: int, dtype: torch.dtype) -> nn.Module:
        return RMSNorm(dim, 1e-6).to(dtype)

    def windows(self, grids: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
        """(``[N / merge**2]`` the merged tokens in window order: frame by frame, windows row-major,
        row-major within a window; each window's length in patches). Edge windows are smaller."""
        m, s = self.spatial_merge_size, self.window
        order: list[torch.Tensor] = []
        lengths: list[int] = []
        first = 0
        for t, h, w in grids:
            gh, gw = h // m, w // m
            index = torch.arange(first, first + t * gh * gw).view(t, gh, gw)
            for frame in index:
                for r in range(0, gh, s):
                    for c in range(0, gw, s):
                        block = frame[r:r + s, c:c + s].flatten()
                        order.append(block)
                        lengths.append(block.numel() * m * m)
            first += t * gh * gw
        return torch.cat(order).to(self.inv_freq.device), lengths

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grids = grid_thw.tolist()
        proj, unit = self.patch_embed.proj, self.spatial_merge_size ** 2
        x = pixel_values.to(proj.weight.device, proj.weight.dtype)
        x = proj(x.view(-1, self.in_channels, self.temporal_patch_size, self.patch_size, self.patch_size))
        n = x.shape[0]
        order, window_lens = self.windows(grids)

        def by_window(y: torch.Tensor) -> torch.Tensor:  # patches in window order, merge blocks together
            return y.reshape(n // unit, unit, -1)[order].reshape(n, *y.shape[1:])

        x = by_window(x.view(n, -1))
        freqs = (self.positions(grids)[..., None].float() * self.inv_freq).flatten(1)  # [N, d/2]: rows', columns'
        emb = by_window(torch.cat((freqs, freqs), dim=-1))[:, None]  # [N, 1, d]
        cos, sin = emb.cos(), emb.sin()
        # full attention within each frame of each image: the window order keeps frames contiguous
        frame_lens = [h * w for t, h, w in grids for _ in range(t)]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frame_lens if i in self.full_attention else window_lens)
        mg = self.merger
        out = mg.mlp(mg.ln_q(x).view(-1, mg.mlp[0].in_features))
        return out[torch.argsort(order)]


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2-VL's model API (``encode_images``, ``mrope_positions``, ``image_token_id``, the
    forward's image splice and M-RoPE) with Qwen2.5-VL's vision tower."""

    vision_cls = Qwen2_5_VisionTower


@hookimpl
def register_models(register) -> None:
    register("Qwen2_5_VLForConditionalGeneration", Qwen2_5_VLForConditionalGeneration)
