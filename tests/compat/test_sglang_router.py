"""sglang-router 0.3.2 (the Rust gateway, ``python -m sglang_router.launch_router``) in front of
two ``core serve`` workers, under ``--policy cache_aware`` and ``--policy round_robin``.

What the router does with a worker, from its sources (``sgl-model-gateway``) and its logs:

* registration: ``GET /health`` (it probes gRPC on the same port in parallel and settles on
  HTTP), ``GET /server_info`` (``model_path``, ``served_model_name``, ``dp_size`` ...) and
  ``GET /model_info``; the served model name becomes the worker's ``model_id``;
* periodic health checks: ``GET /health`` every ``--health-check-interval-secs``;
* per request it forwards ``/generate``, ``/v1/chat/completions`` and ``/v1/completions``,
  re-serializing the body: ``/generate`` gains top-level ``model``, ``log_metrics``,
  ``return_hidden_states``, ``background``, ``no_logs``, ``return_bytes`` and
  ``return_entropy`` (SGLang ignores fields it does not use), chat gains
  ``max_completion_tokens``, ``separate_reasoning`` and friends;
* ``POST /flush_cache`` (no body) to every worker for the router's ``/flush_cache``;
  ``GET /get_load`` for its ``/get_loads`` (and for power-of-two balancing), which it parses
  as SGLang's list of per-DP-rank loads ``[{dp_rank, num_reqs, num_waiting_reqs, num_tokens}]``
  (anything else counts as a failed load fetch, reported as ``load: -1``);
* ``GET /get_model_info`` proxied to a worker for its own ``/get_model_info``.

The router runs on loopback only: its HTTP and Prometheus ports bind 127.0.0.1, no service
discovery / tracing / MCP is enabled, and ``HF_ENDPOINT`` plus the proxy variables point at a
closed loopback port, so its attempt to fetch a tokenizer for the worker's ``model_path`` (it
tries the Hugging Face Hub) fails fast without leaving the machine.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Iterator

import httpx
import psutil
import pytest

from tests.compat.conftest import client
from tests.server_utils import ServerProcess, free_port, launch, stop

pytestmark = pytest.mark.slow

ROUTER_VERSION = "0.3.2"
POLICIES = ["cache_aware", "round_robin"]
READY_TIMEOUT = 90.0
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}


# ---------------------------------------------------------------------------- router process
@dataclass
class Router:
    url: str
    proc: subprocess.Popen
    log_path: str
    prometheus_port: int

    def logs(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return re.sub(r"\x1b\[[0-9;]*m", "", f.read())


def loopback_only_env() -> dict[str, str]:
    """Send anything the router would fetch from outside (the Hub, a proxy-routed URL) to a
    closed loopback port instead."""
    dead = f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "HF_ENDPOINT": dead, "HF_HUB_OFFLINE": "1", "NO_PROXY": "127.0.0.1,localhost,::1",
           "no_proxy": "127.0.0.1,localhost,::1"}
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        env[name] = env[name.lower()] = dead
    return env


def launch_router(worker_urls: list[str], policy: str) -> Router:
    port, prometheus_port = free_port(), free_port()
    args = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *worker_urls, "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
            "--health-check-interval-secs", "2", "--shutdown-grace-period-secs", "5", "--log-level", "info"]
    fd, log_path = tempfile.mkstemp(prefix="sglang-router-", suffix=".log")
    with os.fdopen(fd, "w") as log_file:
        proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, env=loopback_only_env())
    router = Router(f"http://127.0.0.1:{port}", proc, log_path, prometheus_port)
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}:\n{router.logs()[-4000:]}")
        try:
            r = httpx.get(router.url + "/readiness", timeout=2.0)
            if r.status_code == 200 and r.json().get("healthy_workers") == len(worker_urls):
                return router
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() > deadline:
            stop_router(router)
            raise RuntimeError(f"router not ready with {len(worker_urls)} workers after {READY_TIMEOUT:.0f}s:\n"
                               f"{router.logs()[-4000:]}")
        time.sleep(0.3)


def stop_router(router: Router) -> None:
    if router.proc.poll() is None:
        router.proc.send_signal(signal.SIGTERM)
        try:
            router.proc.wait(30)
        except subprocess.TimeoutExpired:
            router.proc.kill()
            router.proc.wait()
    os.unlink(router.log_path)


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def router_package() -> Any:
    package = client("sglang_router")
    from importlib.metadata import version

    assert version("sglang-router") == ROUTER_VERSION, f"these tests pin sglang-router {ROUTER_VERSION}"
    return package


@pytest.fixture(scope="module")
def workers(router_package: Any) -> Iterator[list[str]]:
    """Two ``core serve`` workers (default flags, one CPU thread each), started in parallel."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(launch) for _ in range(2)]
    servers: list[ServerProcess] = [f.result() for f in futures if f.exception() is None]
    failures = [f.exception() for f in futures if f.exception() is not None]
    if failures:
        for server in servers:
            stop(server, check=False)
        raise failures[0]
    ok = False
    try:
        yield [s.base_url for s in servers]
        ok = True
    finally:
        problems = []
        for server in servers:
            logs = server.logs()
            code = stop(server, check=False)
            if code != 0:
                problems.append(f"worker {server.base_url} exited with {code}:\n{logs[-3000:]}")
        if ok:
            assert not problems, "\n".join(problems)


@pytest.fixture(scope="module", params=POLICIES)
def router(request: pytest.FixtureRequest, workers: list[str]) -> Iterator[Router]:
    """The router for one policy; the workers stay up across both policies."""
    router = launch_router(workers, request.param)
    try:
        yield router
    finally:
        stop_router(router)


@pytest.fixture(scope="module")
def model(workers: list[str]) -> str:
    return httpx.get(workers[0] + "/get_model_info", timeout=10).json()["served_model_name"]


def sse_data(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of a server-sent-event stream, in order."""
    return [line[len("data:"):].strip() for line in response.iter_lines() if line.startswith("data:")]


# ---------------------------------------------------------------------------- the worker API the router parses
def test_worker_get_load_is_sglang_list(workers: list[str]) -> None:
    """``GET /get_load``: one entry per DP rank, as the router's ``get_worker_load`` reads it."""
    for url in workers:
        r = httpx.get(url + "/get_load", timeout=10)
        assert r.status_code == 200, r.text
        loads = r.json()
        assert isinstance(loads, list) and len(loads) == 1, loads
        entry = loads[0]
        assert entry["dp_rank"] == 0
        for key in ("num_reqs", "num_waiting_reqs", "num_tokens"):
            assert isinstance(entry[key], int) and entry[key] >= 0, entry


def test_worker_server_info_parses_as_router_expects(workers: list[str]) -> None:
    """The router deserializes ``/server_info`` into typed optional fields; a wrong type (or
    both ``model`` and ``model_id``, which alias) makes it drop all of them."""
    info = httpx.get(workers[0] + "/server_info", timeout=10).json()
    assert not ("model" in info and "model_id" in info)
    for key in ("model_path", "served_model_name", "version"):
        assert info.get(key) is None or isinstance(info[key], str), key
    for key in ("dp_size", "max_batch_size", "max_total_tokens", "max_prefill_tokens", "max_running_requests",
                "max_num_reqs"):
        assert info.get(key) is None or (isinstance(info[key], int) and info[key] >= 0), key
    model_info = httpx.get(workers[0] + "/model_info", timeout=10).json()
    assert model_info["is_generation"] is True and isinstance(model_info["model_path"], str)


# ---------------------------------------------------------------------------- through the router
def test_router_listens_on_loopback_only(router: Router) -> None:
    listening = {(c.laddr.ip, c.laddr.port) for c in psutil.Process(router.proc.pid).net_connections("inet")
                 if c.status == psutil.CONN_LISTEN}
    ports = {port for _, port in listening}
    assert int(router.url.rsplit(":", 1)[1]) in ports and router.prometheus_port in ports, listening
    assert all(ip in LOOPBACK_HOSTS for ip, _ in listening), listening
    hosts = set(re.findall(r"(?:https?|grpc)://(\[[^\]]+\]|[^/:\s\"'),]+)", router.logs()))
    assert hosts <= LOOPBACK_HOSTS, f"the router mentions non-loopback hosts: {hosts - LOOPBACK_HOSTS}"


def test_router_registers_both_workers(router: Router, workers: list[str], model: str) -> None:
    body = httpx.get(router.url + "/workers", timeout=10).json()
    registered = {w["url"]: w for w in body["workers"]}
    assert set(registered) == set(workers)
    for worker in registered.values():
        assert worker["is_healthy"] is True
        assert worker["connection_mode"] == "HTTP"
        assert worker["model_id"] == model  # from the worker's /server_info served_model_name
    for path in ("/health", "/liveness", "/readiness"):
        assert httpx.get(router.url + path, timeout=10).status_code == 200, path


def test_router_models_and_model_info(router: Router, model: str) -> None:
    models = httpx.get(router.url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [model]
    r = httpx.get(router.url + "/get_model_info", timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["is_generation"] is True


def test_router_chat_completion(router: Router, model: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 5,
            "temperature": 0}
    r = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"]["role"] == "assistant" and out["choices"][0]["message"]["content"]
    assert out["usage"]["completion_tokens"] == 5 and out["choices"][0]["finish_reason"] == "length"


def test_router_chat_completion_stream(router: Router, model: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 5,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        data = sse_data(r)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def test_router_completion(router: Router, model: str) -> None:
    body = {"model": model, "prompt": "Count: 1, 2, 3,", "max_tokens": 4, "temperature": 0}
    r = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and out["choices"][0]["text"]
    assert out["usage"]["completion_tokens"] == 4


def test_router_generate(router: Router) -> None:
    body = {"text": "Count: 1, 2, 3,", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    r = httpx.post(router.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["text"]
    assert out["meta_info"]["completion_tokens"] == 4
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


def test_router_generate_stream(router: Router) -> None:
    body = {"text": "Count: 1, 2, 3,", "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "stream": True}
    with httpx.stream("POST", router.url + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        data = sse_data(r)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert len(chunks) > 1
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # SGLang streams the text so far
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_router_flush_cache(router: Router) -> None:
    r = httpx.post(router.url + "/flush_cache", timeout=30)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["workers_flushed"] == 2 and out["total_http_workers"] == 2, out


def test_router_get_loads(router: Router, workers: list[str]) -> None:
    """The router's ``/get_loads`` fetches each worker's ``/get_load``; ``-1`` means it could not parse it."""
    r = httpx.get(router.url + "/get_loads", timeout=30)
    assert r.status_code == 200, r.text
    loads = {w["worker"]: w["load"] for w in r.json()["workers"]}
    assert set(loads) == set(workers)
    assert all(load >= 0 for load in loads.values()), loads


def test_router_many_generates_keep_circuit_closed(router: Router, model: str) -> None:
    """25 valid requests in a row: every one succeeds, so the circuit breaker (open after 10
    failures) never trips and a later chat still answers 200, not 503."""
    for i in range(25):
        body = {"text": f"Request {i}: count 1, 2, 3,", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        r = httpx.post(router.url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, f"request {i}: {r.status_code} {r.text}"
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    r = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    time.sleep(2.5)  # at least one periodic /health round (every 2 s) since the burst
    workers = httpx.get(router.url + "/workers", timeout=10).json()["workers"]
    assert all(w["is_healthy"] for w in workers), workers
