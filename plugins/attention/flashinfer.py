"""FlashInfer attention over the paged KV pool (CUDA only; ``pip install 'core-engine[flashinfer]'``).

Decode uses ``BatchDecodeWithPagedKVCacheWrapper``; prefill (with or without a cached
prefix) stores the new tokens' K/V first and runs ``BatchPrefillWithPagedKVCacheWrapper``
causally over the whole paged sequence, so a prefix hit needs no separate merge. The pool's
``[slots, Hkv, D]`` buffers are viewed as ``[pages, page_size, Hkv, D]`` (FlashInfer's NHD
layout). Layers with different sliding windows or soft caps get their own planned wrapper,
planned once per forward on first use. Nothing here is imported until the backend is chosen.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from typing import Any

import attrs
import torch

from core import hookimpl
from core.errors import CoreError
from core.interfaces import AttentionConfig, AttentionLayerSpec, ForwardBatch

WORKSPACE_BYTES = 128 << 20


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
    qo_indptr: torch.Tensor  # [B+1] int32
    kv_indptr: torch.Tensor  # [B+1] int32, into kv_pages
    kv_pages: torch.Tensor  # [pages in batch] int32
    last_page_len: torch.Tensor  # [B] int32
    planned: set = attrs.field(factory=set)  # (window_left, cap) keys planned for this forward


class FlashInferBackend:
    """The ``flashinfer`` attention backend (see the module docstring)."""

    def __init__(self, config: AttentionConfig) -> None:
        ok, why = flashinfer_status()
        if not ok or config.device.type != "cuda":
            raise CoreError(f"--attention-backend flashinfer cannot run here: {why if not ok else 'the engine runs on ' + str(config.device)}")
        try:
            import flashinfer
        except Exception as e:  # a broken install: report it, never a traceback at start-up
            raise CoreError(f"--attention-backend flashinfer: importing flashinfer failed: {type(e).__name__}: {e}") from e
        self.fi, self.config, self.kv = flashinfer, config, config.kv_cache
        self.page_size = self.kv.page_size
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=config.device)
        self._decode: dict[tuple[int, float], Any] = {}
        self._prefill: dict[tuple[int, float], Any] = {}
        self._smoke_test()

    def _smoke_test(self) -> None:
        """Compile and run one tiny decode now, so a missing toolchain stops start-up with its reason."""
        c = self.config
        try:
            w = self.fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD")
            ps = self.page_size
            one = torch.tensor([0, 1], dtype=torch.int32, device=c.device)
            w.plan(one, one[:1], torch.tensor([1], dtype=torch.int32, device=c.device), c.num_heads, c.num_kv_heads,
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

    def prepare(self, batch: ForwardBatch) -> None:
        dev, ps = batch.seq_lens.device, self.page_size
        seq = batch.seq_lens.to(torch.int32)
        pages = (seq + ps - 1) // ps
        starts = batch.kv_indices[:, ::ps]  # first slot of each page, [B, ceil(Kmax / ps)]
        valid = torch.arange(starts.shape[1], device=dev)[None, :] < pages[:, None]
        zero = torch.zeros(1, dtype=torch.int32, device=dev)
        batch.attn_metadata = _Metadata(
            decode=batch.is_decode,
            qo_indptr=torch.cat([zero, torch.cumsum(batch.extend_lens, 0).to(torch.int32)]),
            kv_indptr=torch.cat([zero, torch.cumsum(pages, 0).to(torch.int32)]),
            kv_pages=(starts[valid] // ps).to(torch.int32),
            last_page_len=(seq - (pages - 1) * ps).to(torch.int32),
        )

    def _wrapper(self, md: _Metadata, layer: AttentionLayerSpec) -> Any:
        c = self.config
        window_left = layer.sliding_window - 1 if layer.sliding_window else -1
        cap = float(layer.logit_cap) if layer.logit_cap > 0 else 0.0
        key = (window_left, cap)
        table = self._decode if md.decode else self._prefill
        if key not in table:
            if md.decode:
                table[key] = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_tensor_cores=c.num_heads // c.num_kv_heads >= 4)
            else:
                table[key] = self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        w = table[key]
        if key not in md.planned:
            common = dict(window_left=window_left, logits_soft_cap=cap or None, sm_scale=layer.scaling,
                          q_data_type=c.dtype, kv_data_type=self.kv.k[0].dtype)
            if md.decode:
                w.plan(md.kv_indptr, md.kv_pages, md.last_page_len, c.num_heads, c.num_kv_heads, c.head_dim,
                       self.page_size, **common)
            else:
                w.plan(md.qo_indptr, md.kv_indptr, md.kv_pages, md.last_page_len, c.num_heads, c.num_kv_heads,
                       c.head_dim, self.page_size, causal=True, **common)
            md.planned.add(key)
        return w

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec,
                batch: ForwardBatch) -> torch.Tensor:
        kc, vc = self.kv.k[layer.layer_id], self.kv.v[layer.layer_id]
        kc.index_copy_(0, batch.out_cache_loc, k.to(kc.dtype))
        vc.index_copy_(0, batch.out_cache_loc, v.to(vc.dtype))
        w = self._wrapper(batch.attn_metadata, layer)
        return w.run(q.contiguous(), (self._paged(kc), self._paged(vc)))


@hookimpl
def register_attention_backends(register) -> None:
    register("flashinfer", "core_plugins.attention.flashinfer:FlashInferBackend")
