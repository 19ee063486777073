"""Start the real ``core serve`` as a subprocess for HTTP tests.

``start_server(*extra_args)`` is a context manager yielding the base URL
(``http://127.0.0.1:PORT``); it waits for ``/health`` to return 200, and on exit
sends SIGTERM and asserts the server exited with status 0. ``default_server`` is a
session-scoped fixture with the default flags; import it into a test module
(``from tests.server_utils import default_server``) to use it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator

import httpx
import pytest

BASE_ARGS = ("--cpu-threads", "1", "--max-total-tokens", "16384", "--log-level", "warning")
STARTUP_TIMEOUT = float(os.environ.get("CORE_TEST_STARTUP_TIMEOUT", "240"))  # first GGUF conversion ~40 s
SHUTDOWN_TIMEOUT = 30.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A running server: ``base_url``, ``proc``, ``log_path`` and ``logs()``."""

    def __init__(self, proc: subprocess.Popen, base_url: str, log_path: str) -> None:
        self.proc, self.base_url, self.log_path = proc, base_url, log_path

    def logs(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()


def launch(*extra_args: str, env: dict | None = None, base_args: tuple[str, ...] = BASE_ARGS,
           startup_timeout: float = STARTUP_TIMEOUT, wait_path: str = "/health",
           python: str = sys.executable, verify: Any = None) -> ServerProcess:
    """Spawn ``python -m core.cli serve`` on a free port and wait until ``wait_path`` answers 200.
    ``python`` is the interpreter (e.g. a virtual environment's, to test an installed plugin);
    ``verify``: an ``ssl.SSLContext`` trusting the server's certificate (the flags serve HTTPS)."""
    port = free_port()
    args = [python, "-m", "core.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *base_args, *extra_args]
    fd, log_path = tempfile.mkstemp(prefix="core-serve-", suffix=".log")
    log_file = os.fdopen(fd, "w")
    proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    log_file.close()
    server = ServerProcess(proc, f"{'http' if verify is None else 'https'}://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + startup_timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} during start-up:\n{server.logs()[-4000:]}")
        try:
            if httpx.get(server.base_url + wait_path, timeout=2.0, verify=verify or True).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop(server, check=False)
            raise RuntimeError(f"server not healthy after {startup_timeout:.0f}s:\n{server.logs()[-4000:]}")
        time.sleep(0.2)


def stop(server: ServerProcess, check: bool = True, sig: int = signal.SIGTERM) -> int:
    """Send ``sig`` and wait; with ``check``, assert a clean exit (status 0)."""
    proc = server.proc
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(SHUTDOWN_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            if check:
                raise AssertionError(f"server did not exit within {SHUTDOWN_TIMEOUT}s of signal {sig}:\n{server.logs()[-4000:]}")
    code = proc.returncode
    if check:
        assert code == 0, f"server exited with {code}:\n{server.logs()[-4000:]}"
    with contextlib.suppress(OSError):
        os.unlink(server.log_path)
    return code


@contextlib.contextmanager
def start_server(*extra_args: str, env: dict | None = None) -> Iterator[str]:
    """Run a real server for the duration of the block; yields its base URL."""
    server = launch(*extra_args, env=env)
    ok = False
    try:
        yield server.base_url
        ok = True
    finally:
        stop(server, check=ok)


@contextlib.contextmanager
def start_server_process(*extra_args: str, env: dict | None = None, **launch_kwargs) -> Iterator[ServerProcess]:
    """Like ``start_server`` but yields the ``ServerProcess`` (for logs and signals);
    ``launch_kwargs`` go to :func:`launch` (``python=``, ``base_args=``, ...)."""
    server = launch(*extra_args, env=env, **launch_kwargs)
    ok = False
    try:
        yield server
        ok = True
    finally:
        stop(server, check=ok)


# One default server per test session, shared by the ``default_server`` and ``server``
# fixtures (either can be imported alone); stopped, with the exit-0 check, when the last
# fixture that uses it is finalized.
_default: ServerProcess | None = None
_default_users = 0


def _acquire_default() -> str:
    global _default, _default_users
    if _default is None:
        _default = launch()
    _default_users += 1
    return _default.base_url


def _release_default() -> None:
    global _default, _default_users
    _default_users -= 1
    if _default_users == 0 and _default is not None:
        server, _default = _default, None
        stop(server)


@pytest.fixture(scope="session")
def default_server() -> Iterator[str]:
    """A server with the default flags (BASE_ARGS) for the whole test session; yields its base URL."""
    url = _acquire_default()
    try:
        yield url
    finally:
        _release_default()


@pytest.fixture(scope="session")
def server() -> Iterator[str]:
    """The same shared default server as ``default_server``."""
    url = _acquire_default()
    try:
        yield url
    finally:
        _release_default()


def serve_in_process(engine_kwargs: dict[str, Any], server_args: Any, calls: Any, timeout: float = 120) -> Any:
    """``await calls(client)`` against the app of an in-process ``AsyncEngine`` (a small fp32 CPU
    engine, no grammar backend, updated with ``engine_kwargs``) under ``server_args`` (ServerArgs),
    through httpx's ASGI transport; the engine is shut down after."""
    import asyncio

    from core.engine import AsyncEngine
    from core.engine.config import engine_args_from_kwargs
    from core.server.app import create_app
    from core.server.state import build_state

    async def go() -> Any:
        kw = dict(dtype="float32", max_total_tokens=2048, cpu_threads=1, device="cpu", grammar_backend="none",
                  random_seed=0)
        engine = AsyncEngine(engine_args_from_kwargs({**kw, **engine_kwargs}))
        state = build_state(engine, server_args)
        state.ready = True
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://t",
                                         timeout=timeout) as c:
                return await calls(c)
        finally:
            await engine.shutdown()

    return asyncio.run(go())
