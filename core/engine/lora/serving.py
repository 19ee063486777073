"""The engine's side of multi-LoRA serving: SGLang's flags read into a pool and a manager,
adapter names resolved for requests, and each batch's adapter segments set before its forward.

The manager is touched from two threads: the event loop (requests resolve names, adapters are
added and removed) and the forward thread (``prepare`` copies adapters into pool slots), so
every call goes through one lock. A forward never runs while ``prepare`` copies: ``prepare``
runs on the forward thread itself, just before the forward it prepares.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any, Callable, Sequence

import structlog
import torch

from core.engine.config import lora_requested
from core.engine.lora.adapter import LoRAError, packed_modules_of, read_adapter
from core.engine.lora.manager import LoRAManager
from core.engine.lora.pool import LoRAPool
from core.engine.lora.tp import RanksLoRA

log = structlog.get_logger("core.engine.lora")


def parse_lora_paths(items: Any) -> list[tuple[str, str, bool]]:
    """(name, path, pinned) of each ``--lora-paths`` entry, in SGLang's forms: ``PATH`` (named by
    its path), ``NAME=PATH``, a JSON object ``{"lora_name", "lora_path", "pinned"}`` (as a string
    or, from the offline ``Engine``, a dict), or one dict ``{name: path}``."""
    if not items:
        return []
    if isinstance(items, dict):
        return [(str(k), str(v), False) for k, v in items.items()]
    if isinstance(items, str):
        items = [items]
    out = []
    for item in items:
        if isinstance(item, str) and item.lstrip().startswith("{"):
            try:
                item = json.loads(item)
            except json.JSONDecodeError as e:
                raise LoRAError(f"--lora-paths entry {item!r} is not valid JSON: {e}") from e
        if isinstance(item, dict):
            if not isinstance(item.get("lora_name"), str) or not isinstance(item.get("lora_path"), str):
                raise LoRAError(f"--lora-paths entry {item!r} needs string fields lora_name and lora_path")
            out.append((item["lora_name"], item["lora_path"], bool(item.get("pinned", False))))
        elif isinstance(item, str) and item:
            name, sep, path = item.partition("=")
            out.append((name, path, False) if sep else (item, item, False))
        else:
            raise LoRAError(f"--lora-paths entry {item!r} is not PATH, NAME=PATH or a JSON object")
    names = [n for n, _, _ in out]
    if len(set(names)) != len(names):
        raise LoRAError(f"--lora-paths names an adapter twice: {sorted({n for n in names if names.count(n) > 1})}")
    return out


class LoRAServing:
    """Adapters by name for the front end, adapter slots per batch for the model runner."""

    def __init__(self, args: Any, model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        check_max_loaded(args)
        initial = parse_lora_paths(args.lora_paths)
        packed = packed_modules_of(model)
        adapters = [read_adapter(n, p, packed) for n, p, _ in initial]
        max_rank = args.max_lora_rank or max((a.rank for a in adapters), default=0)
        targets = args.lora_target_modules
        if targets is None and adapters:
            targets = sorted({_peft_name(m, s, packed) for a in adapters for m, s in a.weights})
        if not max_rank or not targets:
            raise LoRAError("--enable-lora without --lora-paths needs --max-lora-rank and --lora-target-modules "
                            "(the pool is sized from them)")
        backend = kernel_backend(args.lora_backend, device)
        self.pool = LoRAPool(model, slots=args.max_loras_per_batch, max_rank=max_rank, target_modules=targets,
                             dtype=dtype, device=device, backend=backend)
        self.manager = LoRAManager(self.pool, packed, max_loaded=args.max_loaded_loras, log=log,
                                   eviction_policy=args.lora_eviction_policy, on_drop=self._dropped)
        self.ranks: RanksLoRA | None = None  # the other tensor-parallel ranks' adapters (core.engine.lora.tp)
        self.packed = packed
        self._lock = threading.Lock()
        self._holding: set = set()  # submitted requests that hold their adapter (Req compares by identity)
        for (name, path, pinned), adapter in zip(initial, adapters):  # (read once: they sized the pool)
            self._add(name, path, pinned, adapter)
        log.info("lora.ready", adapters=self.manager.names(), max_rank=max_rank, targets=sorted(map(str, targets)),
                 slots=args.max_loras_per_batch, backend=backend)

    # ---- the event loop's side
    def adapters(self) -> dict[str, str]:
        """Loaded adapter name -> path (what ``/v1/models`` lists)."""
        with self._lock:
            return self.manager.adapters()

    def resolve(self, name: str | None) -> int:
        """The uid of adapter ``name`` (0: the base model); LoRAError naming the loaded ones."""
        with self._lock:
            return self.manager.resolve(name)

    def admit(self, reqs: list, finish: Callable[[Any], None]) -> list:
        """The requests of ``reqs`` that may run: each holds its adapter until it finishes
        (``release``), so an unloaded adapter stays until its last request ends. A request whose
        adapter went away between its ``resolve`` and now (unloaded, or evicted past
        ``--max-loaded-loras``) is finished at once as aborted, naming why."""
        ok = []
        with self._lock:
            for r in reqs:
                if not r.lora_id or r in self._holding:  # (a request held through a weight update comes back)
                    ok.append(r)
                    continue
                try:
                    self.manager.acquire(r.lora_id)
                except LoRAError:
                    r.finish_reason = {"type": "abort", "message": "its LoRA adapter was unloaded before it started"}
                    r.finish_time = time.perf_counter()
                    continue
                self._holding.add(r)
                ok.append(r)
        for r in reqs:
            if r.finish_reason is not None and r not in ok:
                finish(r)
        return ok

    def release(self, req: Any) -> None:
        """A finished request lets go of its adapter (a finish listener of the engine)."""
        if req.lora_id:
            with self._lock:
                if req in self._holding:
                    self._holding.discard(req)
                    self.manager.release(req.lora_id)

    async def load(self, name: str, path: str, pinned: bool = False) -> None:
        """Read and add an adapter at run time (the files are read on a worker thread); with
        tensor parallelism every rank reads it, and one that cannot undoes the load."""
        await asyncio.to_thread(self._add, name, path, pinned)
        if self.ranks is not None:
            try:
                await self.ranks.add(self.uid_of(name), name, path)
            except Exception:
                with self._lock:
                    self.manager.remove(name)
                raise

    def uid_of(self, name: str) -> int:
        with self._lock:
            return self.manager.uid_of(name)

    def _dropped(self, uid: int) -> None:
        """The manager forgot adapter ``uid`` (under the lock): the other ranks drop their copies."""
        if self.ranks is not None:
            self.ranks.dropped.append(uid)

    def _add(self, name: str, path: str, pinned: bool, adapter: Any = None) -> None:
        if adapter is None:  # (the files are read outside the lock: the forward thread's prepare takes it)
            adapter = read_adapter(name, path, self.packed)
        with self._lock:
            self.manager.add(name, path, pinned, adapter=adapter)

    async def unload(self, name: str) -> None:
        """Remove an adapter: new requests cannot name it; running ones finish with it."""
        with self._lock:
            self.manager.remove(name)

    def graph_pool(self, max_bs: int) -> LoRAPool | None:
        """The pool, for decode CUDA graphs that hold its kernels (``CudaGraphRunner``), when its
        kernels can be captured (the triton backend's); else None: batches with adapters run eagerly."""
        if self.pool.backend != "triton":
            return None
        self.pool.reserve_segments(max_bs)
        return self.pool

    # ---- the forward thread's side
    def prepare(self, uids: Sequence[int], extend_lens: Sequence[int]) -> bool:
        """Set the next forward's adapter segments (one per request: its ``extend_lens`` tokens);
        whether any token uses an adapter (the model's fused paths then step aside)."""
        if not any(uids):
            self.pool.clear_batch()
            if self.ranks is not None:
                with self._lock:
                    self.ranks.record(uids, None, extend_lens)
            return False
        with self._lock:
            slots = self.manager.slots_for(uids)
            if self.ranks is not None:
                self.ranks.record(uids, slots, extend_lens)
        self.pool.set_batch(list(extend_lens), slots)
        return True


def check_max_loaded(args: Any) -> None:
    """``--max-loaded-loras`` holds at least one batch's adapters, and the adapters ``--lora-paths``
    loads at start (as SGLang checks: evicting some of them at once would refuse their requests)."""
    if args.max_loaded_loras is not None and args.max_loaded_loras < args.max_loras_per_batch:
        raise LoRAError(f"--max-loaded-loras ({args.max_loaded_loras}) must be at least --max-loras-per-batch "
                        f"({args.max_loras_per_batch})")
    if args.max_loaded_loras is not None and (n := len(parse_lora_paths(args.lora_paths))) > args.max_loaded_loras:
        raise LoRAError(f"--lora-paths names {n} adapters, more than --max-loaded-loras ({args.max_loaded_loras}); "
                        "raise it or load fewer at start")


def kernel_backend(lora_backend: str, device: torch.device) -> str:
    """The pool's kernels for ``--lora-backend``: SGLang's csgmv and triton run the segmented
    Triton kernels on a GPU; torch_native, and every backend on the CPU, run torch's matmuls."""
    return "triton" if device.type == "cuda" and lora_backend in ("csgmv", "triton") else "torch"


def attach_lora(engine: Any) -> LoRAServing | None:
    """With ``--enable-lora`` (or ``--lora-paths``): the engine's adapters, wired into its model
    runner (segments per forward) and scheduler (adapters per batch); the engine registers
    ``release`` as a finish listener."""
    args = engine.args
    if not lora_requested(args):
        return None
    try:
        lora = LoRAServing(args, engine.model, engine.model_config.dtype, engine.device)
        if engine.tp_group is not None:  # every rank: a pool over its shard, a copy of each adapter
            lora.ranks = RanksLoRA(engine.tp_group, engine._on_forward_thread, lora.pool.slots)
            lora.ranks.start(lora.pool, [(lora.uid_of(n), n, p) for n, p in lora.adapters().items()])
    except BaseException:
        if engine.tp_group is not None:  # (the ranks wait for the next message)
            engine.tp_group.stop()
        raise
    engine.runner.lora = lora
    engine.scheduler.max_loras = args.max_loras_per_batch
    lora.pool.reserve_segments(engine.scheduler.max_running)  # (before any graph keeps their addresses)
    return lora


def _peft_name(module: str, shard: object, packed: dict) -> str:
    """The peft / SGLang target name of our layer ``module``'s part ``shard`` (q_proj for qkv_proj's q)."""
    last = module.rsplit(".", 1)[-1]
    if shard is None:
        return last
    return next((k for k, v in packed.items() if v == (last, shard)), last)
