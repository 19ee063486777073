"""``core serve``: build the engine, serve the app on hypercorn, shut down cleanly.

One asyncio event loop runs hypercorn and the engine's scheduler; the forward runs on the
engine's worker thread. The engine is built (synchronously) before serving; a warm-up
generate runs before /health reports ready. On SIGINT/SIGTERM the server drains: it keeps
listening, but /health and new requests get 503 (with Retry-After), while running requests,
streams included, finish for ``--graceful-shutdown-timeout`` (``--drain-timeout``) seconds;
the rest are aborted with a reason, running batches stop, and it exits 0 (a second signal
skips the wait). An engine that fails for good (a step past ``--watchdog-timeout``, a dead
rank) fails its requests and the server exits non-zero, for a supervisor to restart it.
A burst of connections waits in the kernel's listen queue (``LISTEN_BACKLOG``) and is held
open (the open-file limit is raised at start), never dropped before the server sees it.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import signal
import socket
import time

import structlog

from core.errors import CoreError
from core.server.args import ServerArgs, add_serve_parser, validate_serve_args

log = structlog.get_logger("core.server.launch")

SHUTDOWN_ABORT_MESSAGE = "the server shut down before the request finished"
WATCHDOG_EXIT_CODE = 1
# Pending connections the kernel queues before accept (SGLang's 2048; hypercorn's default of 100
# reset ~30 % of a 1,000-request burst, silently: the kernel dropped them before the server saw them).
LISTEN_BACKLOG = 4096
# Open files the server wants (SGLang's set_ulimit): every connection is a file descriptor, and
# at the common soft limit of 1024 a burst makes accept fail with EMFILE.
TARGET_NOFILE = 65535


def add_serve_command(subparsers: argparse._SubParsersAction) -> None:
    """The ``serve`` sub-command (called by ``core.cli.build_parser``)."""
    add_serve_parser(subparsers).set_defaults(func=cmd_serve)


def cmd_serve(ns: argparse.Namespace) -> int:
    validate_serve_args(ns)
    if ns.chat_template:  # an unsupported JSON sep_style, or a template that drops the messages: refused at start
        from core.server.openai.chat import loaded_chat_template

        loaded_chat_template(ns.chat_template)
    if getattr(ns, "node_rank", 0):  # another machine of a multi-node tensor-parallel group: ranks only, no HTTP
        from core.engine.config import engine_args_from_namespace
        from core.engine.distributed.tensor_parallel import serve_node

        return serve_node(engine_args_from_namespace(ns, getattr(ns, "_plugin_dests", ())))
    return run_server(ns)


def run_server(ns: argparse.Namespace) -> int:
    """Serve until a signal, shut down cleanly; returns the exit status."""
    return asyncio.run(_serve(ns))


def _bind(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def raise_fd_limit(target: int = TARGET_NOFILE) -> int | None:
    """Raise the soft RLIMIT_NOFILE toward ``target`` (capped by the hard limit), as SGLang's
    ``set_ulimit`` does; returns the soft limit now in force, None where it is unlimited."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            log.debug("server.fd_limit_raised", soft=want, was=soft, hard=hard)
            return want
        except (ValueError, OSError) as e:
            log.warning("server.fd_limit_not_raised", soft=soft, hard=hard, error=str(e))
    return soft


def _somaxconn() -> int | None:
    """The kernel's cap on a listen backlog (Linux), or None where unknown."""
    try:
        with open("/proc/sys/net/core/somaxconn", encoding="ascii") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def engine_process(args: ServerArgs, engine_args) -> bool:
    """Whether the engine runs in a process of its own (``create_engine``'s ``own_process``): by
    default on CUDA, where the device waits on the scheduler's Python, which the server's would
    otherwise interrupt; on the CPU when asked: there the forward's threads already take the cores."""
    if args.disable_frontend_multiprocessing and args.enable_frontend_multiprocessing:
        raise CoreError("--disable-frontend-multiprocessing and --enable-frontend-multiprocessing contradict each "
                        "other; pass one")
    if args.disable_frontend_multiprocessing:
        return False
    from core.engine.device import pick_device

    return args.enable_frontend_multiprocessing or pick_device(engine_args.device).type == "cuda"


def _check_bind(host: str, port: int) -> None:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise CoreError(f"cannot resolve --host {host}: {e}") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            raise CoreError(f"cannot listen on {_bind(host, port)}: {e.strerror or e}") from None


def hypercorn_log_level(args: ServerArgs) -> str:
    """hypercorn's level: ``--log-level-http`` (SGLang's, for its uvicorn), else ``--log-level``
    (its warnings kept above that)."""
    if args.log_level_http:
        return args.log_level_http.upper()
    return "WARNING" if args.log_level in ("warning", "error", "critical") else args.log_level.upper()


async def _serve(ns: argparse.Namespace) -> int:
    # the HTTP stack and torch load here, not when the CLI builds its parser
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    from core.engine import gc_watch
    from core.engine.config import engine_args_from_namespace
    from core.engine.data_parallel.engine import create_engine
    from core.server.app import create_app
    from core.server.http2 import apply_http2
    from core.server.native import run_internal_generate
    from core.server.openai.batches import shutdown_batches
    from core.server.state import build_state
    from core.server.tls import apply_ssl, url_scheme

    args = ServerArgs.from_namespace(ns)
    loop = asyncio.get_running_loop()
    _check_bind(args.host, args.port)  # fail before the model loads
    nofile = raise_fd_limit()
    cap = _somaxconn()
    if (nofile is not None and nofile < LISTEN_BACKLOG) or (cap is not None and cap < LISTEN_BACKLOG):
        log.warning("server.burst_limited", open_files=nofile, backlog=LISTEN_BACKLOG, somaxconn=cap,
                    hint="a burst past these may see connection resets: raise `ulimit -n` / net.core.somaxconn")
    engine_args = engine_args_from_namespace(ns, getattr(ns, "_plugin_dests", ()))
    engine = create_engine(engine_args, plugins=getattr(ns, "_plugin_manager", None),
                           own_process=engine_process(args, engine_args))
    state = build_state(engine, args)
    app = create_app(state)

    grace = float(args.graceful_shutdown_timeout)
    config = Config()
    config.bind = [_bind(args.host, args.port)]
    config.backlog = LISTEN_BACKLOG  # also how many connections asyncio accepts per wake-up
    config.accesslog = None
    config.loglevel = hypercorn_log_level(args)
    config.graceful_timeout = grace + 5.0
    config.keep_alive_timeout = 75.0
    apply_ssl(config, args)  # --ssl-*: HTTPS (checked, files loaded, at start-up)
    apply_http2(config, ns)  # --enable-http2: ALPN h2, the streams and window of HTTP/2 connections

    stop = asyncio.Event()  # shutting down: drain, then close
    close = asyncio.Event()  # hypercorn stops listening and finishes the open responses
    force = asyncio.Event()
    exit_code = 0
    watchdog = getattr(engine, "watchdog", None)
    if watchdog is not None:  # a hung step cannot be joined: the watchdog ends the process itself, non-zero
        watchdog.exit_code = WATCHDOG_EXIT_CODE

    def on_signal(signame: str) -> None:
        if stop.is_set():
            log.warning("server.force_shutdown", signal=signame)
            force.set()
        else:
            log.info("server.shutting_down", signal=signame, grace_s=grace)
            stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig.name)

    def on_fatal(message: str) -> None:
        """The engine stopped for good (a tensor-parallel rank or every data-parallel replica died):
        its requests already failed with ``message``; stop serving and exit non-zero."""
        nonlocal exit_code
        exit_code, state.ready = 1, False
        log.error("server.engine_failed", error=message)
        stop.set()

    engine.fatal_listeners.append(on_fatal)

    async def warmup() -> None:
        nonlocal exit_code
        try:
            if not args.skip_server_warmup:
                t0 = time.perf_counter()
                if not await run_internal_generate(state, "WARMUP_", max_new_tokens=4, timeout=600):
                    raise RuntimeError("the warm-up generate produced no tokens")
                log.info("server.warmup_done", seconds=round(time.perf_counter() - t0, 3))
            gc_watch.freeze("server")  # what start-up built: later collector passes skip it
            state.ready = True
            log.info("server.ready", url=f"{url_scheme(args)}://{_bind(args.host, args.port)}",
                     model=state.served_model_name)
        except Exception as e:
            log.error("server.warmup_failed", error=f"{type(e).__name__}: {e}")
            exit_code = 1
            stop.set()

    async def drain() -> None:
        """After the signal: keep listening, but /health and new requests get 503 (a load
        balancer moves on); let running requests (streams included) finish for `grace` seconds,
        abort the rest with a reason, then let hypercorn close (``close``)."""
        try:
            await stop.wait()
            state.shutting_down = True
            state.ready = False
            deadline = loop.time() + grace
            while engine.has_work() and loop.time() < deadline and not force.is_set():
                await asyncio.sleep(0.05)
            aborted = engine.abort_all(SHUTDOWN_ABORT_MESSAGE)
            if aborted:
                log.warning("server.aborting_requests", count=aborted, reason=SHUTDOWN_ABORT_MESSAGE, grace_s=grace)
            else:
                log.info("server.drained")
        finally:
            close.set()

    warm_task = asyncio.create_task(warmup())
    drain_task = asyncio.create_task(drain())
    try:
        await serve(app, config, shutdown_trigger=close.wait)  # type: ignore[arg-type]
    except OSError as e:
        raise CoreError(f"cannot listen on {_bind(args.host, args.port)}: {e}") from None
    finally:
        stop.set()
        close.set()
        warm_task.cancel()
        try:
            await asyncio.wait_for(drain_task, grace + 1.0)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            pass
        await shutdown_batches(app)
        await engine.shutdown()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    log.info("server.stopped", exit_code=exit_code)
    return exit_code
