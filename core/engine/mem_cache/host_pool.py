"""HiCache's host tier: a KV pool in host memory with its own page allocator, and the copies
between it and the device pool (``KVCache``).

Same geometry and dtype as the device pool (one K and one V buffer per layer, ``[slots, Hkv, D]``,
``page_size`` slots a page), so a page moves with one index copy per buffer. The layout is the
same whatever ``--hicache-mem-layout`` says (SGLang's layouts serve its GPU transfer kernels; here a
copy is a torch index copy). Host page ids are ints handed to the radix tree (``TreeNode.host``);
the tensors stay here."""

from __future__ import annotations

import concurrent.futures
import time
from typing import Callable

import attrs
import torch

from core.engine.mem_cache.kv_cache import PageAllocator, copy_rows
from core.interfaces import KVCache


class HostKVPool:
    def __init__(self, device: KVCache, num_pages: int) -> None:
        ps = device.page_size
        self.device, self.page_size = device, ps
        # page 0 unused (PageAllocator keeps it as padding): num_pages usable pages
        self.allocator = PageAllocator(num_pages + 1, ps)
        k0 = device.k[0]
        pin = k0.device.type == "cuda"  # pinned host memory for asynchronous-capable copies on a GPU

        def buf() -> torch.Tensor:
            return torch.empty(((num_pages + 1) * ps, *k0.shape[1:]), dtype=k0.dtype, pin_memory=pin)

        self.k = [buf() for _ in device.k]
        self.v = [buf() for _ in device.v]
        self.bytes_per_page = 2 * len(self.k) * ps * k0[0].numel() * k0.element_size()
        self._offsets = torch.arange(ps, dtype=torch.int64)
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None  # backup_later's thread, started on first use
        self._side: torch.cuda.Stream | None = None  # its CUDA stream (a GPU pool)
        self._load_stream: torch.cuda.Stream | None = None  # KVLoads' CUDA stream
        self._queued: list[tuple[list[int], list[int]]] = []  # load_later's (host pages, device pages), not yet issued
        self.load_seconds = 0.0  # host time spent issuing loads (KVLoads.issue), for the metrics

    @property
    def capacity(self) -> int:
        """Usable host pages."""
        return self.allocator.capacity

    def reset(self) -> None:
        """Every host page free (the tree that held them was emptied); queued loads dropped."""
        self.allocator._free = list(range(self.allocator.num_pages - 1, 0, -1))
        self._queued.clear()

    def load_later(self, host_pages: list[int], device_pages: list[int]) -> int:
        """Queue ``load``: the next batch built takes it (``take_loads``) and the model runner issues
        it as that batch's forward starts, after every forward before it (which may still write
        device pages freed since); returns the bytes it will move."""
        self._queued.append((list(host_pages), list(device_pages)))
        return len(host_pages) * self.bytes_per_page

    def cancel_loads(self, device_pages: list[int]) -> None:
        """Drop the queued loads into ``device_pages`` (evicted before any batch took them: their
        pages may be handed out again, and a late copy would overwrite the new owner's KV)."""
        if self._queued and device_pages:  # page by page: a load may span nodes, some of them still held
            gone = set(device_pages)
            kept = [[(hp, dp) for hp, dp in zip(h, d) if dp not in gone] for h, d in self._queued]
            self._queued = [([hp for hp, _ in k], [dp for _, dp in k]) for k in kept if k]

    def take_loads(self) -> KVLoads | None:
        """The queued loads, for the batch being built (None: none)."""
        if not self._queued:
            return None
        queued, self._queued = self._queued, []
        host = [p for h, _ in queued for p in h]
        dev = [p for _, d in queued for p in d]
        cpu = torch.device("cpu")  # (index tensors go to a GPU inside issue: never a blocking copy on this thread)
        return KVLoads(self, self._slots(host, cpu), self._slots(dev, cpu))

    def _slots(self, pages: list[int], device: torch.device) -> torch.Tensor:
        idx = torch.tensor(pages, dtype=torch.int64)
        if self.page_size > 1:
            idx = (idx[:, None] * self.page_size + self._offsets).flatten()
        return idx.to(device)

    def backup(self, device_pages: list[int], host_pages: list[int]) -> int:
        """Copy device pages into host pages (same order); returns the bytes moved."""
        return self._copy(self.device.k, self.device.v, device_pages, self.k, self.v, host_pages)

    def backup_later(self, device_pages: list[int], host_pages: list[int],
                     then: Callable[[], None] | None = None) -> concurrent.futures.Future:
        """``backup`` on a writer thread, off the step's path, then ``then()`` there; the future
        gives the seconds it took. Until it is done the caller keeps ``device_pages`` as they are
        (never freed, never rewritten) and reads nothing from ``host_pages``. On a GPU the copy
        runs on its own stream after the work queued so far (which wrote those pages)."""
        if self._writer is None:
            self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="core-hicache-writer")
        ready = None
        if self.device.k[0].device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device.k[0].device))
        cpu = torch.device("cpu")  # (the device's index copy is the writer's: a blocking copy here would wait for the forwards)
        return self._writer.submit(self._backup_job, self._slots(device_pages, cpu), self._slots(host_pages, cpu), ready, then)

    def _backup_job(self, src: torch.Tensor, dst: torch.Tensor, ready: torch.cuda.Event | None,
                    then: Callable[[], None] | None) -> float:
        t0 = time.perf_counter()
        if ready is None:
            copy_rows([*self.device.k, *self.device.v], src, [*self.k, *self.v], dst)
        else:  # gathered on the side stream into pinned memory, then scattered into the pool's pages here
            if self._side is None:
                self._side = torch.cuda.Stream(self.device.k[0].device)
            with torch.no_grad(), torch.cuda.stream(self._side):
                self._side.wait_event(ready)
                src = src.to(self.device.k[0].device)
                staged = [b.view(torch.uint8).index_select(0, src).to("cpu", non_blocking=True)
                          for b in (*self.device.k, *self.device.v)]
                self._side.synchronize()
                for b, rows in zip((*self.k, *self.v), staged):
                    b.view(torch.uint8).index_copy_(0, dst, rows)
        if then is not None:
            then()
        return time.perf_counter() - t0

    def close(self) -> None:
        """Finish the queued backups and stop the writer thread."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None

    def load(self, host_pages: list[int], device_pages: list[int]) -> int:
        """Copy host pages back into device pages (same order); returns the bytes moved."""
        return self._copy(self.k, self.v, host_pages, self.device.k, self.device.v, device_pages)

    def pack(self, host_pages: list[int]) -> torch.Tensor:
        """A copy of host pages' KV as bytes, ``[2 * layers, pages * page_size, Hkv, D * itemsize]`` uint8
        (K of every layer, then V): page ``j`` is ``[:, j * page_size:(j + 1) * page_size]``."""
        idx = self._slots(host_pages, torch.device("cpu"))
        with torch.no_grad():
            return torch.stack([b.view(torch.uint8).index_select(0, idx) for b in (*self.k, *self.v)])

    def unpack(self, host_pages: list[int], data: torch.Tensor) -> None:
        """Write ``data`` (as ``pack`` gives it) into host pages."""
        idx = self._slots(host_pages, torch.device("cpu"))
        with torch.no_grad():
            for b, d in zip((*self.k, *self.v), data):
                b.view(torch.uint8).index_copy_(0, idx, d)

    def _copy(self, src_k: list[torch.Tensor], src_v: list[torch.Tensor], src_pages: list[int],
              dst_k: list[torch.Tensor], dst_v: list[torch.Tensor], dst_pages: list[int]) -> int:
        assert len(src_pages) == len(dst_pages)
        if not src_pages:
            return 0
        copy_rows([*src_k, *src_v], self._slots(src_pages, src_k[0].device), [*dst_k, *dst_v],
                  self._slots(dst_pages, dst_k[0].device))
        return len(src_pages) * self.bytes_per_page


@attrs.define(eq=False)
class KVLoads:
    """A batch's load-backs (HiCache), issued by the model runner as its forward starts (``issue``).
    On the CPU a copy before the forward. On a GPU each layer's K and V go to the device on a
    stream of their own, each layer with an event: the forward waits for layer ``l``'s only where
    that layer's attention reads the pool (``ForwardBatch.layer_ready``), so the first layers
    compute while the later ones land. Host slots in a few contiguous runs (pages allocated
    together) are copied straight from the pinned pool; others are gathered into pinned memory first."""

    pool: HostKVPool
    host_slots: torch.Tensor  # int64, on the CPU
    device_slots: torch.Tensor  # int64, on the CPU (issue moves them to a GPU on the load stream)
    events: list = attrs.field(factory=list)  # per layer, once issued on a GPU
    device: torch.device | None = None  # the GPU they were issued on
    issued: bool = False  # the copies are made (CPU) or queued on the device (GPU)

    def issue(self) -> KVLoads:
        t0 = time.perf_counter()
        pool, dev = self.pool, self.pool.device
        if dev.k[0].device.type != "cuda":
            copy_rows([*pool.k, *pool.v], self.host_slots, [*dev.k, *dev.v], self.device_slots)
        else:
            self._issue_cuda()
        pool.load_seconds += time.perf_counter() - t0
        self.issued = True
        return self

    def _issue_cuda(self) -> None:
        pool, dev = self.pool, self.pool.device
        device = dev.k[0].device
        if pool._load_stream is None:
            pool._load_stream = torch.cuda.Stream(device)
        stream, self.device = pool._load_stream, device
        stream.wait_stream(torch.cuda.current_stream(device))  # (the forwards before this batch are all queued)
        runs = _runs(self.host_slots)
        with torch.no_grad(), torch.cuda.stream(stream):
            dst_slots = self.device_slots.pin_memory().to(device, non_blocking=True)
            for l in range(len(dev.k)):
                for src, dst in ((pool.k[l], dev.k[l]), (pool.v[l], dev.v[l])):
                    s = src.view(torch.uint8)
                    if len(runs) <= MAX_DIRECT_RUNS:  # straight from the pinned pool, run by run
                        parts = [s[a:b].to(device, non_blocking=True) for a, b in runs]
                        rows = parts[0] if len(parts) == 1 else torch.cat(parts)
                    else:  # gathered here (the forward thread) into pinned memory, then one copy
                        staged = torch.empty((len(self.host_slots), *s.shape[1:]), dtype=s.dtype, pin_memory=True)
                        rows = torch.index_select(s, 0, self.host_slots, out=staged).to(device, non_blocking=True)
                    dst.view(torch.uint8).index_copy_(0, dst_slots, rows)
                event = torch.cuda.Event()
                event.record(stream)
                self.events.append(event)

    def wait_layer(self, layer: int) -> None:
        """Before layer ``layer``'s attention reads the pool: the current stream waits for its KV."""
        if self.events:
            torch.cuda.current_stream(self.device).wait_event(self.events[layer])

    def wait_all(self) -> None:
        """Before a forward that reads the pool without ``layer_ready`` (a CUDA graph, a model's own attention)."""
        if self.events:
            torch.cuda.current_stream(self.device).wait_event(self.events[-1])


MAX_DIRECT_RUNS = 16  # more runs of host slots than this: one gather into pinned memory instead


def _runs(slots: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) runs of consecutive values in ``slots`` (in order)."""
    if slots.numel() == 0:
        return []
    breaks = (torch.nonzero(slots[1:] != slots[:-1] + 1).flatten() + 1).tolist()
    starts = [0, *breaks]
    ends = [*breaks, slots.numel()]
    return [(int(slots[a]), int(slots[b - 1]) + 1) for a, b in zip(starts, ends)]
