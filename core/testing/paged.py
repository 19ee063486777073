"""A small paged KV pool and batch builder for the suites, independent of the engine's scheduler.

Pages are handed out in a shuffled order, so a sequence's slots are scattered across the
pool as they are after a while of serving; slot 0 (the padding page) is never handed out.
"""

from __future__ import annotations

import random
from typing import Any

import attrs
import torch

from core.engine.mem_cache.kv_cache import allocate_kv_cache
from core.interfaces import ForwardBatch, KVCache


@attrs.define
class Seq:
    """One sequence: its KV slots (one per cached token) and token ids (for models)."""

    slots: list[int] = attrs.Factory(list)
    tokens: list[int] = attrs.Factory(list)

    @property
    def length(self) -> int:
        return len(self.slots)


class PagedPool:
    """``num_layers`` K/V buffers of ``num_pages * page_size`` slots, pages handed out shuffled."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 page_size: int, num_pages: int, seed: int = 0) -> None:
        self.page_size, self.device = page_size, device
        self.kv: KVCache = allocate_kv_cache(num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, device)
        for buf in (*self.kv.k, *self.kv.v):  # deterministic contents everywhere, padding page zero
            buf[page_size:].zero_()
        self._free = list(range(1, num_pages))
        random.Random(seed).shuffle(self._free)

    def grow(self, seq: Seq, n: int) -> list[int]:
        """Give ``seq`` slots for ``n`` more tokens (new pages as needed); returns the new slots."""
        new = []
        for pos in range(seq.length, seq.length + n):
            if pos % self.page_size == 0:
                if not self._free:
                    raise RuntimeError("test KV pool exhausted: raise num_pages")
                page = self._free.pop()
                seq.slots.append(page * self.page_size)
            else:
                seq.slots.append(seq.slots[-1] + 1)
            new.append(seq.slots[-1])
        return new

    def clone(self, dtype: torch.dtype | None = None) -> KVCache:
        """A copy of the pool (optionally cast), for a reference backend to write into."""
        cast = lambda t: t.to(dtype or t.dtype, copy=True)  # noqa: E731
        return KVCache(k=[cast(t) for t in self.kv.k], v=[cast(t) for t in self.kv.v], page_size=self.page_size)


def make_batch(seqs: list[Seq], new_tokens: list[int], backend: Any, device: torch.device,
               input_ids: list[int] | None = None) -> ForwardBatch:
    """The ForwardBatch for a step in which ``seqs[i]`` adds its last ``new_tokens[i]`` slots
    (already grown); sequences with 0 new tokens are left out by the caller."""
    seq_lens = [s.length for s in seqs]
    kmax = max(seq_lens)
    kv = torch.zeros(len(seqs), kmax, dtype=torch.int64)
    for i, s in enumerate(seqs):
        kv[i, : s.length] = torch.tensor(s.slots)
    out_loc = [slot for s, n in zip(seqs, new_tokens) for slot in s.slots[s.length - n:]]
    positions = [p for s, n in zip(seqs, new_tokens) for p in range(s.length - n, s.length)]
    ids = input_ids if input_ids is not None else [0] * len(out_loc)
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        out_cache_loc=torch.tensor(out_loc, dtype=torch.int64, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        extend_lens=torch.tensor(new_tokens, dtype=torch.int64, device=device),
        kv_indices=kv.to(device),
        seq_lens_cpu=seq_lens,
        extend_lens_cpu=list(new_tokens),
        attn_backend=backend,
    )


def batch_tensors(batch: ForwardBatch) -> dict[str, torch.Tensor]:
    """Copies of the batch's tensors, to check that ``prepare`` left them alone."""
    names = ("input_ids", "positions", "out_cache_loc", "seq_lens", "extend_lens", "kv_indices")
    return {n: getattr(batch, n).clone() for n in names}


# --------------------------------------------------------------------------- draft trees (plugin API 1.4)


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """``[n, n]`` bool: node i sees node j iff j is i or an ancestor of i (``parents[i]``: its
    parent, which precedes it; -1: a root, following the cached tokens)."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"node {i}'s parent {p} does not precede it")
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


def random_parents(n: int, gen: torch.Generator) -> list[int]:
    """A random tree of ``n`` nodes in batch order: node 0 the root, every other node's parent
    drawn among the nodes before it."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def chain_parents(n: int) -> list[int]:
    """A chain of ``n`` nodes (its ancestor mask is the causal lower triangle)."""
    return list(range(-1, n - 1))


def make_tree_batch(seqs: list[Seq], parents: list[list[int]], backend: Any, device: torch.device,
                    input_ids: list[int] | None = None) -> ForwardBatch:
    """:func:`make_batch` for a verify of draft trees: ``seqs[i]``'s last ``len(parents[i])`` slots
    (already grown) hold the nodes of tree ``parents[i]`` in order; ``positions`` are the cached
    length plus each node's depth, ``tree_mask`` the trees' ancestor masks, flattened and
    concatenated (``ForwardBatch.tree_mask``)."""
    masks = [ancestor_mask(p) for p in parents]
    batch = make_batch(seqs, [len(p) for p in parents], backend, device, input_ids)
    pos = [s.length - len(p) + depth for s, p, m in zip(seqs, parents, masks) for depth in (m.sum(1) - 1).tolist()]
    batch.positions = torch.tensor(pos, dtype=torch.int64, device=device)
    batch.tree_mask = torch.cat([m.flatten() for m in masks]).to(device)
    return batch
