"""HiCache's storage tier under the host pool (``--hicache-storage-backend``): the keys, the background
writer and the reads at admission, over any ``HiCacheStorage`` backend (a plugin kind; ``file`` built in).

Keys (SGLang's page hashes): page ``j`` of a prefix is ``<namespace>_<h_j>`` with ``h_j`` = SHA-256 of
``h_{j-1}`` and page ``j``'s token ids, from the root, so a key names the whole prefix up to and
including its page. The namespace (``storage_namespace``) covers the model and its weight files,
dtypes, quantization, page size, KV layout and tensor-parallel rank: another model, new weights at the
same path, another dtype or page size never reads a page. A LoRA adapter's pages stay out of storage:
their keys hold the adapter's uid, which only names it within one process.
A value is one page's K and V of every layer as raw bytes (``HostKVPool.pack``); it must be exactly
``bytes_per_page`` long, and the backend vouches for its integrity (``file``: a checksum per file).

Writes: a node backed up to the host is also written to storage (write-through to storage), by one
background thread fed through a bounded queue: the engine's thread only snapshots the host pages
(a memcpy) and never waits; when the queue is full the write is skipped (counted). A page already
in storage is not written again. A failed write is logged once and counted; the tiers above go on.

Reads: at admission, after the device and host matches, the pages that continue the prompt are
probed in storage page by page (``exists``), read, and placed in host pages, which the caller loads
back to the device like a host hit. The read is synchronous (the admission waits for it) under
every ``--hicache-storage-prefetch-policy``: ``best_effort`` and ``wait_complete`` read the whole
continuation found; ``timeout`` stops at SGLang's prefetch budget (2 s + 0.1 s per 1,024 tokens,
at most 30 s). A page that is missing, damaged or of the wrong size ends the hit there; the rest of
the prompt is prefilled (and written again).
"""

from __future__ import annotations

import hashlib
import queue
import re
import threading
import time
from array import array
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import structlog
import torch

from core.engine.mem_cache.host_pool import HostKVPool
from core.engine.multimodal import is_adapter_key

if TYPE_CHECKING:
    from core.engine.mem_cache.hierarchical import HiCacheStats

log = structlog.get_logger("core.engine.mem_cache")

WRITE_QUEUE_NODES = 256  # backups waiting for the writer thread; more are skipped, never waited for
PREFETCH_TIMEOUT = (2.0, 0.1, 30.0)  # SGLang's timeout policy: base s, s per 1,024 tokens, max s


def weights_fingerprint(path: str) -> str:
    """The name, size and modification time of each weight file at ``path`` (a checkpoint folder or
    one file), so that new weights saved over old ones at the same path make a new namespace."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for f in p.glob("*") if f.suffix in _WEIGHT_SUFFIXES) if p.is_dir() else []
    return ";".join(f"{f.name}:{(st := f.stat()).st_size}:{st.st_mtime_ns}" for f in files)


_WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".gguf"}


def storage_namespace(model: str, args: Any, host: HostKVPool, weights: str = "") -> str:
    """What a stored page must match to be read: model and its weight files (``weights_fingerprint``),
    dtypes, quantization, page size, KV layout, TP rank."""
    k = host.k[0]
    ident = "|".join(map(str, (model, args.dtype, args.kv_cache_dtype, k.dtype, args.quantization, args.revision,
                                host.page_size, len(host.k), tuple(k.shape[1:]), 0, args.tp_size, weights)))
    slug = re.sub(r"[^0-9A-Za-z.-]+", "-", model.rstrip("/").rsplit("/", 1)[-1])[:40] or "model"
    return f"{slug}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def page_hashes(ids: list[int], page_size: int, prev: str = "") -> list[str]:
    """The hash chain of the whole pages of ``ids``, continuing from ``prev`` (the previous page's)."""
    out = []
    for i in range(0, len(ids) // page_size * page_size, page_size):
        prev = hashlib.sha256(prev.encode() + array("q", ids[i : i + page_size]).tobytes()).hexdigest()
        out.append(prev)
    return out


class StorageTier:
    def __init__(self, backend: Any, name: str, namespace: str, host: HostKVPool, stats: HiCacheStats,
                 prefetch_policy: str = "best_effort") -> None:
        self.backend, self.name, self.namespace, self.host = backend, name, namespace, host
        self.stats, self.prefetch_policy = stats, prefetch_policy
        self.page_size, self.page_bytes = host.page_size, host.bytes_per_page
        self._warned: set[str] = set()
        self._queue: queue.Queue = queue.Queue(WRITE_QUEUE_NODES)
        self._thread = threading.Thread(target=self._writer, name="hicache-storage-writer", daemon=True)
        self._thread.start()

    def key(self, h: str) -> str:
        return f"{self.namespace}_{h}"

    def _warn_once(self, what: str, **kw: Any) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(what, backend=self.name, **kw)

    def _call(self, method: str, *a: Any) -> Any:
        """A backend call that never raises into the engine (a plugin's exception reads as a failure)."""
        try:
            return getattr(self.backend, method)(*a)
        except Exception as e:  # noqa: BLE001
            self._warn_once(f"hicache.storage_{method}_raised", error=f"{type(e).__name__}: {e}")
            return None

    # ------------------------------------------------------------------ writes
    def backup(self, prefix_ids: list[int], node_ids: list[int], host_pages: list[int]) -> None:
        """Queue a node's pages (just backed up to ``host_pages``) for storage; never blocks. Not a
        LoRA adapter's: their keys hold uids, which another process gives to other adapters."""
        if not (prefix_ids or node_ids) or is_adapter_key((prefix_ids or node_ids)[0]):
            return
        hashes = page_hashes(prefix_ids + node_ids, self.page_size)[len(prefix_ids) // self.page_size :]
        try:
            self._queue.put_nowait(([self.key(h) for h in hashes], self.host.pack(host_pages)))
        except queue.Full:
            self.stats.storage_skipped_pages += len(host_pages)

    def _writer(self) -> None:
        ps = self.page_size
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                keys, data = item
                t0 = time.perf_counter()
                for j, key in enumerate(keys):
                    if self._call("exists", key):
                        continue
                    value = data[:, j * ps : (j + 1) * ps].contiguous().numpy().tobytes()
                    if self._call("set", key, value) is True:
                        self.stats.bytes_to_storage += len(value)
                    else:
                        self.stats.storage_failed_writes += 1
                        self._warn_once("hicache.storage_write_failed", key=key,
                                        detail="storage writes fail (folder unwritable or full?); the host and "
                                               "device tiers go on without it")
                self.stats.storage_write_seconds += time.perf_counter() - t0
            finally:
                self._queue.task_done()

    def wait(self) -> None:
        """Until every queued write is done (tests, benchmarks, shutdown, clear)."""
        self._queue.join()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def clear(self) -> None:
        """Drop this namespace's pages from storage (after the queued writes)."""
        self.wait()
        self._call("clear")

    # ------------------------------------------------------------------ reads
    def read(self, ids: list[int], start: int, max_pages: int,
             take_host: Callable[[int], list[int]], free_host: Callable[[list[int]], None]) -> list[int]:
        """Read the stored pages continuing ``ids[:start]`` (page-aligned) into host pages, at most
        ``max_pages``; returns the host pages filled, in order ([] when none). ``take_host(n)`` gives up
        to ``n`` host pages, ``free_host`` takes back unused ones."""
        ps = self.page_size
        if max_pages <= 0 or start + ps > len(ids) or is_adapter_key(ids[0]):  # (see ``backup``)
            return []
        t0 = time.perf_counter()
        deadline = None
        if self.prefetch_policy == "timeout":
            base, per_ki, most = PREFETCH_TIMEOUT
            deadline = t0 + min(base + per_ki * (len(ids) - start) / 1024, most)
        end = min(len(ids) // ps, start // ps + max_pages) * ps
        prev = page_hashes(ids[:start], ps)[-1:] or [""]
        keys = [self.key(h) for h in page_hashes(ids[start:end], ps, prev[0])]
        n = 0
        while n < len(keys) and self._call("exists", keys[n]):
            n += 1
        hit: list[int] = []
        if n:
            pages = take_host(n)
            values = []
            for key in keys[: len(pages)]:
                if deadline is not None and time.perf_counter() > deadline:
                    break
                v = self._call("get", key)
                if v is None or len(v) != self.page_bytes:
                    if v is not None:
                        self._warn_once("hicache.storage_bad_page", key=key, bytes=len(v), expected=self.page_bytes)
                    break
                values.append(v)
            hit, rest = pages[: len(values)], pages[len(values) :]
            free_host(rest)
            if hit:
                shape = (len(hit), 2 * len(self.host.k), ps, *self.host.k[0].view(torch.uint8).shape[1:])
                data = torch.frombuffer(bytearray(b"".join(values)), dtype=torch.uint8).view(shape)
                self.host.unpack(hit, data.transpose(0, 1).reshape(shape[1], len(hit) * ps, *shape[3:]))
                self.stats.bytes_from_storage += len(hit) * self.page_bytes
                self.stats.storage_hit_tokens += len(hit) * ps
        self.stats.storage_read_seconds += time.perf_counter() - t0
        return hit
