"""Weights from a trainer, in place (SGLang's RL interface): ``update_weights_from_tensor`` (tensors
handed over in process, or as shared-memory / CUDA IPC handles over HTTP), and a process group
the trainer broadcasts over (``init_weights_update_group``, ``update_weights_from_distributed``,
``destroy_weights_update_group``), with SGLang 0.5's optional ``begin_weight_update`` /
``end_weight_update`` around them.

An update writes the named checkpoint tensors (Hugging Face names, as the trainer's model has
them; ``load_format="direct"``: this server's parameter names) into the served parameters through
the model's own loader (``load_weights(..., partial=True)``: all or nothing), then everything
derived from them is made again: a layer's packed copy (its quant method's
``process_weights_after_loading``), a packed LM head, and any module's cached plan
(``weights_updated()``, which the shared layers and built-in models define). Parameters keep their
storage, so captured CUDA graphs stay valid. As in SGLang, an update waits for the running
requests (or runs at once while generation is paused) and flushes the prefix cache unless told not
to. It needs weights served as loaded: a quantized layer (int4 / int8 / fp8...) holds another
layout, and is refused with a pointer to ``update_weights_from_disk``."""

from __future__ import annotations

import asyncio
import datetime
import inspect
from typing import TYPE_CHECKING, Any

import structlog
import torch

from core.engine.model_loader.tensor_payload import named_tensors, payload_bytes
from core.engine.model_loader.weight_update import exclusive
from core.errors import ModelLoadError
from core.layers import ExpertsMethod, default_weight_loader

if TYPE_CHECKING:
    from core.engine.async_engine import AsyncEngine

log = structlog.get_logger("core.engine")
GROUP_TIMEOUT = datetime.timedelta(minutes=10)  # a rendezvous or broadcast the trainer never joins fails after this


class WeightSync:
    """One engine's weight-update state: its trainer process groups and an open update session."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.groups: dict[str, Any] = {}  # group name -> torch ProcessGroup (rank 0: the trainer)
        self.session: str | None = None  # begin_weight_update's selector while a session is open

    # ------------------------------------------------------------------ checks
    def refusal(self, selector: str = "all") -> str | None:
        """Why this engine cannot take weights in place (None: it can)."""
        e = self.engine
        if selector not in ("all", "target", "draft"):
            return f"selector must be 'all', 'target' or 'draft', not {selector!r}"
        if selector == "draft":
            return "the draft model's weights cannot be updated (its target's can: selector 'target' or 'all')"
        if e.lora is not None:
            return "not supported with --enable-lora (the adapters are bound to the served weights)"
        if "weights" in e.memory_saver.released:
            return "the weights' memory is released: resume_memory_occupation with tag 'weights' first"
        if "partial" not in inspect.signature(e.model.load_weights).parameters:
            return f"the model plugin's {type(e.model).__name__}.load_weights takes no partial updates"
        for name, m in e.model.named_modules():
            method = getattr(m, "quant_method", None)
            fmt = getattr(m, "quant_format", None)  # (set by the methods that quantize, dense fallbacks included)
            if method is not None and (fmt is not None or not (getattr(method, "dense", False)
                                                               or type(method) is ExpertsMethod)):
                fmt = fmt or type(method).__name__
                return (f"layer {name} is served quantized ({fmt}): tensors are written in the checkpoint's layout, "
                        "so in-place updates need an unquantized model; use update_weights_from_disk")
        return None

    # ------------------------------------------------------------------ updates
    async def update_from_tensor(self, tensors: Any, load_format: str | None = None, flush_cache: bool = True,
                                 torch_empty_cache: bool = False, selector: str = "all") -> tuple[bool, str]:
        """SGLang's ``update_weights_from_tensor``: ``tensors`` as ``named_tensors`` reads them."""
        if load_format not in (None, "direct", "flattened_bucket"):
            return False, f"load_format {load_format!r} is not supported (None, 'direct' or 'flattened_bucket')"
        if load_format == "direct" and self.engine.tp_group is not None:  # (rank 0's shapes are not the others' values)
            return False, "load_format 'direct' names this server's sharded parameters: not with --tp-size > 1"
        if why := self.refusal(selector):
            return False, f"Failed to update weights: {why}"
        tp = self.engine.tp_group
        if tp is not None and _serialized(tensors) and len(tensors) >= tp.plan.tp_size:  # (SGLang's one per rank:
            payloads = [payload_bytes(p) for p in tensors]  # each rank reads its own handles, no tensor travels)
            return await exclusive(self.engine, flush_cache, torch_empty_cache, self._on_ranks, ("payloads", payloads),
                                   "Failed to update weights: ")
        # (off the loop: a shared-memory handle is fetched from the sender's process)
        named = await asyncio.to_thread(named_tensors, tensors, self.engine.device)
        return await exclusive(self.engine, flush_cache, torch_empty_cache, self._load, named, load_format == "direct")

    async def update_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                      group_name: str = "weight_update_group", flush_cache: bool = True,
                                      load_format: str | None = None, torch_empty_cache: bool = False,
                                      selector: str = "all") -> tuple[bool, str]:
        """SGLang's ``update_weights_from_distributed``: receive the tensors from the trainer's
        broadcasts over ``group_name`` (each its own, or one ``flattened_bucket``) and load them."""
        if group_name not in self.groups:
            return False, f"group {group_name!r} is not initialized: call init_weights_update_group first"
        if load_format not in (None, "flattened_bucket"):
            return False, f"load_format {load_format!r} is not supported (None or 'flattened_bucket')"
        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            return False, "names, dtypes and shapes must be non-empty lists of one length"
        try:
            specs = [(n, _dtype(d), torch.Size(s)) for n, d, s in zip(names, dtypes, shapes)]
        except (TypeError, ValueError) as e:
            return False, f"Failed to update weights: {e}"
        if why := self.refusal(selector):
            return False, f"Failed to update weights: {why}"
        return await exclusive(self.engine, flush_cache, torch_empty_cache, self._receive_and_load, group_name, specs,
                               load_format == "flattened_bucket")

    def _receive_and_load(self, name: str, specs: list[tuple[str, torch.dtype, torch.Size]],
                          bucket: bool) -> tuple[bool, str]:
        return self._on_ranks(("recv", name, specs, bucket), "Failed to update weights: ")

    def _load(self, named: list[tuple[str, torch.Tensor]], direct: bool) -> tuple[bool, str]:
        """On the forward thread: write ``named`` in place on every rank (all or nothing), then make
        again what was derived from the weights."""
        # (the other ranks get the full tensors, on the CPU, and load their shard of each)
        msg = ("tensors", named if self.engine.tp_group is None else [(n, t.cpu()) for n, t in named], direct)
        return self._on_ranks(msg, "Failed to update weights: ")

    def _on_ranks(self, msg: tuple, failed: str) -> tuple[bool, str]:
        """``rank_job(msg)`` here and, under tensor parallelism, on every other rank (the forward
        thread's turn on the control channel); (success, message)."""
        e = self.engine
        here = lambda: rank_job(e.model, self.groups, e.device, 0, msg)  # noqa: E731
        error = here() if e.tp_group is None else e.tp_group.collective(("weights", msg), here)
        if error is not None:
            log.warning("engine.weight_sync_failed", job=msg[0], error=error)
            return False, failed + error
        return True, _DONE[msg[0]]

    # ------------------------------------------------------------------ sessions (SGLang 0.5)
    async def begin(self, selector: str = "all") -> tuple[bool, str]:
        if self.session is not None:
            return False, "a weight-update session is already open; call end_weight_update first"
        if why := self.refusal(selector):
            return False, why
        self.session = selector
        return True, "Weight-update session opened."

    async def end(self) -> tuple[bool, str]:
        if self.session is None:
            return False, "no weight-update session is open; call begin_weight_update first"
        self.session = None  # (each update was applied whole: nothing is left to finalize)
        return True, "Weight-update session closed."

    # ------------------------------------------------------------------ process groups
    async def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                         group_name: str = "weight_update_group", backend: str = "nccl") -> tuple[bool, str]:
        """Join the trainer's group as ranks ``rank_offset`` + tensor-parallel rank (blocking, as
        SGLang's scheduler does, until every rank joined), with the rendezvous and store layout of
        SGLang's ``init_custom_process_group``, which trainers call."""
        tp = self.engine.tp_group.plan.tp_size if self.engine.tp_group is not None else 1
        if not group_name:
            return False, "group_name must not be empty"
        if group_name in self.groups:
            return False, f"group {group_name!r} is already initialized"
        if backend == "nccl" and self.engine.device.type != "cuda":
            return False, (f"Failed to initialize custom process group: backend nccl needs a CUDA device; this server "
                           f"runs on {self.engine.device.type}: use backend 'gloo'")
        if not 0 < rank_offset or rank_offset + tp > world_size:
            return False, (f"rank_offset {rank_offset} must be >= 1 (rank 0 is the trainer) with its {tp} rank(s) "
                           f"inside world_size {world_size}")
        msg = ("join", master_address, master_port, rank_offset, world_size, group_name, backend)
        return await self.engine._on_forward_thread(self._on_ranks, msg, "Failed to initialize custom process group: ")

    async def destroy_group(self, group_name: str = "weight_update_group") -> tuple[bool, str]:
        if group_name not in self.groups:
            return False, "The group to be destroyed does not exist."
        return await self.engine._on_forward_thread(self._on_ranks, ("leave", group_name),
                                                    "Failed to destroy custom process group: ")

    def close(self) -> None:
        """At shutdown: leave this rank's groups (the other ranks leave theirs as they exit)."""
        for name in list(self.groups):
            rank_job(self.engine.model, self.groups, self.engine.device, 0, ("leave", name))


_DONE = {"tensors": "Succeeded to update model weights.", "payloads": "Succeeded to update model weights.",
         "recv": "Succeeded to update parameter online.", "join": "Succeeded to initialize custom process group.",
         "leave": "Succeeded to destroy custom process group."}


def rank_job(model: torch.nn.Module, groups: dict[str, Any], device: torch.device, rank: int, msg: tuple) -> str | None:
    """One rank's part of a weight-sync job (rank 0's, or a tensor-parallel rank's on rank 0's
    word): its error, or None. ``groups``: this rank's trainer process groups, by name."""
    kind = msg[0]
    try:
        if kind == "join":
            address, port, rank_offset, world_size, name, backend = msg[1:]
            groups[name] = _join(address, port, rank_offset + rank, world_size, name, backend)
            log.info("engine.weight_group", group=name, rank=rank_offset + rank, world_size=world_size, backend=backend)
            return None
        if kind == "leave":
            torch.distributed.destroy_process_group(groups.pop(msg[1]))
            return None
        if kind == "recv":
            named, direct = _receive(groups[msg[1]], msg[2], msg[3], device), False
        elif kind == "payloads":  # (this rank's own)
            named, direct = named_tensors(msg[1], device, rank), False
        else:
            named, direct = [(n, t.to(device)) for n, t in msg[1]], msg[2]
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    try:
        if direct:
            _load_direct(model, named)
        else:
            model.load_weights(named, partial=True)
    except (ModelLoadError, ValueError, RuntimeError) as e:
        return f"{e}; the served weights are unchanged"
    refresh(model)
    log.info("engine.weights_updated", source="broadcast" if kind == "recv" else "tensors", tensors=len(named))
    return None


def _join(address: str, port: int, rank: int, world_size: int, name: str, backend: str) -> Any:
    from torch.distributed import distributed_c10d as c10d

    store, rank, size = next(c10d.rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=GROUP_TIMEOUT))
    store.set_timeout(GROUP_TIMEOUT)
    pg, _ = c10d._new_process_group_helper(size, rank, [], c10d.Backend(backend), c10d.PrefixStore(name, store),
                                           group_name=name, backend_options=None, timeout=GROUP_TIMEOUT)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(size)}  # (group rank = global rank: src=0 is the trainer)
    return pg


def _receive(group: Any, specs: list[tuple[str, torch.dtype, torch.Size]], bucket: bool,
             device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """The trainer's broadcasts from rank 0: one per tensor, in order, or one uint8 bucket of them all."""
    if bucket:
        sizes = [s.numel() * d.itemsize for _, d, s in specs]
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        torch.distributed.broadcast(flat, src=0, group=group)
        named, at = [], 0
        for (name, dtype, shape), size in zip(specs, sizes):
            named.append((name, flat[at:at + size].view(dtype).reshape(shape)))
            at += size
        return named
    named = [(name, torch.empty(shape, dtype=dtype, device=device)) for name, dtype, shape in specs]
    for w in [torch.distributed.broadcast(t, src=0, group=group, async_op=True) for _, t in named]:
        w.wait()
    return named


def refresh(model: torch.nn.Module) -> None:
    """Make again what the loader derived from the weights: each layer's packed form, then every
    module's cached state (``weights_updated``: plans, packed heads)."""
    for m in model.modules():
        if (method := getattr(m, "quant_method", None)) is not None:
            method.process_weights_after_loading(m)
    for m in model.modules():
        if (updated := getattr(m, "weights_updated", None)) is not None:
            updated()


def _load_direct(model: torch.nn.Module, named: list[tuple[str, torch.Tensor]]) -> None:
    """SGLang's ``load_format="direct"``: the tensors by this server's parameter names, all or nothing."""
    params = dict(model.named_parameters())
    if unknown := [n for n, _ in named if n not in params]:
        raise ModelLoadError(f"tensor {unknown[0]!r} names no parameter of the served model")
    if bad := [n for n, t in named if params[n].shape != t.shape]:
        raise ModelLoadError(f"tensor {bad[0]!r}: shape {tuple(dict(named)[bad[0]].shape)} vs parameter "
                             f"{tuple(params[bad[0]].shape)}")
    for name, t in named:
        default_weight_loader(params[name], t.to(params[name].dtype))


def _serialized(tensors: Any) -> bool:
    """Whether ``tensors`` are serialized payloads (one per rank) rather than tensors themselves."""
    return isinstance(tensors, list) and bool(tensors) and all(isinstance(p, (str, bytes, bytearray)) for p in tensors)


def _dtype(name: Any) -> torch.dtype:
    """A dtype by SGLang's spelling (``"bfloat16"``, ``"torch.bfloat16"``) or itself."""
    if isinstance(name, torch.dtype):
        return name
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt

