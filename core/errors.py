"""Errors with enough structure for a CLI message or an OpenAI-style HTTP error."""

from __future__ import annotations


class CoreError(Exception):
    """Base class for errors core reports to users."""


class InvalidRequest(CoreError, ValueError):
    """A request that is rejected before scheduling; ``param`` names the bad field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class PluginError(CoreError):
    """A plugin is missing, failed to load, or registered something invalid."""


class UnknownNameError(CoreError, LookupError):
    """A backend / parser / model name that no plugin registered."""


class ModelLoadError(CoreError):
    """The model path, format or architecture cannot be served."""


class Unavailable(CoreError):
    """The engine cannot take work now (a tensor-parallel rank died, no data-parallel replica
    is alive): HTTP 503."""
