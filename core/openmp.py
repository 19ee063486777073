"""libgomp's wait policy for torch's OpenMP threads, exported before torch loads.

Imported by ``core/__init__.py`` before anything imports torch; a leaf module (no core imports), so
that the engine can ask later whether it came in time."""

import os
import sys
from pathlib import Path


def wait_policy() -> bool:
    """Let torch's OpenMP threads (libgomp) spin a little between parallel regions.

    The engine's forward thread and its event loop's thread each own a team, so libgomp sees more
    threads than CPUs and spins only its "throttled" count before a worker sleeps: 100 by default,
    which made every parallel region of a small decode step (~180 per SmolLM2 step) wait on a
    futex wake-up. With ACTIVE the throttled count is 1,000 (libgomp caps it there, below any
    GOMP_SPINCOUNT): batch-1 decode +15-20 %, 8 streams +10 % on a 2-vCPU EPYC (measured again
    with the decoder stack as one parallel region: batch-1 steps of 4-6.5 ms against 9-21 ms
    without the settings, `docs/benchmarks.md`). GOMP_SPINCOUNT
    bounds the spinning where libgomp does not throttle (one team: ACTIVE alone would spin for
    minutes). libgomp reads both once, as torch loads it, so this runs before torch is imported; a
    value the user exported wins, and Intel's OpenMP (where ACTIVE never sleeps) is left alone.

    Returns False where the policy comes too late: a program imported torch before core, so this
    process's libgomp already runs with its defaults (the engine warns on CPU; worker processes,
    which inherit the variables, still get it)."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return True
    try:
        import importlib.util

        spec = importlib.util.find_spec("torch")
        lib = Path(next(iter(spec.submodule_search_locations or []))) / "lib" if spec else None
    except (ImportError, ValueError, StopIteration):
        return True
    if lib is None or any(lib.glob("libiomp*")):
        return True
    os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
    os.environ["GOMP_SPINCOUNT"] = "30000"
    return "torch" not in sys.modules


APPLIED = wait_policy()
