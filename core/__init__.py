"""core: a small asyncio LLM serving engine whose variable parts are pluggy plugins."""

from core import openmp  # noqa: F401  (first: it must run before anything imports torch)

from core.hookspecs import hookimpl
from core.interfaces import PLUGIN_API_VERSION

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
