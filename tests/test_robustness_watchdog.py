"""The watchdog (``--watchdog-timeout``): a step that hangs instead of raising fails every
in-flight request with a message naming the step, turns /health and new requests into 503s,
and (under ``core serve``) ends the process non-zero so that a supervisor restarts it."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import pytest

from tests.server_utils import stop
from tests.test_robustness_limits import Served, gen
from tests.test_robustness_server import Stream, _launch, _wait_exit, make_patched_python
from tests.test_server_native import assert_error


@pytest.fixture(scope="module")
def patched_python(tmp_path_factory) -> str:
    return make_patched_python(tmp_path_factory.mktemp("launcher"))


def _hang(s: Served) -> threading.Event:
    """The engine's forward hangs on batches with a ``hang-`` request until the event is set."""
    run = s.engine.runner.run
    release = threading.Event()

    def hanging(batch: Any) -> Any:
        if any(r.rid.startswith("hang-") for r in batch.reqs):
            release.wait(30)
        return run(batch)

    s.engine.runner.run = hanging
    return release


def test_watchdog_fails_in_flight_requests_and_health(tiny_llama) -> None:
    s = Served(tiny_llama()[0], "--watchdog-timeout", "0.5")
    release = _hang(s)

    async def scenario() -> None:
        c = s.client
        assert (await c.post("/generate", json=gen())).status_code == 200  # a normal step passes
        hung = asyncio.create_task(c.post("/generate", json={**gen(), "rid": "hang-1"}))
        await asyncio.sleep(0.1)
        waiting = asyncio.create_task(c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}))
        out = (await asyncio.wait_for(hung, 10)).json()
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "watchdog" in reason["message"] and "hang-1" in reason["message"]
        err = assert_error(await asyncio.wait_for(waiting, 10), 500, None)
        assert "watchdog" in err["message"]
        assert (await c.get("/health")).status_code == 503
        resp = await c.post("/generate", json=gen())
        assert "watchdog" in assert_error(resp, 503, None)["message"] and resp.headers["retry-after"]

    try:
        s.run(scenario())
        assert s.engine.watchdog.tripped and not s.engine.healthy
    finally:
        release.set()
        s.close()


@pytest.mark.parametrize("at_runtime", [False, True])
def test_a_crash_dumps_the_recent_requests(tiny_llama, tmp_path, at_runtime) -> None:
    """``--crash-dump-folder`` (or ``/configure_logging``'s ``crash_dump_folder``): when the engine
    stops for good (here a watchdog trip) the requests of the last minutes, the one that hung
    included, are written there as JSON with the error."""
    import json

    folder = tmp_path / "dumps"
    flags = ("--watchdog-timeout", "0.5") + (() if at_runtime else ("--crash-dump-folder", str(folder)))
    s = Served(tiny_llama()[0], *flags)
    release = _hang(s)

    async def scenario() -> None:
        c = s.client
        if at_runtime:
            assert (await c.post("/configure_logging", json={"crash_dump_folder": str(folder)})).status_code == 200
        assert (await c.post("/generate", json={**gen(), "rid": "before"})).status_code == 200
        await asyncio.wait_for(c.post("/generate", json={**gen(), "rid": "hang-1"}), 10)

    try:
        s.run(scenario())
        (dump,) = folder.glob("crash_dump_*.json")
        data = json.loads(dump.read_text())
        assert "watchdog" in data["error"] and [r["rid"] for r in data["requests"]] == ["before", "hang-1"]
        assert data["requests"][1]["input_ids"] == s.engine.tokenize(gen()["text"], None)
        assert data["requests"][1]["sampling_params"]["max_new_tokens"] == gen()["sampling_params"]["max_new_tokens"]
    finally:
        release.set()
        s.close()


def test_soft_watchdog_logs_a_slow_step_once_and_lets_it_finish(tiny_llama) -> None:
    """``--soft-watchdog-timeout``: a step past it is logged once, with its requests and the stuck
    thread's stack, and finishes as usual; the engine stays healthy; a fast step logs nothing."""
    from structlog.testing import capture_logs

    s = Served(tiny_llama()[0], "--soft-watchdog-timeout", "0.2")
    run = s.engine.runner.run

    def slow(batch: Any) -> Any:
        if any(r.rid.startswith("slow-") for r in batch.reqs):
            time.sleep(0.8)
        return run(batch)

    s.engine.runner.run = slow

    async def scenario() -> tuple[dict, dict]:
        fast = (await s.client.post("/generate", json=gen())).json()
        out = (await s.client.post("/generate", json={**gen(), "rid": "slow-1"})).json()
        return fast, out

    try:
        with capture_logs() as logs:
            fast, out = s.run(scenario())
        soft = [e for e in logs if e["event"] == "engine.soft_watchdog"]
        assert fast["meta_info"]["finish_reason"]["type"] == "length"
        assert out["meta_info"]["finish_reason"]["type"] == "length"  # it finished: only reported
        assert soft and all(e["rids"] == ["slow-1"] for e in soft) and "thread" in soft[0]["stack"]
        assert len({e["step"] for e in soft}) == len(soft)  # once per step
        assert s.engine.healthy and not s.engine.watchdog.tripped
    finally:
        s.close()


def test_watchdog_flag() -> None:
    from core.cli import build_parser
    from core.engine.config import engine_args_from_namespace
    from core.errors import CoreError
    from core.server.args import validate_serve_args

    ns = build_parser().parse_args(["serve"])
    assert engine_args_from_namespace(ns).watchdog_timeout == 300.0  # SGLang's default
    assert build_parser().parse_args(["serve", "--drain-timeout", "7"]).graceful_shutdown_timeout == 7.0
    with pytest.raises(CoreError, match="--watchdog-timeout"):
        validate_serve_args(build_parser().parse_args(["serve", "--watchdog-timeout", "-1"]))
    assert engine_args_from_namespace(ns).soft_watchdog_timeout is None
    from core.engine.config import check_scheduling_args

    with pytest.raises(CoreError, match="--soft-watchdog-timeout must be > 0"):
        check_scheduling_args(engine_args_from_namespace(build_parser().parse_args(["serve", "--soft-watchdog-timeout",
                                                                                      "0"])))


def test_hung_forward_trips_the_watchdog_and_the_server_exits_nonzero(tiny_llama, patched_python) -> None:
    server = _launch(patched_python, tiny_llama()[0], "--watchdog-timeout", "2")
    url = server.base_url
    try:
        ok = httpx.post(url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3}}, timeout=30)
        assert ok.status_code == 200, ok.text
        hung = Stream(url, {"text": "hi", "rid": "hang-7", "stream": True, "sampling_params": {"max_new_tokens": 8}})
        hung.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        waiting = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                 "max_tokens": 4}, timeout=30)
        failed_after = time.monotonic() - t0
        hung.join(30)
        try:  # the server stops listening as soon as its requests have failed
            health = httpx.get(url + "/health", timeout=5).status_code
        except httpx.TransportError:
            health = None
        code = _wait_exit(server, 30)
        logs = server.logs()
    finally:
        stop(server, check=False)
    assert failed_after < 10, failed_after
    assert waiting.status_code == 500 and "watchdog" in waiting.json()["error"]["message"], waiting.text
    assert hung.error is None, hung.error
    final = [e for e in hung.events if isinstance(e, dict)][-1]
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert "watchdog" in final["meta_info"]["finish_reason"]["message"]
    assert health in (503, None)
    assert code == 1, logs[-4000:]
    assert "engine.watchdog_timeout" in logs and "hang-7" in logs and "engine.watchdog_exit" in logs
    assert "patched_cli.py" in logs  # the stack of the hung forward was logged
