"""Python's cyclic garbage collector on the serving path.

A full (generation 2) pass scans every object the process holds: torch's, transformers' and the
model's modules are ~330k objects after start-up, and one pass took 190-240 ms on a Zen 4 EPYC,
a stall of every stream at once (issue 42; ``bench/bench_gc.py``: 4 ms once frozen). :func:`freeze` moves what start-up built into the
permanent generation (``gc.freeze``), so that later passes scan only what serving allocated.
``core serve``, its data-parallel replicas and tensor-parallel ranks freeze once they are ready;
``POST /freeze_gc`` and ``Engine.freeze_gc()`` (SGLang's) freeze again on demand, after a warm-up
of the user's own. :func:`watch` logs passes slower than SGLang's ``--gc-warning-threshold-secs``.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import structlog

log = structlog.get_logger("core.engine.gc")


def freeze(context: str) -> int:
    """Collect what is garbage now, then move every object still alive into the permanent
    generation, which no later pass scans; returns how many objects are frozen. (Cycles among
    frozen objects are never collected: only objects that live as long as the process, the
    engine's, should be alive here.)"""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("gc.frozen", context=context, objects=frozen)
    return frozen


def check(args: Any) -> None:
    """Refuse collector settings Python cannot take, naming the flag (``core serve`` and ``Engine``)."""
    from core.errors import CoreError

    if args.gc_warning_threshold_secs < 0:
        raise CoreError(f"--gc-warning-threshold-secs must be >= 0 (0 disables it), got {args.gc_warning_threshold_secs}")
    values = args.gc_threshold
    if values is not None and (not 1 <= len(values) <= 3 or any(not isinstance(v, int) or v < 0 for v in values)):
        raise CoreError(f"--gc-threshold takes 1 to 3 integers >= 0 (generation 0 first), got {values}")


def configure(args: Any) -> None:
    """This process's collector as the engine's flags ask (``check``ed): thresholds, slow-pass logs."""
    check(args)
    if args.gc_threshold:
        gc.set_threshold(*args.gc_threshold)
    if args.gc_warning_threshold_secs > 0:
        watch(args.gc_warning_threshold_secs)


def refreeze() -> None:
    """After a weight reload: the old model may sit in the permanent generation (frozen at
    start-up), where a cycle holding it would never be collected; so unfreeze, collect, and
    freeze the new state again. A process that never froze is left as it is."""
    if gc.get_freeze_count():
        gc.unfreeze()
        freeze("weight update")


class _SlowPasses:
    """The ``gc.callbacks`` entry that logs a pass slower than ``threshold_s`` (one per process)."""

    def __init__(self, threshold_s: float) -> None:
        self.threshold_s = threshold_s
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        elapsed = time.perf_counter() - self._start
        if elapsed > self.threshold_s:
            log.warning("gc.slow_pass", generation=info.get("generation"), seconds=round(elapsed, 4),
                        collected=info.get("collected"), frozen=gc.get_freeze_count(),
                        hint="POST /freeze_gc (Engine.freeze_gc()) after a warm-up moves what is alive "
                             "out of later passes")


def watch(threshold_s: float) -> None:
    """Log every collector pass slower than ``threshold_s`` seconds (0: stop logging them)."""
    mine = next((cb for cb in gc.callbacks if isinstance(cb, _SlowPasses)), None)  # (at most one: this keeps it so)
    if threshold_s <= 0:
        if mine is not None:
            gc.callbacks.remove(mine)
    elif mine is not None:
        mine.threshold_s = threshold_s
    else:
        gc.callbacks.append(_SlowPasses(threshold_s))
