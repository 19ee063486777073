"""Compatibility path: ``EngineArgs`` lives in ``core.engine.config``; plugin packages that
imported it from here keep working."""

from core.engine.config import EngineArgs, engine_args_from_kwargs

__all__ = ["EngineArgs", "engine_args_from_kwargs"]
