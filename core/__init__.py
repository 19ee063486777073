"""core: a small asyncio LLM serving engine whose variable parts are pluggy plugins."""

import os
from pathlib import Path


def _openmp_wait_policy() -> None:
    """Let torch's OpenMP threads (libgomp) spin a little between parallel regions.

    The engine's forward thread and its event loop's thread each own a team, so libgomp sees more
    threads than CPUs and spins only its "throttled" count before a worker sleeps: 100 by default,
    which made every parallel region of a small decode step (~180 per SmolLM2 step) wait on a
    futex wake-up. With ACTIVE the throttled count is 1,000 (libgomp caps it there, below any
    GOMP_SPINCOUNT): batch-1 decode +15-20 %, 8 streams +10 % on a 2-vCPU EPYC. GOMP_SPINCOUNT
    bounds the spinning where libgomp does not throttle (one team: ACTIVE alone would spin for
    minutes). libgomp reads both once, as torch loads it, so this runs before torch is imported; a
    value the user exported wins, and Intel's OpenMP (where ACTIVE never sleeps) is left alone."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    try:
        import importlib.util

        spec = importlib.util.find_spec("torch")
        lib = Path(next(iter(spec.submodule_search_locations or []))) / "lib" if spec else None
    except (ImportError, ValueError, StopIteration):
        return
    if lib is None or any(lib.glob("libiomp*")):
        return
    os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
    os.environ["GOMP_SPINCOUNT"] = "30000"


_openmp_wait_policy()

from core.hookspecs import hookimpl  # noqa: E402
from core.interfaces import PLUGIN_API_VERSION  # noqa: E402

__all__ = ["hookimpl", "PLUGIN_API_VERSION", "Engine", "SamplingParams"]


def __getattr__(name: str):
    # Lazy so that `import core` (e.g. from a plugin module) does not import torch-heavy engine code.
    if name == "Engine":
        from core.engine.offline import Engine

        return Engine
    if name == "SamplingParams":
        from core.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
