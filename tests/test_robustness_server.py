"""The real ``core serve`` process under faults: a forward that hangs trips the watchdog (the
in-flight requests fail, the process exits non-zero), and SIGTERM with open streams drains
them (exit 0), failing the rest with a reason once ``--drain-timeout`` passes.

The server runs a tiny random Llama through a small launcher that patches the forward: a batch
holding a request whose rid starts with ``hang-`` sleeps for an hour, one with ``slow-`` sleeps
``CORE_TEST_SLOW_S`` seconds per step (so a stream lasts as long as the test needs)."""

from __future__ import annotations

import json
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.server_utils import ServerProcess, launch, stop
from tests.test_robustness_limits import CHAT_TEMPLATE

LAUNCHER = '''
import os, sys, time
from core.engine import model_runner

_run = model_runner.ModelRunner.run
SLOW = float(os.environ.get("CORE_TEST_SLOW_S", "0"))


def run(self, batch):
    rids = [r.rid for r in batch.reqs]
    if any(r.startswith("hang-") for r in rids):
        time.sleep(3600)
    if SLOW and any(r.startswith("slow-") for r in rids):
        time.sleep(SLOW)
    return _run(self, batch)


model_runner.ModelRunner.run = run
assert sys.argv[1:3] == ["-m", "core.cli"], sys.argv
from core.cli import main

sys.exit(main(sys.argv[3:]))
'''


def make_patched_python(d: Path) -> str:
    """An 'interpreter' for ``launch(python=...)`` that runs ``core.cli`` with the patched forward."""
    (d / "patched_cli.py").write_text(LAUNCHER)
    exe = d / "python"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{d / "patched_cli.py"}" "$@"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(exe)


@pytest.fixture(scope="module")
def patched_python(tmp_path_factory) -> str:
    return make_patched_python(tmp_path_factory.mktemp("launcher"))


def _launch(patched_python: str, model: Path, *flags: str, slow: float = 0.0) -> ServerProcess:
    return launch("--model-path", str(model), "--dtype", "float32", "--chat-template", CHAT_TEMPLATE, *flags,
                  python=patched_python, env={"CORE_TEST_SLOW_S": str(slow)},
                  base_args=("--cpu-threads", "1", "--max-total-tokens", "4096", "--log-level", "info"))


def _sse(lines: Any) -> Iterator[Any]:
    """The data of each SSE event (``[DONE]`` as the string), as they arrive."""
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)


class Stream(threading.Thread):
    """A streaming /generate read to its end on a thread: ``events``, ``first`` (set on the first event), ``error``."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.events: list[Any] = []
        self.first = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/generate", json=self.body, timeout=60) as r:
                assert r.status_code == 200, r.read()
                for ev in _sse(r.iter_lines()):
                    self.events.append(ev)
                    self.first.set()
        except BaseException as e:  # the test reads it
            self.error = e
        finally:
            self.first.set()


def _wait_exit(server: ServerProcess, timeout: float) -> int:
    try:
        return server.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()
        raise AssertionError(f"the server did not exit within {timeout}s:\n{server.logs()[-4000:]}")


def test_sigterm_drains_open_streams_and_exits_zero(tiny_llama, patched_python) -> None:
    server = _launch(patched_python, tiny_llama()[0], "--drain-timeout", "20", slow=0.03)
    url = server.base_url
    streams = [Stream(url, {"input_ids": [5, 6, 7], "rid": f"slow-{i}", "stream": True,
                            "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}) for i in range(3)]
    try:
        for s in streams:
            s.start()
        for s in streams:
            assert s.first.wait(30)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert server.proc.poll() is None  # draining, still listening
        assert httpx.get(url + "/health", timeout=5).status_code == 503
        late = httpx.post(url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=5)
        assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"], late.text
        assert int(late.headers["retry-after"]) > 0
        for s in streams:
            s.join(30)
        code = _wait_exit(server, 30)
        took = time.monotonic() - t0
    finally:
        stop(server, check=False)
    assert code == 0, server.logs()[-4000:] if server.proc.returncode else ""
    for s in streams:
        assert s.error is None, s.error
        assert s.events[-1] == "[DONE]"
        final = s.events[-2]
        assert final["meta_info"]["finish_reason"]["type"] == "length", final["meta_info"]
        assert len(final["output_ids"]) == 40
    assert took < 20, took


def test_drain_timeout_fails_the_rest_with_a_reason(tiny_llama, patched_python) -> None:
    server = _launch(patched_python, tiny_llama()[0], "--drain-timeout", "1", slow=0.05)
    url = server.base_url
    stream = Stream(url, {"input_ids": [5, 6, 7], "rid": "slow-long", "stream": True,
                          "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}})
    try:
        stream.start()
        assert stream.first.wait(30)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        stream.join(30)
        code = _wait_exit(server, 30)
        took = time.monotonic() - t0
    finally:
        stop(server, check=False)
    assert code == 0
    assert stream.error is None, stream.error
    final = [e for e in stream.events if isinstance(e, dict)][-1]
    reason = final["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["message"] == "the server shut down before the request finished"
    assert 0 < len(final["output_ids"]) < 200
    assert took < 10, took
