"""The HTTP front end's shape: which protocols ``core serve`` speaks (SGLang's ``--enable-http2``,
``--http2-max-concurrent-streams``, ``--http2-initial-connection-window-size``) and how many
front-end processes it runs (SGLang's ``--tokenizer-worker-num``).

SGLang serves HTTP/1.1 on uvicorn; ``--enable-http2`` swaps in Granian, which speaks HTTP/1.1 and
HTTP/2 (over TLS by ALPN, in cleartext by prior knowledge). Core always serves on hypercorn, which
answers HTTP/2 in cleartext (prior knowledge, or an ``Upgrade: h2c`` on a request without a body)
whatever the flags, having no setting to turn that off. Over TLS, ALPN offers ``h2`` only under
``--enable-http2``: without it a client is answered in HTTP/1.1, as SGLang's uvicorn answers.
Under the flag, every HTTP/2 connection advertises ``--http2-max-concurrent-streams`` in its
SETTINGS (hypercorn's ``h2_max_concurrent_streams``) and sets its connection-level receive window
to ``--http2-initial-connection-window-size`` (hypercorn has no such setting: its HTTP/2 protocol
is subclassed to send the WINDOW_UPDATE after its SETTINGS, as Granian's hyper does). The two sizes
default to SGLang's (200 streams, 1 MiB) and, as in SGLang, are only read under the flag. A window
below HTTP/2's initial 65,535 bytes is refused: a WINDOW_UPDATE can only widen a window.

``--tokenizer-worker-num N`` runs N HTTP-and-tokenizer processes in SGLang. Core's HTTP server is
one process (the engine runs in a process of its own: the CUDA default, or
``--enable-frontend-multiprocessing``), so 1 is accepted and more are refused, naming what to use.
"""

from __future__ import annotations

import argparse
from typing import Any

import structlog

from core.errors import CoreError

log = structlog.get_logger("core.server.http2")

DEFAULT_MAX_CONCURRENT_STREAMS = 200  # SGLang's defaults (Granian's HTTP2Settings)
DEFAULT_CONNECTION_WINDOW = 1024 * 1024
H2_INITIAL_WINDOW = 65535  # every HTTP/2 window's size before any WINDOW_UPDATE (RFC 9113 6.9.2)
MAX_STREAMS, MIN_WINDOW, MAX_WINDOW = 2**32 - 1, 1024, 2**31 - 1  # SGLang's bounds
WINDOW_ATTR = "core_h2_connection_window"  # core's own hypercorn Config attribute, read by the protocol


def add_frontend_args(http: argparse._ArgumentGroup, tokenizer: argparse._ArgumentGroup) -> None:
    """SGLang's flags with its names and defaults (its "HTTP server" and "Model and tokenizer" sections)."""
    http.add_argument("--enable-http2", action="store_true",
                      help="speak HTTP/2 as well as HTTP/1.1: over TLS ALPN offers h2 (without the flag it "
                           "offers only http/1.1, as SGLang); cleartext HTTP/2 (prior knowledge, h2c) is "
                           "answered either way")
    http.add_argument("--http2-max-concurrent-streams", type=int, default=DEFAULT_MAX_CONCURRENT_STREAMS,
                      metavar="N", help=f"streams each HTTP/2 connection may have open at once, advertised in "
                                        f"its SETTINGS (1 to {MAX_STREAMS}; default "
                                        f"{DEFAULT_MAX_CONCURRENT_STREAMS}); only with --enable-http2")
    http.add_argument("--http2-initial-connection-window-size", type=int, default=DEFAULT_CONNECTION_WINDOW,
                      metavar="BYTES", help=f"each HTTP/2 connection's receive window, across its streams "
                                            f"({MIN_WINDOW} to {MAX_WINDOW}; default {DEFAULT_CONNECTION_WINDOW}, "
                                            f"1 MiB); only with --enable-http2")
    tokenizer.add_argument("--tokenizer-worker-num", type=int, default=1, metavar="N",
                           help="HTTP front-end processes: only 1 (core's HTTP server is one process; the engine "
                                "runs in its own on CUDA, or with --enable-frontend-multiprocessing)")


def check_frontend_args(ns: argparse.Namespace) -> None:
    """SGLang's bounds under ``--enable-http2`` (without it the sizes are ignored, with a warning
    when set); ``--tokenizer-worker-num`` other than 1 refused, naming what to use instead."""
    workers = getattr(ns, "tokenizer_worker_num", 1)
    if workers < 1:
        raise CoreError(f"--tokenizer-worker-num must be >= 1, got {workers}")
    if workers > 1:
        raise CoreError(f"--tokenizer-worker-num {workers} is not supported: core's HTTP server and tokenizer run "
                        "in one process (SGLang's 1, the default), with the engine in a process of its own (the "
                        "CUDA default; --enable-frontend-multiprocessing on the CPU). Drop the flag; to spread "
                        "HTTP load over processes, run several `core serve` behind a load balancer")
    streams = getattr(ns, "http2_max_concurrent_streams", DEFAULT_MAX_CONCURRENT_STREAMS)
    window = getattr(ns, "http2_initial_connection_window_size", DEFAULT_CONNECTION_WINDOW)
    if not getattr(ns, "enable_http2", False):
        if streams != DEFAULT_MAX_CONCURRENT_STREAMS or window != DEFAULT_CONNECTION_WINDOW:
            log.warning("server.http2_flags_ignored", hint="--http2-max-concurrent-streams and "
                        "--http2-initial-connection-window-size only apply with --enable-http2")
        return
    if not 1 <= streams <= MAX_STREAMS:
        raise CoreError(f"--http2-max-concurrent-streams must be between 1 and {MAX_STREAMS}, got {streams}")
    if not MIN_WINDOW <= window <= MAX_WINDOW:
        raise CoreError(f"--http2-initial-connection-window-size must be between {MIN_WINDOW} and {MAX_WINDOW} "
                        f"bytes, got {window}")
    if window < H2_INITIAL_WINDOW:
        raise CoreError(f"--http2-initial-connection-window-size {window}: HTTP/2 starts every window at "
                        f"{H2_INITIAL_WINDOW} bytes and core can only widen it; pass {H2_INITIAL_WINDOW} or more")


def apply_http2(config: Any, ns: argparse.Namespace) -> None:
    """Set a hypercorn ``Config``: ALPN offers ``h2`` only under ``--enable-http2``, which also sets
    the streams and the connection window of every HTTP/2 connection (ALPN, prior knowledge, h2c)."""
    if not getattr(ns, "enable_http2", False):
        config.alpn_protocols = ["http/1.1"]
        return
    config.alpn_protocols = ["h2", "http/1.1"]
    config.h2_max_concurrent_streams = ns.http2_max_concurrent_streams
    setattr(config, WINDOW_ATTR, ns.http2_initial_connection_window_size)
    _install_protocol()


def open_connection_window(connection: Any, size: int) -> None:
    """Widen an ``h2`` server connection's connection-level receive window to ``size`` bytes (at
    least HTTP/2's initial 65,535), once its preface is queued, by a WINDOW_UPDATE on stream 0."""
    if size > H2_INITIAL_WINDOW:
        connection.increment_flow_control_window(size - H2_INITIAL_WINDOW)


def _install_protocol() -> None:
    """Have hypercorn build every HTTP/2 connection (ALPN, prior knowledge and h2c upgrades alike:
    ``hypercorn.protocol.ProtocolWrapper`` names the class from its module) with the window."""
    import hypercorn.protocol
    from hypercorn.protocol.h2 import H2Protocol

    if getattr(hypercorn.protocol.H2Protocol, "core_window", False):
        return

    class WindowedH2Protocol(H2Protocol):
        core_window = True

        async def initiate(self, headers: Any = None, settings: bytes | None = None) -> None:
            await super().initiate(headers, settings)
            size = getattr(self.config, WINDOW_ATTR, None)
            if size is not None and size != H2_INITIAL_WINDOW:
                open_connection_window(self.connection, size)
                await self._flush()

    hypercorn.protocol.H2Protocol = WindowedH2Protocol  # type: ignore[misc]
