"""HiCache's host tier under the radix tree (SGLang's HiRadixCache, host tier only).

A node's KV lives on the device (``pages``), on the host (``host``) or both. When the device
pool runs low, ``evict`` takes device-resident leaves (nodes with no device-resident child) in
LRU/LFU order: a leaf backed up on the host only gives back its device pages and stays in the
tree, host-resident; one without a host copy is backed up first under ``write_back``, else it
leaves the tree (with the host-only nodes under it). Backups are made:

* ``write_back``: when a node is evicted from the device;
* ``write_through``: when a node's KV is complete (``insert``);
* ``write_through_selective``: when an admission match hits a node for the second time or more
  (``hit_count >= 2``: SGLang's ``write_through_threshold``).

The write-through policies copy on the host pool's writer thread (on a GPU from a side stream),
never on the scheduler's path: the host pages are taken at once, and the node's device pages are
not freed until its copy is done (``evict`` waits for the copies still running, ``settle``).
``write_back`` copies inside ``evict``, whose caller reuses the pages at once.

A match at admission (``match_prefix(ids, load_back=True)``) that runs into host-resident nodes
gives them freshly allocated device pages (evicting other unused prefixes if needed) and queues
the copy of their KV (``HostKVPool.load_later``); the batch being built carries it (``take_loads``)
and the model runner issues it as that batch's forward starts (``KVLoads``: a copy on the CPU; on
a GPU per layer on a stream of its own, each attention layer waiting for its own). A queued load
whose nodes are evicted again before any batch took it is dropped (``cancel_loads``).
The host pool evicts its own LRU host-only leaves when a backup needs room; they leave the tree.

With ``--hicache-storage-backend`` a storage tier sits under the host pool (``storage``): every
backup to the host is also written to storage in the background, and an admission match that runs
past the device and host tiers reads the stored continuation of the prompt into host pages (a new
host-resident node) and loads it back with the host hits. Storage outlives the engine (a restart
reads it). ``/flush_cache`` empties every tier: ``reset`` the device and host tiers, then the engine
``clear_storage`` (SGLang's /flush_cache leaves storage to its /clear_hicache_storage_backend; here a
flush means no cached KV is served afterwards); a weight update clears storage too (a stored page
carries no weight version). A failed step's reset leaves storage alone.

Pure page-id bookkeeping here and in ``RadixCache``; the tensors and the copies are the
``HostKVPool``'s. Tensor parallelism is refused with the host tier for now (``check_hicache_args``).
"""

from __future__ import annotations

import concurrent.futures
import functools
import time
from typing import TYPE_CHECKING, Any

import attrs
import structlog

from core.engine.mem_cache.kv_cache import GIB, PageAllocator
from core.engine.mem_cache import (
    HICACHE_IO_BACKENDS, HICACHE_MEM_LAYOUTS, HICACHE_STORAGE_PREFETCH_POLICIES, HICACHE_WRITE_POLICIES,
)
from core.engine.mem_cache.host_pool import HostKVPool, KVLoads
from core.engine.mem_cache.radix_cache import RadixCache, TreeNode
from core.engine.mem_cache.storage import StorageTier, storage_namespace, weights_fingerprint
from core.errors import CoreError, UnknownNameError

if TYPE_CHECKING:
    from core.engine.config import EngineArgs
    from core.interfaces import KVCache

log = structlog.get_logger("core.engine.mem_cache")

WRITE_THROUGH_SELECTIVE_THRESHOLD = 2  # SGLang: write_through_threshold = 1 if write_through else 2
HICACHE_SIZE_UNIT = 10**9  # --hicache-size is in GB (SGLang: host_size * 1e9 bytes)


@attrs.define
class HiCacheStats:
    """Cumulative counters of the host tier (kept across /flush_cache; read by the metrics)."""

    host_hit_tokens: int = 0  # tokens of admitted prefixes loaded back from the host
    bytes_to_host: int = 0  # backups, device -> host
    bytes_to_device: int = 0  # load-backs, host -> device
    backup_seconds: float = 0.0  # time spent backing up
    host_evicted_pages: int = 0  # host-only pages dropped to make room in the host pool
    storage_hit_tokens: int = 0  # tokens of admitted prefixes read from the storage tier
    bytes_to_storage: int = 0  # pages written to storage (background writer)
    bytes_from_storage: int = 0  # pages read from storage into the host pool
    storage_read_seconds: float = 0.0  # time admissions spent probing and reading storage
    storage_write_seconds: float = 0.0  # time the background writer spent writing
    storage_failed_writes: int = 0  # pages the backend could not store
    storage_skipped_pages: int = 0  # pages not written because the writer's queue was full


def check_hicache_args(args: EngineArgs) -> None:
    """Refuse --hicache-* values this engine cannot honour, naming the flag."""
    if args.hicache_storage_backend is not None and not args.enable_hierarchical_cache:
        raise CoreError(f"--hicache-storage-backend {args.hicache_storage_backend!r} is the tier under the host "
                        "pool: it needs --enable-hierarchical-cache")
    for flag, value, choices in (("--hicache-write-policy", args.hicache_write_policy, HICACHE_WRITE_POLICIES),
                                 ("--hicache-storage-prefetch-policy", args.hicache_storage_prefetch_policy,
                                  HICACHE_STORAGE_PREFETCH_POLICIES),
                                 ("--hicache-io-backend", args.hicache_io_backend, HICACHE_IO_BACKENDS),
                                 ("--hicache-mem-layout", args.hicache_mem_layout, HICACHE_MEM_LAYOUTS)):
        if value not in choices:
            raise CoreError(f"{flag} {value!r} is not one of {', '.join(choices)}")
    if args.hicache_ratio <= 0 or args.hicache_size < 0:
        raise CoreError(f"--hicache-ratio must be > 0 and --hicache-size >= 0, got {args.hicache_ratio} and "
                        f"{args.hicache_size}")
    if not args.enable_hierarchical_cache:
        return
    if args.disable_radix_cache:
        raise CoreError("--enable-hierarchical-cache extends the radix prefix cache; it cannot be used with "
                        "--disable-radix-cache")
    if args.tp_size > 1:
        raise CoreError("--enable-hierarchical-cache is not supported with --tp-size > 1 yet (each rank would need "
                        "its own shard's host copy); use --tp-size 1 or leave the host tier off")


def build_tree_cache(args: EngineArgs, allocator: PageAllocator, kv_cache: KVCache, per_token: int,
                     plugins: Any = None, model: Any = None) -> RadixCache | None:
    """The prefix cache the flags ask for: none, the radix cache, or the radix cache with a host tier
    (and a storage tier: its backend from ``plugins``, its key namespace from ``model``, the ModelConfig)."""
    check_hicache_args(args)
    ps = allocator.page_size
    if args.disable_radix_cache:
        return None
    if not args.enable_hierarchical_cache:
        return RadixCache(ps, args.radix_eviction_policy)
    device_tokens = allocator.capacity * ps
    if args.hicache_size > 0:
        tokens, how = int(args.hicache_size * HICACHE_SIZE_UNIT // per_token), f"--hicache-size {args.hicache_size}"
    else:
        tokens, how = int(device_tokens * args.hicache_ratio), f"--hicache-ratio {args.hicache_ratio}"
    pages = tokens // ps
    if pages * ps <= device_tokens:  # SGLang: the host pool must be larger than the device pool
        raise CoreError(f"{how} gives a host KV pool of {pages * ps} tokens, not larger than the device pool's "
                        f"{device_tokens}; the host tier must be larger (raise {how.split()[0]})")
    host = HostKVPool(kv_cache, pages)
    log.info("hicache.host_pool", host_tokens=pages * ps, host_gib=round(pages * host.bytes_per_page / GIB, 3),
             device_tokens=device_tokens, write_policy=args.hicache_write_policy,
             io_backend=args.hicache_io_backend, mem_layout=args.hicache_mem_layout)
    tree = HiRadixCache(ps, args.radix_eviction_policy, allocator, host, args.hicache_write_policy)
    if (name := args.hicache_storage_backend) is not None:
        tree.storage = _build_storage(name, args, host, tree.stats, plugins, model)
    return tree


def _build_storage(name: str, args: EngineArgs, host: HostKVPool, stats: HiCacheStats, plugins: Any,
                   model: Any) -> StorageTier:
    from core.interfaces import HiCacheStorageConfig

    if plugins is None:
        from core.plugins import load_plugins

        plugins = load_plugins()
    try:
        factory = plugins.resolve("hicache_storage_backend", name)
    except UnknownNameError as e:
        raise CoreError(f"--hicache-storage-backend {name!r}: {e}") from e
    ident = model if isinstance(model, str) else \
        "|".join(str(getattr(model, a, "")) for a in ("path", "source", "dtype", "quant_config"))
    path = getattr(model, "path", None) or args.model_path
    namespace = storage_namespace(ident or str(args.model_path), args, host, weights_fingerprint(str(path)))
    backend = factory(HiCacheStorageConfig(namespace=namespace, page_bytes=host.bytes_per_page))
    log.info("hicache.storage", backend=name, namespace=namespace, folder=getattr(backend, "folder", None),
             prefetch_policy=args.hicache_storage_prefetch_policy)
    return StorageTier(backend, name, namespace, host, stats, args.hicache_storage_prefetch_policy)


class HiRadixCache(RadixCache):
    """The radix cache with a host tier; the scheduler uses it like a ``RadixCache``, passing
    ``load_back=True`` to the match that admits a request."""

    def __init__(self, page_size: int, eviction_policy: str, allocator: PageAllocator, host: HostKVPool,
                 write_policy: str = "write_through") -> None:
        if write_policy not in HICACHE_WRITE_POLICIES:
            raise CoreError(f"--hicache-write-policy {write_policy!r} is not one of {', '.join(HICACHE_WRITE_POLICIES)}")
        self.allocator, self.host_pool, self.write_policy = allocator, host, write_policy
        self.stats = HiCacheStats()
        self.storage: StorageTier | None = None  # the tier under the host pool (--hicache-storage-backend)
        # write-through backups on the host pool's writer thread (``_backup``) not yet accounted, with
        # their bytes (``settle``); a node's own is ``TreeNode.writing``, which ``evict`` waits for
        self._writing: list[tuple[concurrent.futures.Future, int]] = []
        super().__init__(page_size, eviction_policy)

    # ------------------------------------------------------------------ queries
    def reset(self) -> list[int]:
        """Empty the tree (the device and host tiers; storage is ``clear_storage``'s); returns the
        device pages it held."""
        self.settle()
        pages = super().reset()
        self.host_pool.reset()
        return pages

    def clear_storage(self) -> bool:
        """Drop this engine's pages from the storage tier (SGLang's /clear_hicache_storage_backend);
        False without one."""
        if self.storage is None:
            return False
        self.settle()  # (a backup still copying would reach storage after the clear)
        self.storage.clear()
        return True

    def flush_writes(self) -> None:
        """Wait until every backup so far is in the host pool and, with a storage tier, stored."""
        self.settle()
        if self.storage is not None:
            self.storage.wait()

    def close(self) -> None:
        """Finish the queued backups and storage writes and stop the writers (engine shutdown)."""
        self.settle()
        self.host_pool.close()
        if self.storage is not None:
            self.storage.close()

    def settle(self, wait: bool = True) -> None:
        """Account the backups the writer thread has finished; ``wait``: all of them, waiting."""
        while self._writing and (wait or self._writing[0][0].done()):
            fut, nbytes = self._writing.pop(0)
            self.stats.backup_seconds += fut.result()
            self.stats.bytes_to_host += nbytes

    @property
    def host_used_pages(self) -> int:
        return self.host_pool.capacity - self.host_pool.allocator.num_free

    def host_pages(self) -> list[int]:
        return [p for n in self._nodes() for p in n.host]

    def tier_stats(self) -> dict[str, Any]:
        """The metrics' view: cumulative counters plus the host pool's occupancy in tokens."""
        ps = self.page_size
        return {**attrs.asdict(self.stats), "load_seconds": self.host_pool.load_seconds, "host_used_tokens": self.host_used_pages * ps,
                "host_total_tokens": self.host_pool.capacity * ps}

    # ------------------------------------------------------------------ match / load back
    def match_prefix(self, ids: list[int], load_back: bool = False) -> tuple[list[int], TreeNode]:
        """The device-resident match; with ``load_back``, host-resident nodes that continue it are
        loaded into new device pages first (as many whole nodes as the device pool can take)."""
        pages, node = super().match_prefix(ids)
        if not load_back:
            return pages, node
        self.settle(wait=False)
        if self.write_policy == "write_through_selective":
            n = node
            while n is not self.root:
                if not n.host and n.hit_count >= WRITE_THROUGH_SELECTIVE_THRESHOLD:
                    self._backup(n, later=True)
                n = n.parent
        host_nodes = self._host_path(node, ids, len(pages) * self.page_size)
        stored = [] if self.storage is None else self._storage_path(
            host_nodes[-1] if host_nodes else node, ids, host_nodes,
            len(pages) * self.page_size + sum(len(n.key) for n in host_nodes))
        host_nodes += stored
        if not host_nodes:
            return pages, node
        loaded = self._load_back(host_nodes)
        if stored and stored[0] in loaded:  # counted as a storage hit, not a host one
            self.stats.host_hit_tokens -= len(stored[0].key)
        return pages + [p for n in loaded for p in n.pages], (loaded[-1] if loaded else node)

    def cached(self, ids: list[int]) -> tuple[int, TreeNode]:
        """``RadixCache.cached`` plus the host-resident nodes continuing the device match, counted
        without splitting or touching them (a queue order is no use of the prefix)."""
        n, node = super().cached(ids)
        ids, at = ids[: len(ids) // self.page_size * self.page_size], node
        while n < len(ids) and (child := at.children.get(self._child_key(ids, n))) is not None and not child.pages:
            m = self._match_len(child.key, ids, n)
            n, at = n + m, child
            if m < len(child.key):
                break
        return n, node

    def _host_path(self, node: TreeNode, ids: list[int], i: int) -> list[TreeNode]:
        """The host-resident nodes matching ``ids[i:]`` below ``node`` (the last split to the match)."""
        return list(self.walk(node, ids, i, on_device=False))

    def _storage_path(self, node: TreeNode, ids: list[int], host_nodes: list[TreeNode], i: int) -> list[TreeNode]:
        """The stored continuation of ``ids[:i]`` (which ends at ``node``), read into host pages as a
        new host-resident child of ``node``: [] or [that node]. As much as the device can take."""
        ps = self.page_size
        ids = ids[: len(ids) // ps * ps]
        if i + ps > len(ids) or self._child_key(ids, i) in node.children:
            return []
        self.inc_lock_ref(node)  # neither the path nor its host pages are evicted meanwhile
        try:
            room = self.allocator.num_free + self.evictable_pages - sum(len(n.host) for n in host_nodes)

            def take_host(n: int) -> list[int]:
                hp = self.host_pool.allocator
                if n > hp.num_free:
                    self._evict_host(n - hp.num_free)
                return hp.allocate(min(n, hp.num_free))

            host = self.storage.read(ids, i, room, take_host, self.host_pool.allocator.free)
        finally:
            self.dec_lock_ref(node)
        if not host:
            return []
        new = TreeNode(ids[i : i + len(host) * ps], [], node)
        new.host, new.last_access, new.hit_count = host, next(self._clock), 1
        node.children[self._child_key(ids, i)] = new
        return [new]

    def _load_back(self, host_nodes: list[TreeNode]) -> list[TreeNode]:
        """Give the leading ``host_nodes`` that fit device pages and queue the copy of their KV there
        (``HostKVPool.load_later``: the batch being built carries it, issued as its forward starts)."""
        self.inc_lock_ref(host_nodes[-1])  # the path stays: no device or host eviction takes it
        try:
            avail = self.allocator.num_free + self.evictable_pages
            take, need = [], 0
            for n in host_nodes:
                if need + len(n.host) > avail:
                    break
                take.append(n)
                need += len(n.host)
            if not take:
                return []
            if (short := need - self.allocator.num_free) > 0:
                self.allocator.free(self.evict(short))
            dev = self.allocator.allocate(need)
            host, j = [], 0
            for n in take:
                n.pages = dev[j : j + len(n.host)]
                j += len(n.host)
                host += n.host
                self.protected_pages += len(n.pages)  # (locked: unlocked below)
            self.stats.bytes_to_device += self.host_pool.load_later(host, dev)  # (the batch being built carries it)
        finally:
            self.dec_lock_ref(host_nodes[-1])
        self.stats.host_hit_tokens += need * self.page_size
        return take

    def take_loads(self) -> KVLoads | None:
        return self.host_pool.take_loads()

    # ------------------------------------------------------------------ backup / eviction
    def _inserted(self, node: TreeNode) -> None:
        if node.host:  # a host-resident node took the caller's pages: the tree's copy wins (as on the
            # device, where a duplicate is freed and the request moves to the tree's pages), so both
            # tiers hold the same KV and a later load-back gives what this request went on with
            self.stats.bytes_to_device += self.host_pool.load(node.host, node.pages)
        elif self.write_policy == "write_through":
            self._backup(node, later=True)

    def _backup(self, node: TreeNode, later: bool = False) -> bool:
        """Copy a device-resident node's KV to new host pages (making room by dropping the host
        pool's LRU host-only leaves), then queue it for storage; False when the host pool cannot
        hold it. ``later``: on the host pool's writer thread, off the step's path (the write-through
        policies); the node's device pages stay until it is done, as ``evict`` waits for it."""
        need = len(node.pages)
        hp = self.host_pool.allocator
        if need > hp.num_free:
            self._evict_host(need - hp.num_free)
            if need > hp.num_free:
                return False
        node.host = hp.allocate(need)
        store = None
        if self.storage is not None:
            store = functools.partial(self.storage.backup, self._path_ids(node.parent), list(node.key), list(node.host))
        if later:
            node.writing = self.host_pool.backup_later(node.pages, node.host, store)
            self._writing.append((node.writing, need * self.host_pool.bytes_per_page))
            return True
        t0 = time.perf_counter()
        self.stats.bytes_to_host += self.host_pool.backup(node.pages, node.host)
        self.stats.backup_seconds += time.perf_counter() - t0
        if store is not None:
            store()
        return True

    def _path_ids(self, node: TreeNode) -> list[int]:
        """The token ids from the root to ``node`` included."""
        keys = []
        while node is not self.root:
            keys.append(node.key)
            node = node.parent
        return [t for k in reversed(keys) for t in k]

    def evict(self, num_pages: int) -> list[int]:
        """Free at least ``num_pages`` device pages (or all that can be): device-resident leaves
        with a host copy stay in the tree, host-resident; the others leave it (``write_back``
        backs them up first)."""
        if num_pages <= 0:
            return []

        def device_leaf(n: TreeNode) -> bool:
            return bool(n.pages) and n.lock_ref == 0 and not any(c.pages for c in n.children.values())

        freed: list[int] = []
        for n in self.eviction_order(device_leaf):
            if len(freed) >= num_pages:
                break
            if not n.host and self.write_policy == "write_back":
                self._backup(n)
            if n.writing is not None:  # its backup still reads these pages: they are freed once it is done
                n.writing.result()
                n.writing = None
            freed += n.pages
            self.evictable_pages -= len(n.pages)
            self.host_pool.cancel_loads(n.pages)  # (loaded back, then evicted before any batch took the load)
            if n.host:
                n.pages = []
            else:
                self._drop(n)
        self.settle(wait=False)
        return freed

    def _drop(self, node: TreeNode) -> None:
        """Remove ``node`` (already off the device) and its subtree, all host-only, from the tree."""
        del node.parent.children[self._child_key(node.key, 0)]
        stack = [node]
        while stack:
            n = stack.pop()
            assert n is node or not n.pages, "a device-resident node under an evicted one"
            self.host_pool.allocator.free(n.host)
            n.host = []
            stack.extend(n.children.values())

    def _evict_host(self, num_pages: int) -> int:
        """Drop host-only leaves, least recently used first, until ``num_pages`` host pages are free
        or none is left; returns the pages freed."""
        freed = 0
        for n in self.eviction_order(lambda n: not n.pages and not n.children and n.lock_ref == 0):
            if freed >= num_pages:
                break
            freed += len(n.host)
            self._drop(n)
        self.stats.host_evicted_pages += freed
        return freed

    # ------------------------------------------------------------------ debugging
    def check(self) -> None:
        """``RadixCache.check`` plus the host tier: every host page is free or held by exactly one
        node, an evicted node keeps a host copy, and nothing below it is on the device."""
        super().check()
        ps = self.page_size
        for n in self._nodes():
            if n.host:
                assert len(n.host) * ps == len(n.key), n
            if not n.pages:
                assert n.host, ("an evicted node without a host copy", n)
                assert not any(c.pages for c in n.children.values()), ("device node under a host-only one", n)
        hp = self.host_pool.allocator
        assert sorted(hp._free + self.host_pages()) == list(range(1, hp.num_pages)), "host pages leaked or double-owned"
