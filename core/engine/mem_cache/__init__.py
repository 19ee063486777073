"""KV cache memory tiers (SGLang's mem_cache): the device pool (``core.engine.mem_cache.kv_cache``), the radix
tree over it (``core.engine.mem_cache.radix_cache``) and HiCache's host tier (``host_pool``, ``hierarchical``).

The option values live here, free of heavy imports, for ``core.engine.config``'s flags."""

from __future__ import annotations

# SGLang 0.5's choices for the --hicache-* flags (python/sglang/srt/server_args.py)
HICACHE_WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")
HICACHE_IO_BACKENDS = ("direct", "kernel", "kernel_ascend")
HICACHE_MEM_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_first_kv_split", "page_head")
HICACHE_STORAGE_PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
