"""The tensor-parallel group the shared layers shard over, and the two collectives they use.

The engine builds the model inside ``building(group)``; each shared layer (``core.layers``)
reads :func:`current` once, in its constructor, and keeps it. So a model wired from the
shared layers is sharded without knowing it, and a layer built outside ``building`` (any
test, any single-rank engine) gets ``SINGLE``: size 1, no collective is ever issued and the
forward is exactly the unsharded one.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import attrs
import torch


@attrs.frozen
class TensorParallel:
    """This process's place in its tensor-parallel group: ``rank`` of ``size``, and the
    ``torch.distributed`` process group the layers' collectives run on."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed.ProcessGroup; None when size == 1

    def shard(self, n: int, what: str) -> int:
        """``n / size``; a ValueError naming ``what`` when ``n`` does not split evenly."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {self.size}")
        return n // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (the partial products of a row-parallel layer)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dimension, in rank order."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()
_current: contextvars.ContextVar[TensorParallel] = contextvars.ContextVar("core_tensor_parallel", default=SINGLE)


def current() -> TensorParallel:
    """The group a layer being constructed now shards over (``SINGLE`` outside ``building``)."""
    return _current.get()


@contextlib.contextmanager
def building(tp: TensorParallel) -> Iterator[TensorParallel]:
    """Layers constructed inside shard over ``tp``."""
    token = _current.set(tp)
    try:
        yield tp
    finally:
        _current.reset(token)
