"""Schedule policies: the order in which waiting requests are considered for admission.

SGLang's ``--schedule-policy`` values. ``fcfs`` keeps arrival order (retracted requests
are re-queued at the front); ``lof`` puts the longest requested output first; ``random``
is a seeded shuffle. The cache-aware ones read the radix cache: ``lpm`` puts the longest
cached prefix first (HiCache's host tier counts: its prefixes load back instead of prefilling), ``dfs-weight`` walks the tree depth-first, heavier subtrees (more
waiting requests under them) first, so requests sharing a prefix run together. Without
the cache, or with a queue longer than ``LPM_MAX_QUEUE`` (matching every request would
cost more than it saves), they fall back to fcfs, as SGLang does.

With ``--enable-priority-scheduling`` the request field ``priority`` sorts first (higher
values first, or lower with ``--schedule-low-priority-values-first``); the policy orders
requests of equal priority.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from core.engine.mem_cache.radix_cache import RadixCache
    from core.engine.request import Req

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random")
RETRACTION_POLICIES = ("length", "priority")  # --retraction-policy (SGLang's)
LPM_MAX_QUEUE = 128  # longer queues fall back to fcfs for the cache-aware policies

# (req) -> (tokens of its prefix cached in any tier, the radix node where its device match ends)
PrefixMatch = Callable[["Req"], tuple[int, Any]]


class SchedulePolicy:
    """Orders the waiting queue; sets ``Req.prefix_len`` of the requests it matched."""

    def __init__(self, name: str, tree_cache: RadixCache | None = None, *, enable_priority: bool = False,
                 low_priority_values_first: bool = False, seed: int = 0, retraction: str = "length") -> None:
        if name not in SCHEDULE_POLICIES:
            raise ValueError(f"unknown schedule policy {name!r}; choose one of {', '.join(SCHEDULE_POLICIES)}")
        if retraction not in RETRACTION_POLICIES:
            raise ValueError(f"unknown retraction policy {retraction!r}; choose one of {', '.join(RETRACTION_POLICIES)}")
        self.name, self.retraction = name, retraction
        self.tree_cache = tree_cache
        self.enable_priority = enable_priority
        self.priority_sign = 1 if low_priority_values_first else -1
        self.rng = random.Random(seed)

    def retraction_victim(self, candidates: list[Req]) -> Req:
        """The running request to retract first when a decode runs out of pages (``--retraction-policy``,
        SGLang's orders): ``length``, the one with the fewest output tokens, then the longest prompt
        (the least decoding lost, the most pages freed); ``priority``, the least important first (one
        without a priority least of all), then as ``length``. Ties: the first of ``candidates``."""
        def key(r: Req) -> tuple:
            length = (-len(r.output_ids), len(r.prompt_ids))
            if self.retraction == "length":
                return length
            return ((1, 0) if r.priority is None else (0, self.priority_sign * r.priority), *length)

        return max(candidates, key=key)

    def order(self, queue: list[Req], match: PrefixMatch) -> list[Req]:
        """``queue`` (in arrival order) in the order to admit it; ``match`` finds a request's cached prefix."""
        if len(queue) < 2:
            return list(queue)
        q = list(queue)
        policy = self.name
        cache_aware = policy in ("lpm", "dfs-weight")
        if cache_aware and (self.tree_cache is None or len(q) > LPM_MAX_QUEUE):
            policy = "fcfs"
        # (a request without a priority after every one with, as SGLang; --default-priority-value gives it one)
        prio = ((lambda r: (0, self.priority_sign * r.priority) if r.priority is not None else (1, 0))
                if self.enable_priority else (lambda r: 0))
        nodes: dict[int, Any] = {}
        if cache_aware and policy != "fcfs":
            for r in q:
                r.prefix_len, nodes[id(r)] = match(r)
        if policy == "fcfs":
            if self.enable_priority:
                q.sort(key=prio)  # stable: queue order (arrival, retracted first) within a priority
        elif policy == "lpm":
            q.sort(key=lambda r: (prio(r), -r.prefix_len))
        elif policy == "lof":
            q.sort(key=lambda r: (prio(r), -r.params.max_new_tokens))
        elif policy == "random":
            self.rng.shuffle(q)
            q.sort(key=prio)
        elif policy == "dfs-weight":
            q = self._dfs_weight(q, nodes)
            q.sort(key=prio)
        return q

    def _dfs_weight(self, q: list[Req], nodes: dict[int, Any]) -> list[Req]:
        """Depth-first over the radix tree, the subtree with more waiting requests first."""
        root = self.tree_cache.root
        at: dict[int, list[Req]] = {}
        weight: dict[int, int] = {}
        for r in q:
            node = nodes[id(r)] or root
            at.setdefault(id(node), []).append(r)
            while node is not None:
                weight[id(node)] = weight.get(id(node), 0) + 1
                node = node.parent
        out: list[Req] = []
        stack = [root]
        while stack:
            node = stack.pop()
            out += at.get(id(node), [])
            kids = sorted((c for c in node.children.values() if id(c) in weight), key=lambda c: weight[id(c)])
            stack.extend(kids)  # heaviest popped first
        return out
