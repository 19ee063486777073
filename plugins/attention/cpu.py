"""CPU attention that reads the paged KV cache in place (``--attention-backend cpu``).

torch_native gathers every sequence's whole K/V into a padded block per layer per step;
this backend's C++/OpenMP kernel (``cpu_attention.cpp``) walks each sequence's slot row
instead, all query heads of a KV head together, with an online softmax in fp32. The
kernel is compiled once per machine (``core_kernels.cpp_build``: ``-O3 -march=native``,
cached under the torch extensions folder by a hash of source, flags, CPU and torch version),
so later starts only load it. Prefill and extend use
the same kernel (several query tokens per task, causal over prefix + new tokens): on this
engine's shapes it beats torch_native's masked SDPA, and torch's flash SDPA on a prompt alone
(SmolLM2 heads, 2,048 tokens, 2 threads, float32 on an AVX2-only EPYC: 44-48 against 54-62 ms
per layer).
A pool the kernel does not read (fp8, ``--kv-cache-dtype fp8_e4m3``) is left to torch_native, and
so is a speculative verify of draft trees (``ForwardBatch.tree_mask``; the kernel is causal): its
forward runs torch_native's path over the same pool.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import structlog
import torch

from core import hookimpl
from core.errors import CoreError
from core.interfaces import AttentionConfig, AttentionLayerSpec, ForwardBatch
from core_kernels import cpp_build, cpu_ops
from core_plugins.attention.torch_native import TorchNativeBackend

log = structlog.get_logger(__name__)
SOURCE = Path(__file__).with_name("cpu_attention.cpp")
PREFIX = "core_cpu_attention"
POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the kernel reads


def is_built() -> bool:
    """Whether the kernel is compiled already (loading it is then quick)."""
    return cpp_build.is_built(PREFIX, SOURCE)


@functools.cache
def load_kernel() -> Any:
    """The compiled ``torch.ops.core_cpu.paged_attention`` (built on first use); CoreError naming the problem."""
    t0 = time.perf_counter()
    try:
        d, compiled = cpp_build.load(PREFIX, SOURCE)
    except RuntimeError as e:  # no toolchain, or a compiler error (its last lines say what went wrong)
        raise CoreError(f"attention backend 'cpu' cannot be built: {e}; use --attention-backend torch_native") from None
    log.info("cpu_attention.kernel", loaded_from=str(d), compiled=compiled, seconds=round(time.perf_counter() - t0, 1))
    return torch.ops.core_cpu.paged_attention.default


@functools.cache
def kernel_status(build: bool = True) -> tuple[bool, str]:
    """(usable, why) for the built-in policy; ``build=False`` never compiles (``core plugins``)."""
    if problem := cpp_build.toolchain_problem():
        return False, problem
    if not build and not is_built():
        return True, "C++ compiler found; the kernel compiles at the first engine start"
    try:
        load_kernel()
    except CoreError as e:
        return False, str(e)
    return True, "its C++ kernel is built"


class CpuBackend:
    supports_tree_mask = True  # plugin API 1.4: tree batches take torch_native's path over the same pool
    supports_batch_invariant = True  # plugin API 1.10: batch_invariant = True plans every row alike (below)
    batch_invariant = False

    def __init__(self, config: AttentionConfig) -> None:
        if config.device.type != "cpu":
            raise CoreError(f"attention backend 'cpu' runs on the CPU, but the engine runs on {config.device}")
        self._op = load_kernel()
        self.config, self.kv = config, config.kv_cache
        self._native = None
        self._tree: TorchNativeBackend | None = None  # made on the first tree batch
        if (dtype := self.kv.k[0].dtype) not in POOL_DTYPES:
            log.info("cpu_attention.torch_native", reason=f"the kernel does not read a {dtype} KV pool")
            self._native = TorchNativeBackend(config)
            self.supports_batch_invariant = False

    def decode_caches(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer's K and V pools, for a caller that runs this backend's kernel itself
        (``kernels/cpu_decode``); None where the kernel does not read them."""
        return None if self._native is not None else (self.kv.k[layer_id], self.kv.v[layer_id])

    def prepare(self, batch: ForwardBatch) -> None:
        """Nothing to precompute: the kernel reads the batch's slot rows and lengths directly."""
        if self._native is not None:
            self._native.prepare(batch)
        elif batch.tree_mask is not None:
            self._tree_backend().prepare(batch)

    def _tree_backend(self) -> TorchNativeBackend:
        if self._tree is None:
            self._tree = TorchNativeBackend(self.config)
        return self._tree

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        if self._native is not None:
            return self._native.forward(q, k, v, layer, batch)
        if batch.tree_mask is not None:  # the kernel is causal: torch_native's masked path (prepared above)
            return self._tree_backend().forward(q, k, v, layer, batch)
        kc, vc = self.kv.k[layer.layer_id], self.kv.v[layer.layer_id]
        if cpu_ops.available():  # one memcpy per row (as the one-op decoder layer stores them)
            cpu_ops.store_kv(kc, vc, batch.out_cache_loc, k, v)
        else:
            kc.index_copy_(0, batch.out_cache_loc, k.to(kc.dtype))
            vc.index_copy_(0, batch.out_cache_loc, v.to(vc.dtype))
        qc = q if q.dtype == kc.dtype and q.stride(1) == q.shape[2] and q.stride(2) == 1 else q.to(kc.dtype).contiguous()
        out = self._op(qc, kc, vc, batch.kv_indices, batch.seq_lens, batch.extend_lens, layer.scaling,
                       layer.sliding_window or 0, layer.logit_cap, self.batch_invariant)
        return out if out.dtype == q.dtype else out.to(q.dtype)


@hookimpl
def register_attention_backends(register) -> None:
    register("cpu", CpuBackend)
