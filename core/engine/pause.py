"""SGLang's ``/pause_generation`` and ``/continue_generation``: a trainer stops generation around a
weight sync, then lets it go on.

Modes, as SGLang's:

* ``abort``: every queued and running request is aborted, and once they are gone the engine
  pauses.
* ``retract``: the engine pauses between steps and the running requests go back to the head of
  the queue, their KV to the prefix cache; after a weight update (which flushes the cache) they
  are recomputed under the new weights.
* ``in_place``: the engine pauses between steps; the running requests keep their KV and go on
  from it when resumed.

While paused nothing is scheduled: new requests queue, and ``update_weights_from_disk`` runs at
once instead of waiting for the running requests (its ``keep_pause``: an update never resumes).
The pause takes effect between two steps: the one in flight (overlap scheduling) is finished
first.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import structlog

from core.errors import InvalidRequest

if TYPE_CHECKING:
    from core.engine.async_engine import AsyncEngine

log = structlog.get_logger("core.engine")
MODES = ("abort", "retract", "in_place")
IDLE_POLL_S = 0.005  # how often an abort-mode pause checks whether the aborted requests are gone


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise InvalidRequest(f"mode must be one of {', '.join(MODES)}, got {mode!r}", param="mode")


async def pause(engine: AsyncEngine, mode: str = "abort") -> None:
    """Pause ``engine`` in ``mode``; returns once no step runs."""
    check_mode(mode)
    if mode == "abort":
        engine.abort_all("aborted by /pause_generation")
        while engine.scheduler.has_work and engine.fatal_error is None:  # (the loop drops them)
            await asyncio.sleep(IDLE_POLL_S)
    engine.paused = True
    if engine._task is not None and not engine._task.done() and engine._wake is not None:
        engine._wake.set()  # an idle loop comes round to the pause
        await engine.parked.wait()
    if mode == "retract":
        n = retract_running(engine.scheduler)
        log.info("engine.paused", mode=mode, retracted=n)
    else:
        log.info("engine.paused", mode=mode, running=len(engine.scheduler.running))


def resume(engine: AsyncEngine, torch_empty_cache: bool = False) -> None:
    """``/continue_generation``: the loop schedules again (``torch_empty_cache``: CUDA's cached
    blocks back to the driver first, as SGLang's)."""
    if torch_empty_cache and engine.device.type == "cuda":
        import torch

        torch.cuda.empty_cache()
    engine.paused = False
    engine.parked.clear()
    if engine._wake is not None:
        engine._wake.set()
    log.info("engine.resumed")


async def park(engine: AsyncEngine) -> None:
    """The loop's step while paused: finish the step in flight, say so, and wait to be woken."""
    if engine._inflight is not None:
        await engine._complete(*engine._inflight)
    engine.parked.set()
    engine._wake.clear()
    if engine.paused:
        engine.watchdog.idle()  # (a pause is no step that hangs)
        await engine._wake.wait()


def retract_running(scheduler) -> int:
    """Every running request back to the head of the queue, in order (its KV to the prefix cache)."""
    live = [r for r in scheduler.running if not r.finished]
    for r in reversed(live):
        scheduler._retract(r)
        scheduler.waiting.appendleft(r)
    return len(live)
