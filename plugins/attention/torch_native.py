"""Torch-native attention over the paged KV cache: the reference backend.

Every forward, the sequences' cached keys are gathered into a padded
``[B, max_len]`` block and attended with one ``scaled_dot_product_attention`` call
per layer under a boolean mask (causal within each sequence, padding masked out; for a
speculative verify of draft trees, ``ForwardBatch.tree_mask`` says which new tokens each new
token sees, besides the whole cached prefix).
It runs wherever torch runs, CPU included, and faster backends are tested against it.
An fp8 pool (``--kv-cache-dtype fp8_e4m3``) is written scaled and saturated, and
dequantized to the model dtype as it is gathered.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from core import hookimpl
from core.interfaces import AttentionConfig, AttentionLayerSpec, ForwardBatch


@attrs.define
class _Metadata:
    q_index: torch.Tensor | None  # [B*Qmax] index into the flat token axis (None for pure decode)
    out_index: torch.Tensor | None  # [T] rows of the padded [B*Qmax] output that are real tokens
    q_pos: torch.Tensor  # [B, Qmax] position of each (padded) query within its sequence
    key_ok: torch.Tensor  # [B, 1, Qmax, Kmax] bool: causal & in-range
    windowed: dict[int, torch.Tensor] = attrs.field(factory=dict)  # window -> mask


class TorchNativeBackend:
    supports_tree_mask = True  # plugin API 1.4: ForwardBatch.tree_mask is honoured

    def __init__(self, config: AttentionConfig) -> None:
        self.config = config
        self.kv = config.kv_cache

    def prepare(self, batch: ForwardBatch) -> None:
        dev = batch.input_ids.device
        ext, seq = batch.extend_lens, batch.seq_lens
        qmax, kmax = max(batch.extend_lens_cpu), batch.kv_indices.shape[1]
        i = torch.arange(qmax, device=dev)
        q_valid = i[None, :] < ext[:, None]
        q_pos = (seq - ext)[:, None] + i[None, :]  # absolute position of query i
        j = torch.arange(kmax, device=dev)
        if batch.tree_mask is None:
            key_ok = (j[None, None, :] <= q_pos[:, :, None]) & (j[None, None, :] < seq[:, None, None])
        else:
            key_ok = _tree_key_ok(batch, q_valid, j)
        # padded query rows attend to slot 0 only, so their softmax stays finite; they are dropped.
        key_ok = key_ok | (~q_valid[:, :, None] & (j == 0)[None, None, :])
        q_index = out_index = None
        if not batch.is_decode:
            starts = torch.cumsum(ext, 0) - ext
            q_index = torch.where(q_valid, starts[:, None] + i[None, :], 0).view(-1)
            out_index = q_valid.view(-1).nonzero().squeeze(1)
        batch.attn_metadata = _Metadata(q_index, out_index, q_pos, key_ok.unsqueeze(1))

    def _mask(self, md: _Metadata, window: int | None) -> torch.Tensor:
        if not window:
            return md.key_ok
        if window not in md.windowed:
            kmax = md.key_ok.shape[-1]
            j = torch.arange(kmax, device=md.key_ok.device)
            recent = (j[None, None, :] > md.q_pos[:, :, None] - window).unsqueeze(1)
            m = md.key_ok & recent
            md.windowed[window] = m | (~m.any(-1, keepdim=True) & (j == 0))  # keep padded rows finite
        return md.windowed[window]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        kc, vc = self.kv.k[layer.layer_id], self.kv.v[layer.layer_id]
        _store(kc, batch.out_cache_loc, k, self.kv.k_scale)
        _store(vc, batch.out_cache_loc, v, self.kv.v_scale)
        md: _Metadata = batch.attn_metadata
        b, kmax = batch.kv_indices.shape
        h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        # index_select is several times faster than advanced indexing for these row gathers on CPU
        if md.q_index is None:
            qp = q.view(b, 1, h, d)
        else:
            qp = q.index_select(0, md.q_index).view(b, -1, h, d)  # [B, Qmax, H, D]
        flat = batch.kv_indices.view(-1)
        keys = _gather(kc, flat, q.dtype, self.kv.k_scale).view(b, kmax, hkv, d)  # [B, Kmax, Hkv, D]
        vals = _gather(vc, flat, q.dtype, self.kv.v_scale).view(b, kmax, hkv, d)
        mask = self._mask(md, layer.sliding_window)
        if md.q_index is None:
            return _decode_attention(q.view(b, hkv, h // hkv, d), keys, vals, mask, layer).reshape(b, h, d)
        keys, vals = keys.transpose(1, 2), vals.transpose(1, 2)  # [B, Hkv, Kmax, D]
        qp = qp.transpose(1, 2)  # [B, H, Qmax, D]
        if layer.logit_cap > 0:
            out = _capped_attention(qp, keys, vals, mask, layer)
        else:
            out = F.scaled_dot_product_attention(
                qp, keys, vals, attn_mask=mask, scale=layer.scaling, enable_gqa=layer.num_heads != layer.num_kv_heads
            )
        out = out.transpose(1, 2)  # [B, Qmax, H, D]
        if md.out_index is None:
            return out.reshape(b, h, d)
        return out.reshape(-1, h, d).index_select(0, md.out_index)


def _tree_key_ok(batch: ForwardBatch, q_valid: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """``[B, Qmax, Kmax]``: query i of sequence b (``n`` new tokens after ``P`` cached ones) sees
    every cached key (columns ``< P``) and new key ``c`` (column ``P + c``) where its tree-mask
    row says so; never a column derived from ``positions`` (tree depths)."""
    ext, seq, ns = batch.extend_lens, batch.seq_lens, batch.extend_lens_cpu
    tree = batch.tree_mask.reshape(-1).to(device=j.device, dtype=torch.bool)
    if tree.numel() != sum(n * n for n in ns):
        raise ValueError(f"tree_mask has {tree.numel()} entries; extend lengths {ns} need {sum(n * n for n in ns)}")
    qmax, dev = q_valid.shape[1], j.device
    i = torch.arange(qmax, device=dev)
    sq = ext * ext
    off = torch.cumsum(sq, 0) - sq  # where each sequence's n x n block starts
    prefix = seq - ext
    col = j[None, :] - prefix[:, None]  # [B, Kmax] index among the new tokens
    is_new = (col >= 0) & (col < ext[:, None])
    idx = off[:, None, None] + i[None, :, None] * ext[:, None, None] + col[:, None, :]  # [B, Qmax, Kmax]
    ok_new = is_new[:, None, :] & q_valid[:, :, None]
    bits = tree[torch.where(ok_new, idx, 0)] & ok_new
    return (j[None, None, :] < prefix[:, None, None]) | bits


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _store(pool: torch.Tensor, loc: torch.Tensor, x: torch.Tensor, scale: float) -> None:
    """Write rows ``x`` at slots ``loc``; an fp8 pool stores ``x / scale`` saturated to its range
    (through uint8 views: CPU torch has no fp8 ``index_copy_``)."""
    if pool.dtype not in FP8_DTYPES:
        pool.index_copy_(0, loc, x.to(pool.dtype))
        return
    top = torch.finfo(pool.dtype).max
    x8 = (x.float() / scale if scale != 1.0 else x).clamp(-top, top).to(pool.dtype)
    pool.view(torch.uint8).index_copy_(0, loc, x8.view(torch.uint8))


def _gather(pool: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Rows ``idx`` of the pool in ``dtype`` (an fp8 pool dequantized: ``stored * scale``)."""
    if pool.dtype not in FP8_DTYPES:
        return pool.index_select(0, idx).to(dtype)
    out = pool.view(torch.uint8).index_select(0, idx).view(pool.dtype).to(dtype)
    return out * scale if scale != 1.0 else out


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      layer: AttentionLayerSpec) -> torch.Tensor:
    """One query per sequence as batched matmuls, one pair per KV head, the query heads of that KV
    head side by side (``q`` ``[B, Hkv, group, D]``, ``k``/``v`` ``[B, Kmax, Hkv, D]`` as gathered, so
    no transposed copy is made). On CPU this is ~25x faster in bf16 than a masked
    ``scaled_dot_product_attention``, whose flash kernel is built for long query blocks."""
    b, kmax = k.shape[0], k.shape[1]
    masked = ~mask.view(b, 1, kmax)
    out = []
    for h in range(k.shape[2]):
        scores = torch.bmm(q[:, h], k[:, :, h].transpose(1, 2)).float() * layer.scaling  # [B, group, Kmax]
        if layer.logit_cap > 0:
            scores = layer.logit_cap * torch.tanh(scores / layer.logit_cap)
        scores = scores.masked_fill(masked, float("-inf"))
        out.append(torch.bmm(scores.softmax(-1).to(v.dtype), v[:, :, h]))  # [B, group, D]
    return torch.stack(out, 1)  # [B, Hkv, group, D]


def _capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, layer: AttentionLayerSpec) -> torch.Tensor:
    """Explicit softmax(cap * tanh(qk/cap)) attention: SDPA has no soft-capping."""
    group = layer.num_heads // layer.num_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * layer.scaling
    scores = layer.logit_cap * torch.tanh(scores / layer.logit_cap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)


@hookimpl
def register_attention_backends(register) -> None:
    register("torch_native", TorchNativeBackend)
