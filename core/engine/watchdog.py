"""The engine watchdog (SGLang's ``--watchdog-timeout``): a step that hangs instead of raising
must not hang the server silently.

The scheduler loop marks each step (``begin`` when it starts scheduling, ``running`` with the
batch it hands to the forward thread, ``idle`` when it waits for work). A daemon thread polls
the current step; once one has run for more than ``timeout`` seconds it logs the step (its
stage, request ids, every thread's stack), calls ``on_timeout`` with a message (the engine
fails every in-flight request with it and stops for good) and, when ``exit_code`` is set
(``core serve`` sets it), ends the process after ``exit_grace`` seconds, long enough for the
failed requests' responses to go out: a hung forward thread can be neither cancelled nor
joined, so only ``os._exit`` gets the process to a supervisor that restarts it.

The thread, not a coroutine, watches because the step that hangs may be on the event loop
itself (a scheduling step, a plugin hook).

``soft_timeout`` (SGLang's ``--soft-watchdog-timeout``) only reports: a step running past it is
logged once (``engine.soft_watchdog``: stage, requests, the stuck thread's stack) and goes on.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Any, Callable

import structlog

log = structlog.get_logger("core.engine.watchdog")

EXIT_GRACE_S = 3.0  # after a trip, before os._exit: the failed requests' responses go out
MAX_POLL_S = 1.0


class Watchdog:
    """Times the scheduler loop's steps; see the module docstring. ``timeout <= 0`` disables it
    (the hooks then cost an attribute write)."""

    def __init__(self, timeout: float, on_timeout: Callable[[str], None], *, exit_code: int | None = None,
                 exit_grace: float = EXIT_GRACE_S, soft_timeout: float | None = None) -> None:
        self.timeout = float(timeout)
        self.soft_timeout = float(soft_timeout or 0)
        self._reported = 0  # the last step the soft timeout logged
        self.on_timeout = on_timeout
        self.exit_code = exit_code  # set (e.g. by core serve): leave the process this long after a trip
        self.exit_grace = exit_grace
        self.tripped: str | None = None  # the message, once fired
        # (step number, monotonic start, batch or None, the thread it runs in) of the step under
        # way; None while idle. One tuple, replaced whole, so the watching thread never sees half
        # an update.
        self._current: tuple[int, float, Any, str] | None = None
        self._steps = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop_thread = "MainThread"  # the event loop's thread (where scheduling runs)

    @property
    def enabled(self) -> bool:
        return self.timeout > 0 or self.soft_timeout > 0

    # ------------------------------------------------------------------ the loop's hooks
    def begin(self) -> None:
        """A step starts (scheduling first): its clock starts now."""
        if self._thread is None:
            self._loop_thread = threading.current_thread().name
        self._steps += 1
        self._current = (self._steps, time.monotonic(), None, self._loop_thread)
        if self._thread is None and self.enabled and self.tripped is None:
            self._start()

    def running(self, batch: Any, on_loop: bool = False) -> None:
        """The step hands ``batch`` to the forward (named in the log if the step hangs), on the
        forward thread or, ``on_loop``, on the event loop's own thread (a small CPU decode)."""
        cur = self._current
        if cur is not None:
            self._current = (cur[0], cur[1], batch, self._loop_thread if on_loop else "core-forward")

    def idle(self) -> None:
        """The loop waits for work: nothing to time."""
        self._current = None

    def stop(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------------ the watching thread
    def _start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="core-watchdog", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        poll = min([MAX_POLL_S] + [t / 4 for t in (self.timeout, self.soft_timeout) if t > 0])
        while not self._stop.wait(poll):
            cur = self._current
            if cur is None:
                continue
            elapsed = time.monotonic() - cur[1]
            if 0 < self.timeout < elapsed:
                self._trip(cur, elapsed)
                return
            if 0 < self.soft_timeout < elapsed and self._reported != cur[0]:
                self._reported = cur[0]
                stage, rids = _what(cur[2])
                log.warning("engine.soft_watchdog", stage=stage, step=cur[0], elapsed_s=round(elapsed, 3),
                            soft_timeout_s=self.soft_timeout, rids=rids, stack=_stack_of(cur[3]))

    def _trip(self, step: tuple[int, float, Any, str], elapsed: float) -> None:
        number, _, batch, stuck = step
        stage, rids = _what(batch)
        shown = ", ".join(rids[:16]) + (f" and {len(rids) - 16} more" if len(rids) > 16 else "")
        message = (f"the engine watchdog fired: a {stage} step ran for {elapsed:.1f}s, over --watchdog-timeout "
                   f"{self.timeout:g}s" + (f" (requests {shown})" if rids else ""))
        self.tripped = message
        # the stack of the thread the step hangs in: the forward worker's, or the event loop's
        log.error("engine.watchdog_timeout", stage=stage, step=number, elapsed_s=round(elapsed, 3),
                  timeout_s=self.timeout, rids=rids, stack=_stack_of(stuck))
        try:
            self.on_timeout(message)
        except Exception:  # the exit below must still happen
            log.exception("engine.watchdog_callback_failed")
        if self.exit_code is not None:
            time.sleep(self.exit_grace)
            log.error("engine.watchdog_exit", exit_code=self.exit_code,
                      reason="a step hung; exiting so that a supervisor restarts the server")
            _flush()
            os._exit(self.exit_code)


def _what(batch: Any) -> tuple[str, list[str]]:
    """(the step's stage, its requests' ids)."""
    if batch is None:
        return "scheduling", []
    return ("prefill forward" if batch.is_prefill else "decode forward"), [r.rid for r in batch.reqs]


def _stack_of(name_prefix: str) -> str:
    """The current stack of the first thread whose name starts with ``name_prefix``."""
    frames = sys._current_frames()
    for t in threading.enumerate():
        if t.name.startswith(name_prefix) and t.ident in frames:
            return f"thread {t.name}:\n" + "".join(traceback.format_stack(frames[t.ident]))
    return f"no thread named {name_prefix}*"


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
