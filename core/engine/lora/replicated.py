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

from typing import Any, Awaitable, Callable

import structlog

from core.engine.lora.manager import AdapterNames
from core.engine.lora.serving import check_max_loaded, parse_lora_paths

log = structlog.get_logger("core.engine.lora")

# (what, *args) -> each live replica's reply or the exception it raised, in replica order
CallAll = Callable[..., Awaitable[list[Any]]]


class ReplicatedAdapters(AdapterNames):
    """``LoRAServing``'s front-end side (``adapters``, ``resolve``, ``load``, ``unload``) over replicas."""

    def __init__(self, args: Any, call_all: CallAll, in_use: Callable[[], set[int]]) -> None:
        check_max_loaded(args)  # (the replicas run without the limit: checked here)
        super().__init__(args.max_loaded_loras)
        self._call_all, self._in_use = call_all, in_use
        for name, path, pinned in parse_lora_paths(args.lora_paths):  # (the replicas load them as they start)
            self._new_entry(name, None, pinned, path)

    def name_of(self, uid: int) -> str | None:
        """The loaded adapter whose uid a request resolved (its name goes to the replica, which has
        its own uids); None once that adapter was unloaded, even if one of the same name came since."""
        return next((n for n, e in self._entries.items() if e.uid == uid), None)

    async def load(self, name: str, path: str, pinned: bool = False) -> None:
        """Load ``name`` on every replica, or on none: a replica's refusal (a bad checkpoint, a rank
        over the pool's) unloads it from those that took it, and is raised."""
        self._check_new(name)
        busy = self._in_use()
        victim = self._victim(name, lambda e: e.uid in busy)
        replies = await self._call_all("load_lora", name, path, pinned)
        if errors := [r for r in replies if isinstance(r, BaseException)]:
            if len(errors) < len(replies):
                await self._call_all("unload_lora", name)
            raise errors[0]
        self._new_entry(name, None, pinned, path)
        if victim is not None and victim in self._entries:  # (after the load: a refused one evicts nothing)
            log.info("lora.evicted", name=victim, by=name)
            await self.unload(victim)

    async def unload(self, name: str) -> None:
        """Stop serving ``name`` on every replica: new requests cannot name it, running ones finish."""
        self._entry(name)
        del self._entries[name]  # (first: requests resolved from now on are refused here)
        if errors := [r for r in await self._call_all("unload_lora", name) if isinstance(r, BaseException)]:
            raise errors[0]
