"""LoRA adapters served by several engine replicas (``--dp-size`` > 1): the front end's registry.

Each replica process runs its own ``LoRAServing`` (pool, manager, slots); the front end holds no
model, so it keeps the names, resolves them for requests (a 400 naming an unknown adapter before
anything is routed) and sends the name with each request, which the replica resolves to its own
uid. Loads and unloads reach every live replica. Past ``--max-loaded-loras`` the front end picks
the adapter to evict (least recently named, neither pinned nor named by a request still in
flight) and unloads it everywhere once the new one loaded; the replicas run without the limit,
so their own managers never choose: each one's last-used order only sees the requests routed to
it, and they would disagree.
"""

from __future__ import annotations

import itertools
from typing import Any, Awaitable, Callable

import attrs
import structlog

from core.engine.lora.adapter import LoRAError
from core.engine.lora.serving import check_max_loaded, parse_lora_paths

log = structlog.get_logger("core.engine.lora")

# (what, *args) -> each live replica's reply or the exception it raised, in replica order
CallAll = Callable[..., Awaitable[list[Any]]]


@attrs.define
class _Entry:
    path: str
    pinned: bool
    uid: int
    last_used: int


class ReplicatedAdapters:
    """``LoRAServing``'s front-end side (``adapters``, ``resolve``, ``load``, ``unload``) over replicas."""

    def __init__(self, args: Any, call_all: CallAll, in_use: Callable[[], set[int]]) -> None:
        self._call_all, self._in_use = call_all, in_use
        check_max_loaded(args)  # (the replicas run without the limit: checked here)
        self.max_loaded: int | None = args.max_loaded_loras
        initial = parse_lora_paths(args.lora_paths)
        if self.max_loaded is not None and len(initial) > self.max_loaded:
            raise LoRAError(f"--lora-paths names {len(initial)} adapters, more than --max-loaded-loras "
                            f"({self.max_loaded}); raise it or load fewer at start")
        self._uids, self._clock = itertools.count(1), itertools.count(1)
        self._entries: dict[str, _Entry] = {}
        for name, path, pinned in initial:  # (the replicas load them as they start)
            self._record(name, path, pinned)

    def adapters(self) -> dict[str, str]:
        """Loaded adapter name -> path (what ``/v1/models`` lists)."""
        return {n: e.path for n, e in self._entries.items()}

    def resolve(self, name: str | None) -> int:
        """The front end's uid of adapter ``name`` (0: the base model), marked recently used."""
        if not name:
            return 0
        entry = self._entry(name)
        entry.last_used = next(self._clock)
        return entry.uid

    def name_of(self, uid: int) -> str | None:
        """The loaded adapter whose uid a request resolved (its name goes to the replica, which has
        its own uids); None once that adapter was unloaded, even if one of the same name came since."""
        return next((n for n, e in self._entries.items() if e.uid == uid), None)

    async def load(self, name: str, path: str, pinned: bool = False) -> None:
        """Load ``name`` on every replica, or on none: a replica's refusal (a bad checkpoint, a rank
        over the pool's) unloads it from those that took it, and is raised."""
        if not name:
            raise LoRAError("a LoRA adapter needs a non-empty name")
        if name in self._entries:
            raise LoRAError(f"LoRA adapter {name!r} is already loaded; remove it first or choose another name")
        victim = None
        if self.max_loaded is not None and len(self._entries) >= self.max_loaded:
            busy = self._in_use()
            victims = [(e.last_used, n) for n, e in self._entries.items() if not (e.pinned or e.uid in busy)]
            if not victims:
                raise LoRAError(f"cannot load LoRA adapter {name!r}: {self.max_loaded} adapters are loaded (the "
                                "maximum) and each is pinned or in use; remove one or raise --max-loaded-loras")
            victim = min(victims)[1]
        replies = await self._call_all("load_lora", name, path, pinned)
        if errors := [r for r in replies if isinstance(r, BaseException)]:
            if len(errors) < len(replies):
                await self._call_all("unload_lora", name)
            raise errors[0]
        self._record(name, path, pinned)
        if victim is not None and victim in self._entries:  # (after the load: a refused one evicts nothing)
            log.info("lora.evicted", name=victim, by=name)
            await self.unload(victim)

    async def unload(self, name: str) -> None:
        """Stop serving ``name`` on every replica: new requests cannot name it, running ones finish."""
        self._entry(name)
        del self._entries[name]  # (first: requests resolved from now on are refused here)
        if errors := [r for r in await self._call_all("unload_lora", name) if isinstance(r, BaseException)]:
            raise errors[0]

    def _record(self, name: str, path: str, pinned: bool) -> None:
        self._entries[name] = _Entry(path, pinned, next(self._uids), next(self._clock))

    def _entry(self, name: str) -> _Entry:
        entry = self._entries.get(name)
        if entry is None:
            loaded = ", ".join(self._entries) or "none"
            raise LoRAError(f"LoRA adapter {name!r} is not loaded (loaded: {loaded}); load it first")
        return entry
