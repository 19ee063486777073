"""SGLang's ``--enable-memory-saver``: ``release_memory_occupation`` / ``resume_memory_occupation``
give the device's memory to a colocated RL trainer between rollouts and take it back.

Tags, as SGLang's: ``kv_cache`` (the KV pool; the prefix cache is flushed), ``weights`` (the
model's parameters; their values come back only with ``--enable-weights-cpu-backup``, else the
trainer's next weight update supplies them) and ``cuda_graph`` (the captured graphs); none named:
all three. Freeing is a resize of each tensor's storage to nothing (on CUDA the blocks go back to
the driver), so every holder of a tensor sees it come back; what captured their addresses (CUDA
graphs, the CPU decode plans) is made again on resume. SGLang keeps the addresses
(torch_memory_saver's virtual memory); here the graphs are captured again instead.

While anything is released, and after weights came back without a backup until a weight update
lands, new requests are held and run afterwards: nothing generates from freed or stale memory.
Release waits for the running requests (while generation is paused it refuses if some are still
held in place, whose KV it would destroy). Under tensor parallelism every rank does the same."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import structlog
import torch

from core.engine.model_loader.weight_sync import refresh
from core.engine.model_loader.weight_update import hold_until_idle, release_held

if TYPE_CHECKING:
    from core.engine.async_engine import AsyncEngine

log = structlog.get_logger("core.engine")
TAGS = ("weights", "kv_cache", "cuda_graph")


class RankMemory:
    """One rank's released memory: the KV buffers and the parameters' storages (with their CPU
    copies under ``--enable-weights-cpu-backup``)."""

    def __init__(self, kv: Any, cpu_backup: bool) -> None:
        self.kv, self.cpu_backup = kv, cpu_backup  # (the model is passed per call: a reload replaces it)
        self.sizes: dict[str, list[tuple[torch.UntypedStorage, int]]] = {}  # tag -> (storage, its bytes)
        self.backup: list[torch.Tensor] = []

    def _storages(self, tag: str, model: torch.nn.Module) -> list[torch.UntypedStorage]:
        tensors = [*self.kv.k, *self.kv.v] if tag == "kv_cache" else list(model.parameters())
        seen: dict[int, torch.UntypedStorage] = {}  # (tied and fused weights share one)
        for t in tensors:
            s = t.untyped_storage()
            seen.setdefault(s.data_ptr(), s)
        return list(seen.values())

    def release(self, tag: str, model: torch.nn.Module) -> None:
        if tag not in ("kv_cache", "weights") or tag in self.sizes:
            return
        storages = self._storages(tag, model)
        if tag == "weights" and self.cpu_backup:
            self.backup = [_bytes(s).to("cpu", copy=True) for s in storages]
        self.sizes[tag] = [(s, s.nbytes()) for s in storages]
        for s in storages:
            s.resize_(0)

    def resume(self, tag: str, model: torch.nn.Module) -> bool:
        """Take ``tag``'s memory back; whether its values came back too (KV: its padding page)."""
        if tag not in self.sizes:
            return True
        held = self.sizes.pop(tag)
        for s, n in held:
            s.resize_(n)
        if tag == "kv_cache":
            ps = self.kv.page_size
            for t in (*self.kv.k, *self.kv.v):
                t[:ps].zero_()  # the padding page the attention reads for masked slots
            return True
        backup, self.backup = self.backup, []
        for (s, _), b in zip(held, backup):
            _bytes(s).copy_(b)
        refresh(model)  # (the packed copies and the plans that held the old addresses)
        return bool(backup)


def _bytes(s: torch.UntypedStorage) -> torch.Tensor:
    """A storage's bytes as a uint8 tensor over it."""
    return torch.empty(0, dtype=torch.uint8, device=s.device).set_(s)


class MemorySaver:
    """Rank 0's side: which tags are released, the held requests, the graphs, the other ranks."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.enabled = engine.args.enable_memory_saver or engine.args.enable_weights_cpu_backup  # (either, as SGLang)
        self.rank = RankMemory(engine.kv_cache, engine.args.enable_weights_cpu_backup)
        self.released: set[str] = set()
        self.weights_stale = False  # weights back without their values: held until a weight update
        self.graphs = engine.runner.graphs is not None  # captured again once everything is back

    @property
    def holds(self) -> bool:
        """Whether new requests wait (``core.engine.model_loader.weight_update.release_held``)."""
        return bool(self.released) or self.weights_stale

    async def release(self, tags: list[str] | None = None) -> tuple[bool, str]:
        return await self._change("release", tags)

    async def resume(self, tags: list[str] | None = None) -> tuple[bool, str]:
        return await self._change("resume", tags)

    async def _change(self, op: str, tags: list[str] | None) -> tuple[bool, str]:
        """(success, message) of ``op`` on ``tags`` (None: all), one weight or memory change at a time."""
        if not self.enabled:
            return False, "memory occupation can be released only with --enable-memory-saver (or --enable-weights-cpu-backup)"
        tags = list(tags or TAGS)
        if bad := [t for t in tags if t not in TAGS]:
            return False, f"unknown memory tag {bad[0]!r}; known: {', '.join(TAGS)}"
        e = self.engine
        async with e._update_lock:
            if op == "release":
                await hold_until_idle(e)
                if e.scheduler.running:  # (paused in place: their KV would be lost)
                    release_held(e)
                    return False, "requests are paused in place: abort them or pause with mode 'retract' first"
                if "kv_cache" in tags:
                    e.scheduler.flush_cache()
                    getattr(e.tree_cache, "clear_storage", bool)()
                self.released.update(tags)
                e.runner.graphs = None  # (they replay addresses about to be freed)
            error = await e._on_forward_thread(self._on_ranks, op, tags)
            if op == "resume":
                self.released.difference_update(tags)
                if not self.released and self.graphs:  # every address may have moved
                    e.runner.graphs = await e._on_forward_thread(e._capture_cuda_graphs)
                release_held(e)
        if error:
            return False, f"Failed to {op} memory: {error}"
        log.info(f"engine.memory_{op}d", tags=sorted(tags), weights_stale=self.weights_stale)
        return True, f"Succeeded to {op} memory occupation."

    def _on_ranks(self, op: str, tags: list[str]) -> str | None:
        """``op`` on this rank and, under tensor parallelism, on the others (the forward thread)."""
        e = self.engine
        here = lambda: rank_job(self.rank, e.model, op, tags)  # noqa: E731
        error = here() if e.tp_group is None else e.tp_group.collective(("memory", op, tags), here)
        if op == "release" and e.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        if op == "resume" and "weights" in tags and "weights" in self.released and not self.rank.cpu_backup:
            self.weights_stale = True  # (released and back without their values)
        return error


def rank_job(rank: RankMemory, model: torch.nn.Module, op: str, tags: list[str]) -> str | None:
    """One rank's release or resume of ``tags`` (``model``: the one it serves); its error or None."""
    try:
        for tag in tags:
            (rank.release if op == "release" else rank.resume)(tag, model)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None

