"""SGLang's ``--enable-http2``, ``--http2-max-concurrent-streams``,
``--http2-initial-connection-window-size`` and ``--tokenizer-worker-num``. Two real ``core serve``
over a tiny model: one HTTPS (a self-signed certificate made here) with both sizes set, answered
by ALPN; one cleartext with SGLang's defaults, answered by prior knowledge. An ``h2`` client reads
each server's preface (its SETTINGS and connection WINDOW_UPDATE); the window rule, the
hypercorn config and the start-up errors run in-process."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from core.errors import CoreError
from tests.server_utils import ServerProcess, launch, stop
from tests.test_launch_flags_server import _self_signed

ROOT_DIR = Path(__file__).resolve().parent.parent
STREAMS, WINDOW = 7, 2 * 1024 * 1024
H2_INITIAL_WINDOW = 65535


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _self_signed(tmp_path_factory.mktemp("tls"), "server", None)


def _trusting(cert: Path, alpn: list[str] | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(cert))
    if alpn:
        ctx.set_alpn_protocols(alpn)
    return ctx


@pytest.fixture(scope="module")
def tls_srv(tiny_llama, cert: tuple[Path, Path]) -> Iterator[ServerProcess]:
    path, _ = tiny_llama()
    server = launch("--model-path", str(path), "--dtype", "float32", "--skip-server-warmup",
                    "--ssl-certfile", str(cert[0]), "--ssl-keyfile", str(cert[1]), "--enable-http2",
                    "--http2-max-concurrent-streams", str(STREAMS),
                    "--http2-initial-connection-window-size", str(WINDOW), verify=_trusting(cert[0]))
    yield server
    stop(server)


@pytest.fixture(scope="module")
def plain_srv(tiny_llama) -> Iterator[ServerProcess]:
    path, _ = tiny_llama()
    server = launch("--model-path", str(path), "--dtype", "float32", "--skip-server-warmup", "--enable-http2",
                    "--tokenizer-worker-num", "1")
    yield server
    stop(server)


def _preface(server: ServerProcess, ctx: ssl.SSLContext | None = None) -> tuple[dict[int, int], int]:
    """Open an HTTP/2 connection with the ``h2`` package (ALPN under ``ctx``, else prior knowledge);
    return the server's SETTINGS and its connection-level WINDOW_UPDATE increment."""
    import h2.config
    import h2.connection
    import h2.events

    url = urlsplit(server.base_url)
    sock: socket.socket = socket.create_connection((url.hostname, url.port), timeout=10)
    try:
        if ctx is not None:
            sock = ctx.wrap_socket(sock, server_hostname="localhost")
            assert sock.selected_alpn_protocol() == "h2"
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        sock.sendall(conn.data_to_send())
        settings: dict[int, int] | None = None
        window: int | None = None
        while settings is None or window is None:
            data = sock.recv(65536)
            assert data, "the server closed the connection before its preface"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RemoteSettingsChanged):
                    settings = {int(k): v.new_value for k, v in event.changed_settings.items()}
                elif isinstance(event, h2.events.WindowUpdated) and event.stream_id == 0:
                    window = event.delta
        return settings, window
    finally:
        sock.close()


# ---------------------------------------------------------------------------- real servers
def test_tls_alpn_negotiates_http2_with_the_flag(tls_srv: ServerProcess, cert: tuple[Path, Path]) -> None:
    """``--enable-http2`` over HTTPS: a client offering h2 by ALPN is answered in HTTP/2."""
    with httpx.Client(base_url=tls_srv.base_url, http2=True, verify=_trusting(cert[0]), timeout=60) as c:
        health = c.get("/health")
        gen = c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    assert health.status_code == 200 and health.http_version == "HTTP/2"
    assert gen.status_code == 200 and gen.http_version == "HTTP/2", gen.text
    assert gen.json()["meta_info"]["completion_tokens"] == 3


def test_streaming_generates_multiplexed_over_http2_deliver_every_event(tls_srv: ServerProcess,
                                                                        cert: tuple[Path, Path]) -> None:
    """Three streaming /generate at once on one HTTP/2 client: each answered in HTTP/2 with one
    event per token (``--stream-interval 1``), its last one finished by length, then [DONE]."""
    tokens = 6

    async def one(c: httpx.AsyncClient, i: int) -> tuple[str, list[str]]:
        body = {"text": f"hello {i}", "stream": True, "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}
        async with c.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200
            return r.http_version, [line[len("data: "):] async for line in r.aiter_lines() if line.startswith("data: ")]

    async def go() -> list[tuple[str, list[str]]]:
        async with httpx.AsyncClient(base_url=tls_srv.base_url, http2=True, verify=_trusting(cert[0]),
                                     timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(3)))

    for version, events in asyncio.run(go()):
        assert version == "HTTP/2"
        assert events[-1] == "[DONE]" and len(events) == tokens + 1, events
        last = json.loads(events[-2])["meta_info"]
        assert last["completion_tokens"] == tokens and last["finish_reason"]["type"] == "length"


def test_the_sizes_reach_the_client_in_the_preface(tls_srv: ServerProcess, cert: tuple[Path, Path]) -> None:
    """``--http2-max-concurrent-streams 7``: the SETTINGS frame advertises 7 (hypercorn's own
    default is 100); ``--http2-initial-connection-window-size 2 MiB``: the connection's window is
    opened from HTTP/2's 65,535 to 2 MiB by one WINDOW_UPDATE on stream 0."""
    import h2.settings

    settings, increment = _preface(tls_srv, _trusting(cert[0], ["h2"]))
    assert settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] == STREAMS
    assert increment == WINDOW - H2_INITIAL_WINDOW


def test_cleartext_prior_knowledge_gets_sglangs_default_sizes(plain_srv: ServerProcess) -> None:
    """Without TLS, an HTTP/2 client by prior knowledge is answered in HTTP/2; the sizes left unset
    are SGLang's (200 streams, a 1 MiB connection window); ``--tokenizer-worker-num 1`` is accepted."""
    import h2.settings

    with httpx.Client(base_url=plain_srv.base_url, http1=False, http2=True, timeout=60) as c:
        r = c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200 and r.http_version == "HTTP/2", r.text
    settings, increment = _preface(plain_srv)
    assert settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] == 200
    assert increment == 1024 * 1024 - H2_INITIAL_WINDOW


# ---------------------------------------------------------------------------- in-process
def _ns(*flags: str):
    from core.cli import build_parser

    return build_parser().parse_args(["serve", "--model-path", "m", "--device", "cpu", *flags])


def test_hypercorn_config_offers_h2_by_alpn_only_under_the_flag() -> None:
    """Without ``--enable-http2`` TLS offers only http/1.1 (SGLang's uvicorn speaks no HTTP/2);
    with it, h2 first, the streams set and the window recorded for the protocol."""
    from hypercorn.config import Config

    from core.server.http2 import WINDOW_ATTR, apply_http2

    off, on = Config(), Config()
    apply_http2(off, _ns())
    apply_http2(on, _ns("--enable-http2", "--http2-max-concurrent-streams", "9"))
    assert off.alpn_protocols == ["http/1.1"] and not hasattr(off, WINDOW_ATTR)
    assert on.alpn_protocols == ["h2", "http/1.1"] and on.h2_max_concurrent_streams == 9
    assert getattr(on, WINDOW_ATTR) == 1024 * 1024


def test_the_connection_window_opens_to_the_size() -> None:
    """``open_connection_window`` on an ``h2`` server connection: the client may send the size at once."""
    import h2.config
    import h2.connection

    from core.server.http2 import open_connection_window

    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    open_connection_window(server, 200_000)
    client.receive_data(server.data_to_send())
    assert client.outbound_flow_control_window == 200_000


@pytest.mark.parametrize("flags, message", [
    (["--enable-http2", "--http2-max-concurrent-streams", "0"], "--http2-max-concurrent-streams must be between 1 and"),
    (["--enable-http2", "--http2-max-concurrent-streams", str(2**32)], "between 1 and 4294967295, got 4294967296"),
    (["--enable-http2", "--http2-initial-connection-window-size", "1023"],
     "--http2-initial-connection-window-size must be between 1024 and 2147483647 bytes, got 1023"),
    (["--enable-http2", "--http2-initial-connection-window-size", "16384"],
     "--http2-initial-connection-window-size 16384: HTTP/2 starts every window at 65535 bytes"),
    (["--enable-http2", "--http2-initial-connection-window-size", str(2**31)], "got 2147483648"),
    (["--tokenizer-worker-num", "0"], "--tokenizer-worker-num must be >= 1, got 0"),
    (["--tokenizer-worker-num", "4"], "--tokenizer-worker-num 4 is not supported.*--enable-frontend-multiprocessing"
                                      ".*several `core serve` behind a load balancer"),
])
def test_bad_values_are_start_up_errors(flags: list[str], message: str) -> None:
    from core.server.args import validate_serve_args

    with pytest.raises(CoreError, match=message):
        validate_serve_args(_ns(*flags))


def test_sizes_without_the_flag_are_ignored_as_in_sglang() -> None:
    """SGLang reads (and bounds) the sizes only under ``--enable-http2``: without it, even a value
    out of range starts; one worker is SGLang's default and accepted."""
    from core.server.args import validate_serve_args

    ns = _ns("--http2-max-concurrent-streams", "0", "--tokenizer-worker-num", "1")
    validate_serve_args(ns)
    assert (ns.enable_http2, ns.http2_max_concurrent_streams, ns.tokenizer_worker_num) == (False, 0, 1)


def test_a_bad_size_stops_core_serve_with_one_line() -> None:
    """The CLI names the flag and exits non-zero before loading a model, with no traceback."""
    r = subprocess.run([sys.executable, "-m", "core.cli", "serve", "--model-path", "m", "--device", "cpu",
                        "--enable-http2", "--http2-initial-connection-window-size", "10"],
                       capture_output=True, text=True, cwd=ROOT_DIR, timeout=120)
    assert r.returncode != 0 and "--http2-initial-connection-window-size" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
