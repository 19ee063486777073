"""The plumbing of a tensor-parallel group that every rank shares: the plan of where the
ranks run, joining the group, and the two control-group primitives (rank 0's broadcast,
everyone's error report). Rank 0 uses it from ``core.engine.distributed.tensor_parallel``, the other ranks
from ``core.engine.distributed.tp_worker``.
"""

from __future__ import annotations

import datetime
import multiprocessing
from typing import Any

import attrs
import torch

from core.engine.device import gpu_index
from core.errors import CoreError
from core.parallel import TensorParallel

IDLE_TIMEOUT = datetime.timedelta(days=365)  # the control group: ranks wait for the next step while the server idles
# imported once by the fork server, so that a rank or replica process starts without re-importing them
PRELOAD = ("core.engine.distributed.tp_worker", "core.engine.data_parallel.replica", "core.engine.async_engine",
           "transformers.models.auto.configuration_auto", "transformers.activations", "transformers.core_model_loading")


def process_context() -> Any:
    """Where rank and replica processes come from: a fork server that imported torch,
    transformers and the engine once (a new process is ready in about half a second instead
    of re-importing them for ~6 s), where the platform has one; else spawn. Never a plain fork:
    the parent has threads (the event loop's executors, CUDA)."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
        return ctx
    return multiprocessing.get_context("spawn")


@attrs.frozen
class DistPlan:
    """Where the ranks of one tensor-parallel group run and how they meet."""

    tp_size: int
    nnodes: int
    node_rank: int
    init_addr: str  # HOST:PORT of rank 0's rendezvous
    timeout_s: float
    backend: str  # "nccl" or "gloo"
    gpu_id_step: int = 1  # --gpu-id-step: GPUs between consecutive ranks

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The ranks this machine runs."""
        k = self.ranks_per_node
        return range(self.node_rank * k, (self.node_rank + 1) * k)


@attrs.frozen
class KVSpec:
    """What the other ranks need to allocate their shard of the KV pool (as rank 0 sized it)."""

    num_pages: int
    page_size: int
    dtype: torch.dtype
    backend: str  # the attention backend rank 0 chose


def rank_device(device: torch.device, plan: DistPlan, rank: int) -> torch.device:
    """A rank's device: the CPU, or GPU ``first + local rank * --gpu-id-step`` (``first``: the
    first rank's, ``core.engine.device.placed_device``)."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", gpu_index(device.index or 0, plan.gpu_id_step, 0, plan.ranks_per_node,
                                          rank - plan.node_rank * plan.ranks_per_node))


def init_rank(plan: DistPlan, rank: int) -> tuple[TensorParallel, Any]:
    """Join the group as ``rank`` (blocks until every rank has joined or the timeout passes);
    returns (the layers' ``TensorParallel``, the control group)."""
    import torch.distributed as dist

    dist.init_process_group(plan.backend, init_method=f"tcp://{plan.init_addr}", rank=rank, world_size=plan.tp_size,
                            timeout=datetime.timedelta(seconds=plan.timeout_s))
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return TensorParallel(rank, plan.tp_size, dist.group.WORLD), control


def broadcast(control: Any, msg: Any = None) -> Any:
    """Rank 0 sends ``msg`` to every rank; the others receive and return it."""
    import torch.distributed as dist

    box = [msg]
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]


def agree(control: Any, error: str | None) -> list[str | None]:
    """Every rank's error (None: fine), in rank order, on every rank."""
    import torch.distributed as dist

    out: list[str | None] = [None] * dist.get_world_size(control)
    dist.all_gather_object(out, error, group=control)
    return out


def first_failure(errors: list[str | None]) -> tuple[int, str] | None:
    """(rank, error) of the first rank in ``agree``'s answer that reported one, or None."""
    return next(((r, m) for r, m in enumerate(errors) if m), None)


def describe(e: BaseException) -> str:
    return str(e) if isinstance(e, CoreError) else f"{type(e).__name__}: {e}"
