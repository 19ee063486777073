"""LoRA adapters on every tensor-parallel rank (``--tp-size`` > 1 with ``--enable-lora``).

Rank 0 keeps the one ``LoRAManager`` (names, uids, which adapter sits in which slot); each other
rank holds a pool of the same slots over its own shard of the model (``LoRAPool`` slices a
column-parallel layer's B and a row-parallel layer's A to the rank, so a row-parallel delta is a
partial sum like the base output, reduced with it) and a host copy of every loaded adapter:

* at start, the pool's geometry and the ``--lora-paths`` adapters (``LoRASpec``); at run time, each
  adapter rank 0 loads (``lora_add``): every rank reads it from its path, all or none keep it;
* with each step, what changed in rank 0's slots since the last step and the step's segments
  (``LoRASync``, in ``StepInputs.lora_sync``), and the uids rank 0 dropped (their host copies go).

Every message rides the control group from the forward thread, in order with the steps.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import torch

from core.engine.lora.adapter import LoRAAdapter, packed_modules_of, read_adapter
from core.engine.lora.pool import LoRAPool


@attrs.frozen
class LoRASpec:
    """Rank 0's pool geometry and its adapters at start, (uid, name, path) each."""

    slots: int
    max_rank: int
    targets: list[str]
    backend: str
    adapters: list[tuple[int, str, str]]


@attrs.frozen
class LoRASync:
    """A step's adapter state for the other ranks: slots (re)filled since the last step as
    (slot, uid), uids dropped, and the forward's segments (token counts and slots, -1: none)."""

    loads: list[tuple[int, int]]
    drops: list[int]
    seg_lens: list[int]
    seg_slots: list[int]


class RankLoRA:
    """A rank's pool and host copies (ranks 1..tp-1), kept as rank 0's messages say."""

    def __init__(self, model: torch.nn.Module, spec: LoRASpec, dtype: torch.dtype, device: torch.device) -> None:
        self.pool = LoRAPool(model, slots=spec.slots, max_rank=spec.max_rank, target_modules=spec.targets,
                             dtype=dtype, device=device, backend=spec.backend)
        self.packed = packed_modules_of(model)
        self.adapters: dict[int, LoRAAdapter] = {}
        for uid, name, path in spec.adapters:
            self.add(uid, name, path)

    def add(self, uid: int, name: str, path: str) -> None:
        adapter = read_adapter(name, path, self.packed)
        self.pool.check(adapter)
        self.adapters[uid] = adapter

    def apply(self, sync: LoRASync) -> None:
        """Rank 0's slot changes and this step's segments, before the step's forward."""
        for slot, uid in sync.loads:
            self.pool.load(self.adapters[uid], slot)
        for uid in sync.drops:
            self.adapters.pop(uid, None)
        if any(s >= 0 for s in sync.seg_slots):
            self.pool.set_batch(sync.seg_lens, sync.seg_slots)
        else:
            self.pool.clear_batch()


class RanksLoRA:
    """Rank 0's side: what the other ranks' slots hold, the uids dropped since the last step."""

    def __init__(self, group: Any, on_forward_thread: Any, slots: int) -> None:
        self.group, self.on_forward_thread = group, on_forward_thread
        self.slot_uids = [0] * slots
        self.dropped: list[int] = []
        self.pending: LoRASync | None = None

    def start(self, pool: LoRAPool, adapters: list[tuple[int, str, str]]) -> None:
        self.group.lora(("lora", LoRASpec(pool.slots, pool.max_rank, list(pool.target_names), pool.backend, adapters)),
                        "set up their LoRA adapters")

    async def add(self, uid: int, name: str, path: str) -> None:
        """Every other rank reads adapter ``uid`` (LoRAError naming the first rank that could not)."""
        await self.on_forward_thread(self.group.lora, ("lora_add", uid, name, path), f"load LoRA adapter {name!r}")

    def record(self, uids: Sequence[int], slots: Sequence[int] | None, seg_lens: Sequence[int]) -> None:
        """Rank 0's ``prepare`` for the next forward (``slots`` None: no adapter in it); under the
        serving lock, as ``dropped`` grows from the event loop's thread."""
        old = self.pending  # (not taken: a multi-step decode prepares before each step's forward)
        loads, drops = (list(old.loads), list(old.drops)) if old is not None else ([], [])
        for uid, slot in zip(uids, slots or ()):
            if uid and self.slot_uids[slot] != uid:
                self.slot_uids[slot] = uid
                loads.append((slot, uid))
        drops += self.dropped
        self.dropped = []
        self.pending = LoRASync(loads, drops, list(seg_lens), list(slots) if slots else [])

    def take(self) -> LoRASync | None:
        """The sync of the last ``prepare``, for the step's broadcast (once)."""
        sync, self.pending = self.pending, None
        return sync
