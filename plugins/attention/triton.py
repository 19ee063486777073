"""Triton attention over the paged KV cache (``--attention-backend triton``; kernels in ``core_kernels``).

``prepare`` flattens each sequence's slots from the request -> token table into
``kv_indptr`` / ``kv_indices`` with a device kernel (sizes come from the lengths the batch
already holds as Python ints, so nothing is read back from the device). Each layer stores
its new K/V into the pool, then runs the split-KV decode kernel for a pure decode step or the
extend kernel (cached prefix + causal new tokens; for a verify of draft trees, new tokens as
``ForwardBatch.tree_mask`` says) otherwise. Triton itself is imported only
when the backend is built, so importing this plugin costs nothing on machines that never use it.

Decode steps can be captured in CUDA graphs (plugin API 1.1 hooks): the captured kernels read
``kv_indptr`` / ``kv_indices`` from static buffers that ``prepare_replay`` refills before each
replay, and each captured size keeps the KV split count it was captured with. Speculative
verifies too (plugin API 1.9): every sequence ``T`` new tokens under the static tree mask, the
prefix's ``kv_indptr`` / ``kv_indices`` refilled the same way.
"""

from __future__ import annotations

import attrs
import torch

from core import hookimpl
from core.errors import CoreError
from core.interfaces import AttentionConfig, AttentionLayerSpec, ForwardBatch
from core_kernels import interpreting


@attrs.define
class _Metadata:
    kv_indptr: torch.Tensor  # [B + 1] int32: decode, the whole sequence; extend, the cached prefix
    kv_indices: torch.Tensor  # int32 pool slots, back to back
    qo_indptr: torch.Tensor | None  # [B + 1] int32 new-token offsets (None for a pure decode step)
    max_extend_len: int
    num_kv_splits: int
    # a verify of draft trees: (the flat tree mask as uint8, [B] int32 start of each sequence's n x n block)
    tree: tuple[torch.Tensor, torch.Tensor] | None = None


def _require_triton(device: torch.device) -> None:
    """Refuse, naming the way out, where the kernels cannot run."""
    if device.type != "cuda" and not interpreting():
        raise CoreError(
            f"attention backend 'triton' needs a CUDA GPU, but the engine runs on {device}: use "
            "--attention-backend torch_native there (or set TRITON_INTERPRET=1 to run the kernels in "
            "triton's slow interpreter, for testing)"
        )
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise CoreError(f"attention backend 'triton' needs the triton package, which cannot be imported: {e}") from None


class TritonBackend:
    supports_cuda_graph = True  # the decode path captures (read by the conformance kit)
    supports_tree_mask = True  # plugin API 1.4: the extend kernel reads ForwardBatch.tree_mask
    supports_cuda_graph_verify = True  # plugin API 1.9: verifies (T tokens a sequence, a tree mask) capture too

    def __init__(self, config: AttentionConfig) -> None:
        _require_triton(config.device)
        from core_kernels import decode_attention, extend_attention, kv_indices, store_kv

        self._decode, self._extend = decode_attention, extend_attention
        self._store, self._indices = store_kv.store_kv, kv_indices.build_kv_indices
        self.config, self.kv = config, config.kv_cache
        dev = config.device
        self.num_sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4

    def prepare(self, batch: ForwardBatch) -> None:
        table = batch.kv_indices  # the batch's rows of the request -> token table, [B, max(seq_lens)]
        rows = torch.arange(batch.batch_size, device=table.device)
        if batch.is_decode:
            indptr, indices = self._indices(table, rows, batch.seq_lens, sum(batch.seq_lens_cpu))
            c = self.config
            splits = self._decode.num_kv_splits_for(batch.batch_size, c.num_kv_heads, c.num_heads // c.num_kv_heads,
                                                    max(batch.seq_lens_cpu), self.num_sms)
            batch.attn_metadata = _Metadata(indptr, indices, None, 1, splits)
            return
        qo_indptr = torch.zeros(batch.batch_size + 1, dtype=torch.int32, device=table.device)
        qo_indptr[1:] = torch.cumsum(batch.extend_lens, 0)
        prefix_total = sum(batch.seq_lens_cpu) - sum(batch.extend_lens_cpu)
        indptr, indices = self._indices(table, rows, batch.seq_lens - batch.extend_lens, prefix_total)
        tree = None
        if batch.tree_mask is not None:  # a verify of draft trees: the mask, and where each sequence's starts
            sq = batch.extend_lens * batch.extend_lens
            tree = (batch.tree_mask.reshape(-1).to(table.device, torch.uint8),
                    (torch.cumsum(sq, 0) - sq).to(torch.int32))
        batch.attn_metadata = _Metadata(indptr, indices, qo_indptr, max(batch.extend_lens_cpu), 1, tree)

    # ---- CUDA-graph capture hooks (plugin API 1.1)
    def init_cuda_graph(self, max_bs: int, max_len: int) -> None:
        dev = self.config.device
        self._g_max_len = max_len
        self._g_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
        self._g_indices = torch.zeros(max_bs * max_len, dtype=torch.int32, device=dev)  # slot 0 until refilled
        self._g_rows = torch.arange(max_bs, device=dev)
        self._g_splits: dict[int, int] = {}
        self._g_verify: tuple[torch.Tensor, torch.Tensor] | None = None  # (qo_indptr, tree offsets), for T tokens

    def prepare_capture(self, bs: int, batch: ForwardBatch) -> None:
        if not batch.is_decode:  # a verify: T new tokens a sequence, no prefix at capture
            t = batch.extend_lens_cpu[0]
            if self._g_verify is None:  # (the largest size first)
                ar = torch.arange(bs + 1, dtype=torch.int32, device=self.config.device)
                self._g_verify = (ar * t, ar[:bs] * t * t)
            self._g_indptr[: bs + 1].zero_()
            batch.attn_metadata = self._verify_metadata(bs, batch, t)
            return
        c = self.config
        # fixed for every replay of this size: enough splits for the longest sequence it may see
        splits = self._decode.num_kv_splits_for(bs, c.num_kv_heads, c.num_heads // c.num_kv_heads, self._g_max_len,
                                                self.num_sms)
        self._g_splits[bs] = splits
        torch.arange(bs + 1, out=self._g_indptr[: bs + 1])  # every sequence one key: slot 0
        batch.attn_metadata = _Metadata(self._g_indptr[: bs + 1], self._g_indices, None, 1, splits)

    def prepare_replay(self, bs: int, batch: ForwardBatch) -> None:
        verify = not batch.is_decode
        total = sum(batch.seq_lens_cpu) - (sum(batch.extend_lens_cpu) if verify else 0)
        lens = batch.seq_lens - batch.extend_lens if verify else batch.seq_lens
        indptr, indices = self._indices(batch.kv_indices, self._g_rows[:bs], lens, total)
        self._g_indptr[: bs + 1].copy_(indptr)
        self._g_indices[:total].copy_(indices[:total])
        batch.attn_metadata = (self._verify_metadata(bs, batch, batch.extend_lens_cpu[0]) if verify else
                               _Metadata(self._g_indptr[: bs + 1], self._g_indices, None, 1, self._g_splits[bs]))

    def _verify_metadata(self, bs: int, batch: ForwardBatch, t: int) -> _Metadata:
        qo, offsets = self._g_verify
        return _Metadata(self._g_indptr[: bs + 1], self._g_indices, qo[: bs + 1], t, 1,
                         (batch.tree_mask.reshape(-1), offsets[:bs]))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        kc, vc = self.kv.k[layer.layer_id], self.kv.v[layer.layer_id]
        self._store(k, v, kc, vc, batch.out_cache_loc)
        md: _Metadata = batch.attn_metadata
        opts = dict(scale=layer.scaling, logit_cap=layer.logit_cap, sliding_window=layer.sliding_window)
        if md.qo_indptr is None:
            return self._decode.decode_attention(q, kc, vc, md.kv_indptr, md.kv_indices, num_kv_splits=md.num_kv_splits, **opts)
        tree_mask, tree_offsets = md.tree or (None, None)  # (a verify of draft trees)
        return self._extend.extend_attention(q, k, v, kc, vc, md.qo_indptr, md.kv_indptr, md.kv_indices,
                                             md.max_extend_len, tree_mask=tree_mask, tree_offsets=tree_offsets, **opts)


@hookimpl
def register_attention_backends(register) -> None:
    register("triton", TritonBackend)
