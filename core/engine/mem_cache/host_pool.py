"""HiCache's host tier: a KV pool in host memory with its own page allocator, and the copies
between it and the device pool (``KVCache``).

Same geometry and dtype as the device pool (one K and one V buffer per layer, ``[slots, Hkv, D]``,
``page_size`` slots a page), so a page moves with one index copy per buffer. The layout is the
same whatever ``--hicache-mem-layout`` says (SGLang's layouts serve its GPU transfer kernels; here a
copy is a torch index copy). Host page ids are ints handed to the radix tree (``TreeNode.host``);
the tensors stay here."""

from __future__ import annotations

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

    @property
    def capacity(self) -> int:
        """Usable host pages."""
        return self.allocator.capacity

    def reset(self) -> None:
        """Every host page free (the tree that held them was emptied)."""
        self.allocator._free = list(range(self.allocator.num_pages - 1, 0, -1))

    def _slots(self, pages: list[int], device: torch.device) -> torch.Tensor:
        idx = torch.tensor(pages, dtype=torch.int64)
        if self.page_size > 1:
            idx = (idx[:, None] * self.page_size + self._offsets).flatten()
        return idx.to(device)

    def backup(self, device_pages: list[int], host_pages: list[int]) -> int:
        """Copy device pages into host pages (same order); returns the bytes moved."""
        return self._copy(self.device.k, self.device.v, device_pages, self.k, self.v, host_pages)

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
