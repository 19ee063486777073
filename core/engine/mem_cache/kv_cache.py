"""Paged KV cache: the pool tensors, the page allocator and the per-request slot table.

The pool is allocated once at start-up. Page 0 is reserved as zeroed padding (its
slots are what padded gathers read), so it is never handed out. The scheduler
allocates pages as tokens land (``can_allocate`` / ``allocate``) and returns them with
``free``; admission only *estimates* future needs (``--schedule-conservativeness``) and
decode retracts requests when the pool runs out. Pages shared through the radix prefix
cache are owned by the cache (core/engine/mem_cache/radix_cache.py), not by requests.
"""

from __future__ import annotations

import torch

from core.errors import CoreError, ModelLoadError
from core.interfaces import KVCache


def allocate_kv_cache(
    num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> KVCache:
    slots = num_pages * page_size

    def buf() -> torch.Tensor:
        t = torch.empty(slots, num_kv_heads, head_dim, dtype=dtype, device=device)
        t[:page_size].zero_()  # padding page
        return t

    return KVCache(k=[buf() for _ in range(num_layers)], v=[buf() for _ in range(num_layers)], page_size=page_size)


def copy_rows(src: list[torch.Tensor], src_slots: torch.Tensor, dst: list[torch.Tensor], dst_slots: torch.Tensor) -> None:
    """Copy rows ``src_slots`` of each KV buffer in ``src`` to rows ``dst_slots`` of its peer in
    ``dst`` (the same buffer or another pool's, on any device), gathered before written; as bytes,
    so any dtype copies (CPU torch has no fp8 ``index_copy_``)."""
    with torch.no_grad():
        for s, d in zip(src, dst):
            d.view(torch.uint8).index_copy_(0, dst_slots, s.view(torch.uint8).index_select(0, src_slots).to(d.device))


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


GIB = 1 << 30
# RAM left to the OS and other programs: 5 % of it, at least 512 MiB and at most 4 GiB
CPU_RAM_MARGIN = (512 << 20, 4 * GIB)
MAX_RUNNING_DEFAULT = 256  # the default --max-running-requests ceiling (AsyncEngine._build_kv_pool)
MIN_KV_TOKENS = 2048  # a pool smaller than one prefill chunk of a long prompt is not worth starting


def cpu_kv_tokens(total: int, available: int, mem_fraction: float, per_token: int, context_len: int,
                  max_running: int | None = None) -> int:
    """KV pool size in tokens for a CPU engine, from the machine's RAM (bytes) after the weights loaded.

    SGLang's formula, ``total * fraction - (total - available)``, charges every other program's memory
    to the engine: past ~30 % used the default 0.3 left nothing, and the pool swung with the page cache
    from one start to the next. Here the budget is ``min(total * fraction, available - margin)``:
    fixed for a machine while memory is plentiful, and never more than what is free. It is capped at
    what ``max_running`` full contexts can use (a larger pool is never touched; ``torch.empty`` commits
    pages only as they are written). Too little memory raises ModelLoadError naming a setting that works."""
    margin = min(max(CPU_RAM_MARGIN[0], total // 20), CPU_RAM_MARGIN[1])
    budget = min(int(total * mem_fraction), available - margin)
    cap = (max_running or MAX_RUNNING_DEFAULT) * context_len
    tokens = min(max(budget, 0) // per_token, cap)
    floor = min(context_len, MIN_KV_TOKENS)
    if tokens >= floor:
        return tokens
    need = floor * per_token
    if total * mem_fraction < need <= available - margin:  # the fraction is what is short
        frac = min(0.95, -(-100 * (need + 1) // total) / 100)
        fix = f"pass --mem-fraction-static {frac:.2f} (or --max-total-tokens {floor})"
    else:
        fit = (available // 2) // per_token // 256 * 256  # half of what is free: a pool that still starts
        fix = f"free memory or pass --max-total-tokens {fit}" if fit >= 256 else "free memory"
    raise ModelLoadError(
        f"the KV cache needs {need / GIB:.2f} GiB for {floor} tokens but --mem-fraction-static {mem_fraction} of "
        f"{total / GIB:.1f} GiB RAM with {available / GIB:.1f} GiB free ({margin / GIB:.1f} GiB kept for the system) "
        f"leaves {max(budget, 0) / GIB:.2f} GiB; {fix}")


# --kv-cache-dtype values (SGLang's names) -> storage dtype; "auto" is the model's dtype.
KV_CACHE_DTYPES = {
    "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's storage dtype for ``--kv-cache-dtype name``. fp8 halves the bytes per token of a
    bf16/fp16 pool, so the same memory holds twice the tokens (K/V are scaled per tensor, see KVCache)."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise CoreError(f"unknown --kv-cache-dtype {name!r}; choose auto, {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]


class PageAllocator:
    """Free list of pages; admission control and retraction (in the scheduler) decide
    who may take them, so this only hands pages out and takes them back."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages, got {num_pages}")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, 0, -1))  # page 0 is padding; pop() yields low pages first

    @property
    def capacity(self) -> int:
        """Usable pages (all but the padding page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, pages: int) -> bool:
        return pages <= len(self._free)

    def allocate(self, pages: int) -> list[int]:
        if not self.can_allocate(pages):
            raise RuntimeError(f"cannot allocate {pages} pages, {len(self._free)} free")
        free = self._free
        taken = free[len(free) - pages :]  # (one slice, not a pop per page)
        del free[len(free) - pages :]
        taken.reverse()
        return taken

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))
        assert len(self._free) <= self.capacity, "page accounting broken: a page was freed twice"


class ReqToTokenTable:
    """``[max_running, context_len]`` table of KV slots per running request.

    Rows are handed out per running request; the runner gathers each sequence's
    slots with one index instead of rebuilding lists every step."""

    def __init__(self, max_running: int, context_len: int, device: torch.device) -> None:
        self.table = torch.zeros(max_running, context_len, dtype=torch.int64, device=device)
        # on the CPU, the same memory as a numpy array, made once: the runner writes and gathers
        # through it every step (each Tensor.numpy() took 35-40 us with the caches cold after a decode)
        self.host = self.table.numpy() if self.table.device.type == "cpu" else None
        self._free_rows = list(range(max_running - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int:
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        self._free_rows.append(row)
