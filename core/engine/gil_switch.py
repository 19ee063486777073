"""The interpreter's thread switch interval while an engine overlaps scheduling with its forwards.

Under overlap scheduling two threads want the GIL at once: the event loop's (result processing,
the streams, the next batch) and the forward thread's (the step's inputs, kernel launches and
sampling: short stretches of Python between GIL-free waits on the device). CPython hands the GIL
to a waiting thread only when the holder blocks or after ``sys.getswitchinterval()`` (5 ms by
default), so each time the forward thread came back from a wait it could sit up to 5 ms behind
the loop's Python, with the device idle: overlap hid nothing. Emulated on a CPU (a forward that
sleeps 1.75 ms, 256 streams: ``bench/bench_offline.py --emulate-device-ms 1.75``, with and without
``--switch-interval 0.005``), a 100 us interval took a step from 4.78 to 3.24 ms; one thread alone
never pays for it (switches are only forced while another thread waits).

The interval is process-wide: an engine shortens it only from CPython's default (a value the
program set itself is left alone) and the last such engine to stop puts the default back.
"""

from __future__ import annotations

import math
import sys
import threading

import structlog

log = structlog.get_logger("core.engine.gil_switch")

DEFAULT_S = 0.005  # CPython's
OVERLAP_S = 1e-4

_lock = threading.Lock()
_holders = 0  # engines that shortened the interval and have not stopped


def shorten() -> bool:
    """Shorten the interval for an overlapping engine; False (nothing changed) where the program
    set its own. Each True is to be matched by one ``restore``."""
    global _holders
    with _lock:
        if _holders == 0 and not _is(DEFAULT_S):
            return False
        if _holders == 0:
            sys.setswitchinterval(OVERLAP_S)
            log.info("gil.switch_interval", seconds=OVERLAP_S, reason="overlap scheduling: the forward thread's "
                     "Python runs between the event loop's")
        _holders += 1
        return True


def restore() -> None:
    """An engine that shortened the interval stopped; the last one puts CPython's default back."""
    global _holders
    with _lock:
        _holders = max(_holders - 1, 0)
        if _holders == 0 and _is(OVERLAP_S):
            sys.setswitchinterval(DEFAULT_S)


def _is(seconds: float) -> bool:
    """Whether the interval is ``seconds`` (CPython keeps it in whole microseconds)."""
    return math.isclose(sys.getswitchinterval(), seconds, rel_tol=1e-6)
