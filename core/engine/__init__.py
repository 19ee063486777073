"""The engine floor: torch, no HTTP. Scheduler, KV cache, radix cache, model runner,
sampler, detokenizer, grammar and loader, driven by ``AsyncEngine`` on one asyncio loop.

Exports resolve lazily so that importing one engine module (``core.engine.sampling_params``)
does not load the rest.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AsyncEngine", "Engine", "EngineArgs", "SamplingParams"]

_EXPORTS = {
    "AsyncEngine": "core.engine.async_engine",
    "Engine": "core.engine.offline",
    "EngineArgs": "core.engine.config",
    "SamplingParams": "core.engine.sampling_params",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'core.engine' has no attribute {name!r}")
