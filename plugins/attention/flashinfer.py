"""FlashInfer attention over the paged KV pool (CUDA only; ``pip install 'core-engine[flashinfer]'``).

Decode uses ``BatchDecodeWithPagedKVCacheWrapper``; prefill (with or without a cached
prefix) stores the new tokens' K/V first and runs ``BatchPrefillWithPagedKVCacheWrapper``
causally over the whole paged sequence, so a prefix hit needs no separate merge. The pool's
``[slots, Hkv, D]`` buffers are viewed as ``[pages, page_size, Hkv, D]`` (FlashInfer's NHD
layout). Layers with different sliding windows, soft caps or scales get their own wrapper,
planned once per forward on first use; plans read index pointers built on the host from the
batch's Python lengths, so planning never waits on the GPU. Page ids and the K/V stores use
the Triton kernels of ``core_kernels``.

Decode steps capture in CUDA graphs (plugin API 1.1 hooks): each captured batch size has its
own decode wrappers over fixed index buffers, and ``prepare_replay`` re-plans them (outside
the graph) before each replay. Nothing here is imported until the backend is chosen.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import shutil
from typing import Any

import attrs
import torch

from core import hookimpl
from core.errors import CoreError
from core.interfaces import AttentionConfig, AttentionLayerSpec, ForwardBatch

WORKSPACE_BYTES = 128 << 20
HEAD_DIMS = (64, 128, 256)  # what FlashInfer's decode, prefill and merge kernels are built for


def flashinfer_status() -> tuple[bool, str]:
    """(usable here?, what is missing) without importing flashinfer or compiling anything."""
    if importlib.util.find_spec("flashinfer") is None:
        return False, "the flashinfer-python package is not installed (pip install 'core-engine[flashinfer]')"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU (FlashInfer runs on NVIDIA GPUs only)"
    has_cache = importlib.util.find_spec("flashinfer_jit_cache") is not None
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or ""
    nvcc = shutil.which("nvcc") or (cuda_home and shutil.which("nvcc", path=os.path.join(cuda_home, "bin")))
    if not (has_cache or nvcc):
        return False, "FlashInfer compiles its kernels with nvcc at first use and no nvcc was found (set CUDA_HOME)"
    return True, "flashinfer importable, CUDA GPU, " + ("prebuilt kernels" if has_cache else f"nvcc at {nvcc}")


@attrs.define
class _Metadata:
    decode: bool
    qo_indptr: torch.Tensor | None  # [B+1] int32 on the host (prefill only)
    kv_indptr: torch.Tensor  # [B+1] int32 on the host, into kv_pages
    kv_pages: torch.Tensor  # [pages in batch] int32 on the device
    last_page_len: torch.Tensor  # [B] int32 on the host
    wrappers: dict  # (window_left, cap, scale) -> the wrapper this forward uses
    planned: set = attrs.field(factory=set)  # keys planned for this forward
    graph_bs: int | None = None  # the captured batch size whose fixed buffers the wrappers use


class FlashInferBackend:
    """The ``flashinfer`` attention backend (see the module docstring)."""

    supports_cuda_graph = True  # decode steps capture (read by the conformance kit)

    def __init__(self, config: AttentionConfig) -> None:
        ok, why = flashinfer_status()
        if not ok or config.device.type != "cuda":
            raise CoreError(f"--attention-backend flashinfer cannot run here: {why if not ok else 'the engine runs on ' + str(config.device)}")
        if config.dtype not in (torch.float16, torch.bfloat16):
            raise CoreError(f"--attention-backend flashinfer runs in float16 or bfloat16, not {str(config.dtype).removeprefix('torch.')}: "
                            "use --dtype bfloat16, or --attention-backend triton")
        if config.head_dim not in HEAD_DIMS:
            raise CoreError(f"--attention-backend flashinfer has kernels for head dims {', '.join(map(str, HEAD_DIMS))}, "
                            f"not {config.head_dim}: use --attention-backend triton")
        try:
            import flashinfer
        except Exception as e:  # a broken install: report it, never a traceback at start-up
            raise CoreError(f"--attention-backend flashinfer: importing flashinfer failed: {type(e).__name__}: {e}") from e
        from core_kernels.kv_indices import build_kv_indices
        from core_kernels.store_kv import store_kv

        self.fi, self.config, self.kv = flashinfer, config, config.kv_cache
        self._indices, self._store = build_kv_indices, store_kv
        self.page_size = self.kv.page_size
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=config.device)
        self._decode: dict[tuple[int, float, float], Any] = {}
        self._prefill: dict[tuple[int, float, float], Any] = {}
        self._graph: dict[int, dict[tuple[int, float, float], Any]] = {}  # captured bs -> its decode wrappers
        self._smoke_test()

    def _smoke_test(self) -> None:
        """Compile and run one tiny decode now, so a missing toolchain stops start-up with its reason."""
        c = self.config
        try:
            w = self.fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD")
            ps = self.page_size
            one = torch.tensor([0, 1], dtype=torch.int32)
            w.plan(one, one[:1].to(c.device), torch.tensor([1], dtype=torch.int32), c.num_heads, c.num_kv_heads,
                   c.head_dim, ps, q_data_type=c.dtype, kv_data_type=self.kv.k[0].dtype)
            q = torch.zeros(1, c.num_heads, c.head_dim, dtype=c.dtype, device=c.device)
            w.run(q, (self._paged(self.kv.k[0]), self._paged(self.kv.v[0])))
            torch.cuda.synchronize(c.device)
        except Exception as e:
            raise CoreError(f"--attention-backend flashinfer does not work here: {type(e).__name__}: {e} "
                            "(FlashInfer JIT-compiles its kernels with nvcc; a missing or pip-installed CUDA 13 "
                            "toolkit fails at link time, see flashinfer issue 5064)") from e

    def _paged(self, buf: torch.Tensor) -> torch.Tensor:
        return buf.view(-1, self.page_size, buf.shape[1], buf.shape[2])

    def _metadata(self, batch: ForwardBatch, wrappers: dict) -> _Metadata:
        """Page tables: the index pointers from the host-side lengths (FlashInfer plans on the host,
        so no device -> host copy), the page ids gathered on the device."""
        ps = self.page_size
        seq = batch.seq_lens_cpu
        pages = [(n + ps - 1) // ps for n in seq]
        kv_indptr = torch.tensor([0, *itertools.accumulate(pages)], dtype=torch.int32)
        last = torch.tensor([n - (p - 1) * ps for n, p in zip(seq, pages)], dtype=torch.int32)
        table = batch.kv_indices if ps == 1 else batch.kv_indices[:, ::ps] // ps
        rows = torch.arange(batch.batch_size, device=table.device)
        pages_dev = batch.seq_lens if ps == 1 else (batch.seq_lens + ps - 1) // ps
        _, kv_pages = self._indices(table.contiguous(), rows, pages_dev, int(kv_indptr[-1]))
        qo = None if batch.is_decode else torch.tensor([0, *itertools.accumulate(batch.extend_lens_cpu)], dtype=torch.int32)
        return _Metadata(batch.is_decode, qo, kv_indptr, kv_pages, last, wrappers)

    def prepare(self, batch: ForwardBatch) -> None:
        batch.attn_metadata = self._metadata(batch, self._decode if batch.is_decode else self._prefill)

    def _key(self, layer: AttentionLayerSpec) -> tuple[int, float, float]:
        """Layers differ in what a plan fixes: sliding window, soft cap, softmax scale."""
        window_left = layer.sliding_window - 1 if layer.sliding_window else -1
        return window_left, float(layer.logit_cap) if layer.logit_cap > 0 else 0.0, float(layer.scaling)

    def _plan(self, w: Any, md: _Metadata, key: tuple[int, float, float]) -> None:
        c = self.config
        common = dict(window_left=key[0], logits_soft_cap=key[1] or None, sm_scale=key[2],
                      q_data_type=c.dtype, kv_data_type=self.kv.k[0].dtype)
        if md.decode:
            w.plan(md.kv_indptr, md.kv_pages, md.last_page_len, c.num_heads, c.num_kv_heads, c.head_dim,
                   self.page_size, **common)
        else:
            w.plan(md.qo_indptr, md.kv_indptr, md.kv_pages, md.last_page_len, c.num_heads, c.num_kv_heads,
                   c.head_dim, self.page_size, causal=True, **common)
        md.planned.add(key)

    def _new_decode_wrapper(self, graph_bs: int | None = None) -> Any:
        c = self.config
        opts: dict[str, Any] = {"use_tensor_cores": c.num_heads // c.num_kv_heads >= 4}
        if graph_bs is not None:  # fixed index buffers: replays read what prepare_replay planned into them
            opts.update(use_cuda_graph=True, paged_kv_indptr_buffer=self._g_indptr[: graph_bs + 1],
                        paged_kv_indices_buffer=self._g_pages, paged_kv_last_page_len_buffer=self._g_last[:graph_bs])
        return self.fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", **opts)

    def _wrapper(self, md: _Metadata, layer: AttentionLayerSpec) -> Any:
        key = self._key(layer)
        if key not in md.wrappers:
            if md.decode:
                md.wrappers[key] = self._new_decode_wrapper(md.graph_bs)
            else:
                md.wrappers[key] = self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        w = md.wrappers[key]
        if key not in md.planned:
            self._plan(w, md, key)
        return w

    # ---- CUDA-graph capture hooks (plugin API 1.1)
    def init_cuda_graph(self, max_bs: int, max_len: int) -> None:
        dev, ps = self.config.device, self.page_size
        self._g_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
        self._g_pages = torch.zeros(max_bs * ((max_len + ps - 1) // ps), dtype=torch.int32, device=dev)
        self._g_last = torch.ones(max_bs, dtype=torch.int32, device=dev)

    def prepare_capture(self, bs: int, batch: ForwardBatch) -> None:
        """Every layer kind's wrapper for ``bs`` is made and planned on first use in the warm-up
        forwards (outside the graph); the captured forward then only runs them."""
        self._graph[bs] = {}
        md = self._metadata(batch, self._graph[bs])
        md.graph_bs = bs
        batch.attn_metadata = md

    def prepare_replay(self, bs: int, batch: ForwardBatch) -> None:
        wrappers = self._graph[bs]
        md = self._metadata(batch, wrappers)
        for key, w in wrappers.items():  # plan copies the page table into the wrapper's fixed buffers
            self._plan(w, md, key)
        batch.attn_metadata = md

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec,
                batch: ForwardBatch) -> torch.Tensor:
        kc, vc = self.kv.k[layer.layer_id], self.kv.v[layer.layer_id]
        self._store(k, v, kc, vc, batch.out_cache_loc)
        w = self._wrapper(batch.attn_metadata, layer)
        return w.run(q.contiguous(), (self._paged(kc), self._paged(vc)))


@hookimpl
def register_attention_backends(register) -> None:
    register("flashinfer", "core_plugins.attention.flashinfer:FlashInferBackend")
