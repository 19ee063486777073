"""Which adapters the server knows, which requests use them, and which sit in pool slots.

Two levels of residency, as in S-LoRA / SGLang: every added adapter keeps a host copy (up to
``max_loaded``, least recently used unpinned ones evicted past that), and the ones a batch
needs are copied into the pool's device slots on demand (:meth:`LoRAManager.slots_for`).
Requests refer to an adapter by a uid that is never reused, so a request admitted for one
adapter can never run with another that later took its name.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Mapping, Sequence

import attrs

from core.engine.lora.adapter import LoRAAdapter, LoRAError, read_adapter
from core.engine.lora.pool import LoRAPool


@attrs.define
class _Entry:
    adapter: LoRAAdapter | None  # the host copy (None in a data-parallel front end, which holds none)
    uid: int
    pinned: bool
    last_used: int
    users: int = 0
    removing: bool = False
    path: str = ""


class AdapterNames:
    """Adapters by name, each with a never-reused uid and a last-used tick: what requests resolve
    and what is evicted past ``max_loaded`` (``LoRAManager``; a data-parallel front end's
    ``ReplicatedAdapters``, which keeps the names for its replicas)."""

    def __init__(self, max_loaded: int | None) -> None:
        self.max_loaded = max_loaded
        self._entries: dict[str, _Entry] = {}  # by name, insertion order
        self._uids = itertools.count(1)
        self._clock = itertools.count(1)

    def names(self) -> list[str]:
        """The adapters requests may name (those being removed excluded), oldest first."""
        return [n for n, e in self._entries.items() if not e.removing]

    def adapters(self) -> dict[str, str]:
        """Name -> folder of the adapters requests may name (what ``/v1/models`` lists)."""
        return {n: e.path for n, e in self._entries.items() if not e.removing}

    def resolve(self, name: str | None) -> int:
        """The uid of adapter ``name`` (0 for None / "": the base model), marked recently used."""
        if not name:
            return 0
        entry = self._entry(name)
        entry.last_used = next(self._clock)
        return entry.uid

    def uid_of(self, name: str) -> int:
        """The uid of loaded adapter ``name`` (not marked as used, unlike ``resolve``)."""
        return self._entry(name).uid

    def _check_new(self, name: str) -> None:
        if not name:
            raise LoRAError("a LoRA adapter needs a non-empty name")
        if name in self._entries:
            state = "is being removed (its requests are still running)" if self._entries[name].removing else "is already loaded"
            raise LoRAError(f"LoRA adapter {name!r} {state}; remove it first or choose another name")

    def _victim(self, name: str, in_use: Callable[[_Entry], bool]) -> str | None:
        """The adapter to evict so that ``name`` fits under ``max_loaded`` (None: it fits): the least
        recently used one neither pinned, in use nor being removed; LoRAError when there is none."""
        if self.max_loaded is None or len(self.names()) < self.max_loaded:
            return None
        victims = [(e.last_used, n) for n, e in self._entries.items() if not (e.pinned or e.removing or in_use(e))]
        if not victims:
            raise LoRAError(f"cannot load LoRA adapter {name!r}: {self.max_loaded} adapters are loaded (the "
                            "maximum) and each is pinned or in use; remove one or raise --max-loaded-loras")
        return min(victims)[1]

    def _new_entry(self, name: str, adapter: LoRAAdapter | None, pinned: bool, path: str = "") -> _Entry:
        entry = self._entries[name] = _Entry(adapter, next(self._uids), pinned, next(self._clock), path=path)
        return entry

    def _entry(self, name: str) -> _Entry:
        entry = self._entries.get(name)
        if entry is None or entry.removing:
            loaded = ", ".join(self.names()) or "none"
            raise LoRAError(f"LoRA adapter {name!r} is not loaded (loaded: {loaded}); load it first")
        return entry


class LoRAManager(AdapterNames):
    """The adapters of one server over one :class:`LoRAPool`. Not thread-safe: the scheduler's
    loop calls it. ``log`` is a structlog-style logger (``log.info(event, **fields)``)."""

    def __init__(self, pool: LoRAPool, packed_modules: Mapping, *, max_loaded: int | None, log: Any,
                 eviction_policy: str = "lru", on_drop: Callable[[int], None] | None = None) -> None:
        if max_loaded is not None and max_loaded < 1:
            raise LoRAError(f"max loaded LoRA adapters must be at least 1 (got {max_loaded})")
        super().__init__(max_loaded)
        self.pool, self.packed_modules, self.log = pool, packed_modules, log
        self.on_drop = on_drop  # called with each forgotten adapter's uid (tensor-parallel ranks drop their copies)
        self._by_uid: dict[int, _Entry] = {}
        self._slot_used = [0] * pool.slots  # clock tick of each slot's last use (0: never)
        self._slot_loaded = [0] * pool.slots  # clock tick of each slot's last load
        if eviction_policy not in ("lru", "fifo"):
            raise LoRAError(f"--lora-eviction-policy {eviction_policy!r} is not one of lru, fifo")
        # which occupied slot a batch reuses first: least recently used, or loaded first
        self._slot_age = self._slot_used if eviction_policy == "lru" else self._slot_loaded

    def adapter(self, name: str) -> LoRAAdapter:
        """The loaded adapter called ``name``."""
        return self._entry(name).adapter

    def add(self, name: str, path: str, pinned: bool = False, adapter: LoRAAdapter | None = None) -> LoRAAdapter:
        """Read the adapter in folder ``path`` as ``name`` (or take ``adapter``, already read from
        it) and check it fits the pool; past ``max_loaded`` the least recently used adapter that is
        neither pinned nor in use is evicted. Raises :class:`LoRAError` (the adapter is then not added)."""
        self._check_new(name)
        adapter = adapter if adapter is not None else read_adapter(name, path, self.packed_modules)
        self.pool.check(adapter)
        if (victim := self._victim(name, lambda e: e.users > 0)) is not None:
            self._drop(self._entries[victim])
            self.log.info("lora.evicted", name=victim, by=name)
        entry = self._new_entry(name, adapter, pinned, str(path))
        self._by_uid[entry.uid] = entry
        self.log.info("lora.added", name=name, path=str(path), rank=adapter.rank, pinned=pinned)
        return adapter

    def remove(self, name: str) -> None:
        """Stop serving ``name`` now (``resolve`` rejects it); its host copy and slot go when its
        last running request releases it."""
        entry = self._entry(name)
        entry.removing = True
        self.log.info("lora.removed", name=name, running=entry.users)
        if not entry.users:
            self._drop(entry)

    def acquire(self, uid: int) -> None:
        """A request using ``uid`` starts: it cannot be evicted or dropped until released."""
        if uid:
            self._live(uid).users += 1

    def release(self, uid: int) -> None:
        """A request using ``uid`` ended; an adapter being removed goes with its last user."""
        if not uid:
            return
        entry = self._live(uid)
        if entry.users <= 0:
            raise LoRAError(f"LoRA adapter {entry.adapter.name!r} released more often than acquired")
        entry.users -= 1
        if entry.removing and not entry.users:
            self._drop(entry)

    def slots_for(self, uids: Sequence[int]) -> list[int]:
        """The pool slot of each uid (-1 for 0), copying adapters that are not resident into free
        slots, else into the least recently used slots no uid of this batch needs."""
        wanted = list(dict.fromkeys(u for u in uids if u))
        if len(wanted) > self.pool.slots:
            raise LoRAError(f"a batch uses {len(wanted)} LoRA adapters but the pool has {self.pool.slots} slots; "
                            "raise --max-loras-per-batch or schedule fewer adapters per batch")
        entries = [self._live(u) for u in wanted]
        resident = {u: self.pool.slot_of(e.adapter.name) for u, e in zip(wanted, entries)}
        taken = {s for s in resident.values() if s is not None}
        tick = next(self._clock)
        for u, e in zip(wanted, entries):
            if resident[u] is None:
                slot = self._spare_slot(taken)
                self.pool.load(e.adapter, slot)
                self._slot_loaded[slot] = tick
                self.log.debug("lora.slot_loaded", name=e.adapter.name, slot=slot)
                resident[u] = slot
                taken.add(slot)
            self._slot_used[resident[u]] = tick  # type: ignore[index]
        return [resident[u] if u else -1 for u in uids]  # type: ignore[misc]

    def _spare_slot(self, taken: set[int]) -> int:
        """An empty slot, else the oldest one outside ``taken`` (by last use, or by load with fifo)."""
        free = [s for s in range(self.pool.slots) if s not in taken]
        empty = [s for s in free if self.pool.name_in(s) is None]
        return empty[0] if empty else min(free, key=lambda s: self._slot_age[s])

    def _live(self, uid: int) -> _Entry:
        entry = self._by_uid.get(uid)
        if entry is None:
            raise LoRAError(f"LoRA adapter uid {uid} is no longer loaded (it was removed or evicted)")
        return entry

    def _drop(self, entry: _Entry) -> None:
        """Forget ``entry``: its host copy, its uid and its pool slot."""
        name = entry.adapter.name
        del self._entries[name], self._by_uid[entry.uid]
        if self.on_drop is not None:
            self.on_drop(entry.uid)
        if (slot := self.pool.slot_of(name)) is not None:
            self.pool.free(slot)
            self._slot_used[slot] = 0
