"""Which data-parallel replica serves a request (``--load-balance-method``).

- ``round_robin``: the live replicas in turn (SGLang's default).
- ``shortest_queue``: the replica with the fewest unfinished requests (counted by the front
  end, so exact at the moment of choosing); ties go to the next one in turn.
- ``prefix``: the replica that was sent the longest prefix of this prompt, so its radix cache
  likely still holds it (SGLang router's cache-aware policy, over token ids). Prompts are cut
  into blocks of ``PREFIX_BLOCK`` tokens, each identified by a chained hash of every token up
  to its end; each replica remembers the last ``PREFIX_CAPACITY`` blocks it was sent (LRU).
  With no block in common, or when the loads are too far apart (more than
  ``BALANCE_ABS`` requests and ``BALANCE_REL`` times), it falls back to ``shortest_queue``.

Pure bookkeeping on the front end's event loop: no I/O, no locks.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from core.engine.config import LOAD_BALANCE_METHODS
from core.errors import CoreError

PREFIX_BLOCK = 16
PREFIX_CAPACITY = 1 << 16  # blocks remembered per replica (~1M prompt tokens)
BALANCE_ABS = 32
BALANCE_REL = 1.5


class Router:
    """Picks a live replica per request; ``remove`` takes a dead one out of rotation."""

    def __init__(self, num_replicas: int, method: str, block: int = PREFIX_BLOCK, capacity: int = PREFIX_CAPACITY) -> None:
        if method not in LOAD_BALANCE_METHODS:
            raise CoreError(f"--load-balance-method {method!r} is not one of {', '.join(LOAD_BALANCE_METHODS)}")
        self.method, self.block, self.capacity = method, block, capacity
        self.live = list(range(num_replicas))
        self._next = 0
        self._blocks: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]

    def remove(self, replica: int) -> None:
        if replica in self.live:
            self.live.remove(replica)
            self._blocks[replica].clear()

    def pick(self, prompt_ids: Sequence[int], inflight: Sequence[int]) -> int:
        """The replica for a prompt, given each replica's unfinished requests (indexed by replica)."""
        if not self.live:
            raise CoreError("no data-parallel replica is alive")
        if self.method == "round_robin":
            choice = self._turn(self.live)
        elif self.method == "shortest_queue":
            choice = self._shortest(inflight)
        else:
            choice = self._by_prefix(prompt_ids, inflight)
        return choice

    def next(self) -> int:
        """The next live replica in turn (for work that is not a prompt, e.g. embeddings)."""
        if not self.live:
            raise CoreError("no data-parallel replica is alive")
        return self._turn(self.live)

    def _turn(self, candidates: list[int]) -> int:
        """The first candidate at or after the rotation point, which then moves past it."""
        ordered = sorted(candidates, key=lambda r: (r < self._next, r))
        choice = ordered[0]
        self._next = choice + 1
        return choice

    def _shortest(self, inflight: Sequence[int]) -> int:
        least = min(inflight[r] for r in self.live)
        return self._turn([r for r in self.live if inflight[r] == least])

    def _by_prefix(self, prompt_ids: Sequence[int], inflight: Sequence[int]) -> int:
        hashes = self.block_hashes(prompt_ids)
        loads = [inflight[r] for r in self.live]
        balanced = not (max(loads) - min(loads) > BALANCE_ABS and max(loads) > BALANCE_REL * min(loads))
        best, best_len = -1, 0
        if balanced:
            for r in self.live:
                n = self._matched(r, hashes)
                if n > best_len or (n == best_len and n and inflight[r] < inflight[best]):
                    best, best_len = r, n
        choice = best if best_len else self._shortest(inflight)
        self._remember(choice, hashes)
        return choice

    def block_hashes(self, prompt_ids: Sequence[int]) -> list[int]:
        """One hash per whole block of the prompt, each covering every token up to its end."""
        out, h, b = [], 0, self.block
        for i in range(0, len(prompt_ids) - b + 1, b):
            h = hash((h, tuple(prompt_ids[i : i + b])))
            out.append(h)
        return out

    def _matched(self, replica: int, hashes: list[int]) -> int:
        """Leading blocks of ``hashes`` the replica was sent."""
        seen, n = self._blocks[replica], 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        return n

    def _remember(self, replica: int, hashes: list[int]) -> None:
        seen = self._blocks[replica]
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)
