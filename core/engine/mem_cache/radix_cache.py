"""Radix prefix cache (SGLang's RadixAttention): a tree over token ids whose nodes own KV pages.

Each edge holds a run of token ids whose length is a multiple of the page size, and
the pages that hold their keys and values (one page per ``page_size`` tokens), so a
match always ends on a page boundary and pages are shared whole. A request matches
the longest cached prefix of its tokens (``match_prefix``), locks the path it uses
(``inc_lock_ref``) so nothing under it is evicted, and on finishing (or after a
prefill) inserts its own tokens (``insert``) and unlocks. Unlocked nodes are
*evictable*: when the pool runs low, ``evict`` drops leaves in LRU (or LFU) order and
returns their pages to the caller, which owns the allocator.

Pure bookkeeping over ints: no tensors, no allocator. Every page held by the tree is
either ``evictable`` (no running request uses it) or ``protected`` (locked).

Tiers (``core.engine.mem_cache.hierarchical``): a node's ``pages`` are its device pages, ``host``
its pages in the host pool ([] when none). A node whose device pages were evicted keeps its key
and its host pages, with ``pages == []``; the device-resident nodes always form a subtree at the
root, so a match stops at the first node that is not on the device. This class never evicts to a
lower tier itself; it only keeps such nodes consistent (``_split``, ``insert``, ``check``).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Iterator

EVICTION_POLICIES = ("lru", "lfu")


class TreeNode:
    __slots__ = ("key", "pages", "host", "parent", "children", "lock_ref", "last_access", "hit_count", "id", "writing")
    _ids = itertools.count()

    def __init__(self, key: list[int], pages: list[int], parent: TreeNode | None) -> None:
        self.key, self.pages, self.parent = key, pages, parent
        self.host: list[int] = []  # pages in the host tier (core.engine.mem_cache), [] when none
        self.writing = None  # a backup to the host tier still reading ``pages`` (a Future), or None
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.hit_count = 0
        self.id = next(TreeNode._ids)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, tokens={len(self.key)}, lock_ref={self.lock_ref})"


class RadixCache:
    def __init__(self, page_size: int = 1, eviction_policy: str = "lru") -> None:
        if eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"unknown radix eviction policy {eviction_policy!r}; choose one of {', '.join(EVICTION_POLICIES)}")
        self.page_size = page_size
        self.eviction_policy = eviction_policy
        self._clock = itertools.count(1)
        self.reset()

    def reset(self) -> list[int]:
        """Empty the tree; returns every page it held (the caller frees them). Refused while locked."""
        old = getattr(self, "root", None)
        if old is not None and self.protected_pages:
            raise RuntimeError("cannot reset the radix cache while requests hold locks on it")
        pages = [] if old is None else [p for n in self._nodes() for p in n.pages]
        self.root = TreeNode([], [], None)
        self.root.lock_ref = 1  # never evicted
        self.evictable_pages = 0
        self.protected_pages = 0
        # counters for the hit rate (tokens), fed by the scheduler once per admitted prefill
        self.hit_tokens = 0
        self.query_tokens = 0
        return pages

    # ------------------------------------------------------------------ queries
    @property
    def total_pages(self) -> int:
        return self.evictable_pages + self.protected_pages

    @property
    def evictable_size(self) -> int:
        """Tokens held by unlocked nodes (SGLang's name)."""
        return self.evictable_pages * self.page_size

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def record(self, hit: int, total: int) -> None:
        self.hit_tokens += hit
        self.query_tokens += total

    def all_pages(self) -> list[int]:
        return [p for n in self._nodes() for p in n.pages]

    def _nodes(self) -> Iterator[TreeNode]:
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def _child_key(self, ids: list[int], i: int) -> tuple[int, ...]:
        return tuple(ids[i : i + self.page_size])

    def _match_len(self, key: list[int], ids: list[int], i: int) -> int:
        """Tokens of ``key`` matching ``ids[i:]``, in whole pages."""
        ps, n = self.page_size, min(len(key), len(ids) - i)
        m = 0
        while m + ps <= n and key[m : m + ps] == ids[i + m : i + m + ps]:
            m += ps
        return m

    def match_prefix(self, ids: list[int], load_back: bool = False) -> tuple[list[int], TreeNode]:
        """The pages of the longest cached page-aligned prefix of ``ids`` and the node it ends at.

        A match ending inside an edge splits it, so the returned node covers exactly the match.
        ``load_back`` (the match that admits a request) matters only to a tiered cache
        (``mem_cache.hierarchical``): there, host-resident nodes continuing the match are loaded first."""
        node, pages = self.root, []
        for node in self.walk(self.root, ids, 0, on_device=True):
            pages += node.pages
        return pages, node

    def cached(self, ids: list[int]) -> tuple[int, TreeNode]:
        """(tokens of ``ids``'s longest cached prefix, the node where its device match ends): what the
        cache-aware queue orders rank by. A tiered cache also counts its lower tiers' continuation."""
        pages, node = self.match_prefix(ids)
        return len(pages) * self.page_size, node

    def walk(self, node: TreeNode, ids: list[int], i: int, on_device: bool) -> Iterator[TreeNode]:
        """The nodes below ``node`` matching the page-aligned ``ids[i:]`` whose KV is on the device
        (``on_device``), or is not (a lower tier's, see mem_cache), each touched as used; a match
        ending inside an edge splits it, so the last node covers exactly the match."""
        ids = ids[: len(ids) // self.page_size * self.page_size]
        now = next(self._clock)
        while i < len(ids):
            child = node.children.get(self._child_key(ids, i))
            if child is None or bool(child.pages) != on_device:
                return
            m = self._match_len(child.key, ids, i)
            partial = m < len(child.key)
            if partial:
                child = self._split(child, m)
            child.last_access = now
            child.hit_count += 1
            yield child
            node, i = child, i + m
            if partial:
                return

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Split ``child`` after ``m`` tokens; returns the new upper node (which keeps child's lock)."""
        ps = self.page_size
        upper = TreeNode(child.key[:m], child.pages[: m // ps], child.parent)
        upper.lock_ref, upper.last_access, upper.hit_count = child.lock_ref, child.last_access, child.hit_count
        upper.host, child.host = child.host[: m // ps], child.host[m // ps :]
        upper.writing = child.writing  # (both halves' pages are in that copy)
        child.parent.children[self._child_key(child.key, 0)] = upper
        child.key, child.pages, child.parent = child.key[m:], child.pages[m // ps :], upper
        upper.children[self._child_key(child.key, 0)] = child
        return upper

    # ------------------------------------------------------------------ updates
    def insert(self, ids: list[int], pages: list[int]) -> int:
        """Insert ``ids`` (page-aligned) with their ``pages``; returns how many leading tokens were
        already cached: the caller's pages for those are duplicates it must free (unless they are
        the very pages the tree holds, i.e. the prefix it matched).

        A node no longer on the device (its KV in a lower tier only) takes the caller's pages for
        its tokens: those, and everything after them, are the tree's then, so the count returned
        stops before the first such node."""
        ps = self.page_size
        assert len(ids) % ps == 0 and len(pages) == len(ids) // ps, (len(ids), len(pages), ps)
        node, i, adopted = self.root, 0, None
        now = next(self._clock)
        while i < len(ids):
            child = node.children.get(self._child_key(ids, i))
            if child is None:
                new = TreeNode(ids[i:], pages[i // ps :], node)
                new.last_access = now
                node.children[self._child_key(ids, i)] = new
                self.evictable_pages += len(new.pages)  # a new leaf is unlocked
                self._inserted(new)
                return i if adopted is None else adopted
            m = self._match_len(child.key, ids, i)
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = now
            if not child.pages:  # evicted to a lower tier: the caller's pages bring it back
                child.pages = pages[i // ps : (i + m) // ps]
                if child.lock_ref:
                    self.protected_pages += len(child.pages)
                else:
                    self.evictable_pages += len(child.pages)
                adopted = i if adopted is None else adopted
                self._inserted(child)
            node, i = child, i + m
        return i if adopted is None else adopted

    def take_loads(self) -> object:
        """The KV copies into device pages queued since the last call (a tiered cache's
        load-backs), for the batch being built to carry; None: none."""
        return None

    def _inserted(self, node: TreeNode) -> None:
        """Called for each node ``insert`` creates or brings back to the device (a tiered cache's hook)."""

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
                self.protected_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "radix lock underflow"
            if node.lock_ref == 1:
                self.evictable_pages += len(node.pages)
                self.protected_pages -= len(node.pages)
            node.lock_ref -= 1
            node = node.parent

    def evict(self, num_pages: int) -> list[int]:
        """Drop unlocked leaves, least recently (or least frequently) used first, until at least
        ``num_pages`` pages are freed or nothing evictable is left; returns the freed pages."""
        if num_pages <= 0:
            return []
        freed: list[int] = []
        for n in self.eviction_order(lambda n: not n.children and n.lock_ref == 0):
            if len(freed) >= num_pages:
                break
            freed += n.pages
            self.evictable_pages -= len(n.pages)
            del n.parent.children[self._child_key(n.key, 0)]
        return freed

    def eviction_order(self, leaf: Callable[[TreeNode], bool]) -> Iterator[TreeNode]:
        """The nodes ``leaf`` holds evictable, least recently (or least frequently) used first; once
        the caller has dealt with one, its parent follows in its turn where ``leaf`` now holds it."""
        def prio(n: TreeNode) -> tuple:
            return (n.last_access, n.id) if self.eviction_policy == "lru" else (n.hit_count, n.last_access, n.id)

        heap = [(prio(n), n.id, n) for n in self._nodes() if leaf(n)]
        heapq.heapify(heap)
        while heap:
            n = heapq.heappop(heap)[2]
            yield n
            if (parent := n.parent) is not self.root and leaf(parent):
                heapq.heappush(heap, (prio(parent), parent.id, parent))

    # ------------------------------------------------------------------ debugging
    def check(self) -> None:
        """Assert the counters agree with the tree (used by tests)."""
        ev = pr = 0
        for n in self._nodes():
            assert n.key and len(n.key) == len(n.pages or n.host) * self.page_size, n
            assert n.parent.children[self._child_key(n.key, 0)] is n
            assert n.pages or not n.lock_ref, ("a locked node is not on the device", n)
            if n.pages:  # the device-resident nodes form a subtree at the root
                assert n.parent is self.root or n.parent.pages, ("device node under an evicted one", n)
            if n.lock_ref:
                pr += len(n.pages)
            else:
                ev += len(n.pages)
        assert (ev, pr) == (self.evictable_pages, self.protected_pages), ((ev, pr), (self.evictable_pages, self.protected_pages))
