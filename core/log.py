"""structlog set-up: one configuration for the CLI, the server and the engine."""

from __future__ import annotations

import logging
import sys

import structlog

LEVELS = ("debug", "info", "warning", "error", "critical")

_default_config: tuple = ()  # the logger factory and processors configure_default_logging installed


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is now: a stream captured at configure time may be
    closed later (pytest's capture, a redirected CLI run), and logging must never raise."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str = "info", json: bool = False) -> None:
    """Route structlog through a level filter to stderr (JSON lines when ``json``)."""
    if level not in LEVELS:
        raise ValueError(f"unknown log level {level!r}; choose one of {', '.join(LEVELS)}")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),
        cache_logger_on_first_use=False,
    )


def configure_default_logging(level: str = "info") -> None:
    """For library use (``from core import Engine``): structlog's unconfigured default prints to
    stdout, into the user's own output, so route our logs to stderr unless the application has
    configured structlog itself (its set-up wins, a change of processors alone too: structlog's
    ``capture_logs``). Repeated calls may change the level."""
    global _default_config
    if structlog.is_configured() and _installed() != _default_config:
        return
    configure_logging(level)
    _default_config = _installed()


def _installed() -> tuple:
    config = structlog.get_config()
    return config["logger_factory"], list(config["processors"])  # (a copy: structlog edits its list in place)
