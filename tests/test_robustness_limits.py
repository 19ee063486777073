"""Hostile and oversized input, overload and a hung step, against the real app in this process
(a tiny random Llama, so every test is fast): body size (413), Content-Type, JSON nesting,
sampling limits, prompts far past the context (refused before tokenizing), tool schemas,
a full queue (503 + Retry-After), /health under load, and the watchdog failing the engine.

``Served`` (the app on a background event loop, sync ``post`` / ``get``) is shared with
tests/test_fuzz_server.py."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.test_server_native import assert_error

# A plain template so chat works on the tiny model (its char tokenizer has none).
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
TINY_FLAGS = ("--dtype", "float32", "--cpu-threads", "1", "--max-total-tokens", "4096", "--chat-template", CHAT_TEMPLATE,
              "--log-level", "warning")


class Served:
    """``core serve``'s app over a tiny model, in this process: the app and the engine live on a
    background event loop; ``post`` / ``get`` / ``run`` block until done."""

    def __init__(self, model_path: Path | str, *flags: str) -> None:
        from core.cli import build_parser
        from core.engine.async_engine import AsyncEngine
        from core.engine.config import engine_args_from_namespace
        from core.server.app import create_app
        from core.server.args import ServerArgs, validate_serve_args
        from core.server.state import build_state

        ns = build_parser().parse_args(["serve", "--model-path", str(model_path), *TINY_FLAGS, *flags])
        validate_serve_args(ns)
        self.engine = AsyncEngine(engine_args_from_namespace(ns))
        self.state = build_state(self.engine, ServerArgs.from_namespace(ns))
        self.state.ready = True
        self.app = create_app(self.state)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="served-loop", daemon=True)
        self._thread.start()
        self.client: httpx.AsyncClient = self.run(self._client())

    async def _client(self) -> httpx.AsyncClient:
        # a 500 comes back as a response (what a client sees), not as the app's exception
        transport = httpx.ASGITransport(app=self.app, raise_app_exceptions=False)
        return httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120)

    def run(self, coro: Any, timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def post(self, path: str, **kw: Any) -> httpx.Response:
        return self.run(self.client.post(path, **kw))

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return self.run(self.client.get(path, **kw))

    def close(self) -> None:
        try:
            self.run(self.client.aclose())
            self.run(self.engine.shutdown())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


@pytest.fixture(scope="module")
def served(tiny_llama):
    path, _ = tiny_llama()
    s = Served(path)
    yield s
    s.close()


def gen(text: str = "hello", **sp: Any) -> dict:
    return {"text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0, **sp}}


# ---------------------------------------------------------------------------- body size, Content-Type, nesting
def test_body_over_the_limit_is_413(served: Served) -> None:
    served.app.state.max_body_bytes = 4096
    try:
        big = gen("x" * 5000)
        err = assert_error(served.post("/generate", json=big), 413, None)
        assert "4096" in err["message"] and "--max-request-body-bytes" in err["message"]
        assert_error(served.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "y" * 5000}]}),
                     413, None)

        async def chunks():  # no Content-Length: the limit applies to the streamed bytes
            body = httpx.Request("POST", "http://t", json=big).content
            for i in range(0, len(body), 1000):
                yield body[i:i + 1000]

        resp = served.post("/generate", content=chunks(), headers={"content-type": "application/json"})
        assert "content-length" not in resp.request.headers
        assert_error(resp, 413, None)
        assert served.post("/generate", json=gen("x" * 100)).status_code == 200  # under the limit
    finally:
        served.app.state.max_body_bytes = None


def test_default_body_limit_comes_from_the_flag(tiny_llama) -> None:
    from core.server.limits import DEFAULT_MAX_BODY_BYTES

    s = Served(tiny_llama()[0], "--max-request-body-bytes", "1000")
    try:
        assert s.app.state.max_body_bytes == 1000
        assert_error(s.post("/v1/completions", json={"prompt": "z" * 2000, "max_tokens": 1}), 413, None)
    finally:
        s.close()
    assert DEFAULT_MAX_BODY_BYTES == 8 * 1024 * 1024


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions", "/abort_request"])
def test_non_json_content_type_is_refused(served: Served, path: str) -> None:
    body = httpx.Request("POST", "http://t", json={"text": "hi", "prompt": "hi", "messages": []}).content
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        err = assert_error(served.post(path, content=body, headers={"content-type": ctype}), 400, "Content-Type")
        assert "application/json" in err["message"] and ctype.split(";")[0] in err["message"]
    ok = served.post("/generate", content=httpx.Request("POST", "http://t", json=gen()).content,
                     headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text


def _nested(depth: int) -> Any:
    v: Any = 1
    for i in range(depth):
        v = [v] if i % 2 else {"a": v}
    return v


def test_deeply_nested_json_is_400_naming_the_field(served: Served) -> None:
    err = assert_error(served.post("/generate", json={"text": "hi", "sampling_params": {"json_schema": _nested(100)}}),
                       400, "sampling_params")
    assert "nests deeper than 64" in err["message"]
    assert_error(served.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                           "response_format": _nested(80)}), 400, "response_format")
    # past Python's recursion limit: still a 400, not a 500
    raw = b'{"text": "hi", "sampling_params": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert_error(served.post("/generate", content=raw, headers={"content-type": "application/json"}), 400)
    raw = b"[" * 100_000
    assert_error(served.post("/v1/completions", content=raw, headers={"content-type": "application/json"}), 400)
    # a schema nested 20 levels is fine (it reaches the grammar backend, which accepts or refuses it by itself)
    resp = served.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "logit_bias": None,
                                                "metadata": _nested(20)})
    assert resp.status_code == 200, resp.text


# ---------------------------------------------------------------------------- sampling limits
@pytest.mark.parametrize("sp, param", [
    ({"n": 129}, "n"),
    ({"stop": [f"s{i}" for i in range(65)]}, "stop"),
    ({"stop": ["z" * 1025]}, "stop"),
    ({"stop_token_ids": list(range(3, 1100))}, "stop_token_ids"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"logit_bias": {str(i): 1.0 for i in range(1025)}}, "logit_bias"),
    ({"logit_bias": {"1": 500}}, "logit_bias"),
])
def test_generate_sampling_limits_are_400(served: Served, sp: dict, param: str) -> None:
    assert_error(served.post("/generate", json=gen(**sp)), 400, param)


def test_openai_limits_are_400(served: Served) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert_error(served.post("/v1/chat/completions", json={**chat, "n": 500}), 400, "n")
    err = assert_error(served.post("/v1/chat/completions",
                                   json={**chat, "logit_bias": {str(i): 1.0 for i in range(20000)}}), 400, "logit_bias")
    assert "logit_bias" in err["message"]
    assert_error(served.post("/v1/completions", json={"prompt": "hi", "stop": [f"s{i}" for i in range(65)]}), 400, "stop")
    assert_error(served.post("/v1/completions", json={"prompt": "hi", "seed": 2**63}), 400, "seed")
    assert_error(served.post("/v1/completions", json={"prompt": ["a"] * 100, "n": 100}), 400, "prompt")
    assert_error(served.post("/generate", json={"text": ["a"] * 4097, "sampling_params": {"max_new_tokens": 1}}),
                 400, "text")
    assert_error(served.post("/generate", json={"text": ["a"] * 40, "sampling_params": {"max_new_tokens": 1, "n": 128}}),
                 400, "text")


# ---------------------------------------------------------------------------- prompts past the context
def _count_encodes(engine: Any) -> list[int]:
    tok = engine.tokenizer
    real = type(tok).encode
    lengths: list[int] = []

    def encode(text: str, *a: Any, **kw: Any) -> list[int]:
        lengths.append(len(text))
        return real(tok, text, *a, **kw)

    tok.encode = encode  # instance attribute: shadows the method for this tokenizer only
    return lengths


def test_prompt_past_the_context_is_refused_before_tokenizing(served: Served) -> None:
    ctx = served.state.context_len
    lengths = _count_encodes(served.engine)
    try:
        huge = "a" * 1_000_000
        for path, body, param in (("/generate", {"text": huge}, "text"),
                                  ("/v1/completions", {"prompt": huge, "max_tokens": 1}, "prompt"),
                                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}, "messages")):
            err = assert_error(served.post(path, json=body), 400, param)
            assert str(ctx) in err["message"], err
        assert lengths == [], "a prompt that cannot fit was tokenized"
        # one that might fit is tokenized, then refused on its real length
        assert_error(served.post("/generate", json={"text": "b" * (ctx + 10)}), 400, "prompt")
        assert lengths == [ctx + 10]
    finally:
        del served.engine.tokenizer.encode


def test_auto_truncate_tokenizes_only_the_head(tiny_llama) -> None:
    s = Served(tiny_llama()[0], "--allow-auto-truncate")
    try:
        ctx = s.state.context_len
        seen: list[list[int]] = []
        s.engine.finish_listeners.append(lambda req: seen.append(list(req.prompt_ids)))
        text = "".join(chr(97 + i % 26) for i in range(500_000))
        full = s.engine.tokenizer.encode(text)
        lengths = _count_encodes(s.engine)
        resp = s.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        assert resp.status_code == 200, resp.text
        assert seen[-1] == full[: ctx - 1]  # the same head as tokenizing everything
        assert lengths and lengths[0] < len(text) // 10  # ... from a small part of the text
    finally:
        s.close()


# ---------------------------------------------------------------------------- tools
def test_tool_parameters_must_be_a_json_schema(served: Served) -> None:
    ok = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
                                                                                  "properties": {"city": {"type": "string"}}}}}
    bad = {"type": "function", "function": {"name": "book", "parameters": {"type": "object",
                                                                           "properties": {"when": {"type": "datetime"}}}}}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "tools": [ok, bad]}
    err = assert_error(served.post("/v1/chat/completions", json=body), 400, "tools[1].function.parameters")
    assert "'book'" in err["message"] and "JSON Schema" in err["message"] and "properties/when/type" in err["message"]
    body["tools"] = [ok, {"type": "function", "function": {"name": "x", "parameters": [1]}}]
    assert_error(served.post("/v1/chat/completions", json=body), 400, "tools[1].function.parameters")
    body["tools"] = [ok]
    assert served.post("/v1/chat/completions", json=body).status_code == 200


# ---------------------------------------------------------------------------- overload
def _slow_forward(engine: Any, seconds: float) -> None:
    run = engine.runner.run

    def slow(batch: Any) -> Any:
        time.sleep(seconds)
        return run(batch)

    engine.runner.run = slow


@pytest.mark.parametrize("flags", [("--max-running-requests", "1"), ("--max-total-tokens", "300")],
                         ids=["batch-full", "kv-pool-full"])
def test_queue_full_is_503_with_retry_after(tiny_llama, flags: tuple[str, ...]) -> None:
    s = Served(tiny_llama()[0], "--max-queued-requests", "1", *flags)
    _slow_forward(s.engine, 0.01)
    long = {"input_ids": list(range(3, 43)), "sampling_params": {"max_new_tokens": 200, "ignore_eos": True, "temperature": 0}}

    async def scenario() -> None:
        c = s.client

        async def until(pred: Any) -> dict:
            for _ in range(500):
                load = (await c.get("/v1/loads")).json()["aggregate"]
                if pred(load):
                    return load
                await asyncio.sleep(0.01)
            raise AssertionError(f"load never reached the state: {load}")

        first = asyncio.create_task(c.post("/generate", json={**long, "rid": "first"}))
        await until(lambda l: l["num_running_reqs"] == 1)
        second = asyncio.create_task(c.post("/generate", json={**long, "rid": "second"}))
        load = await until(lambda l: l["num_waiting_reqs"] == 1)  # /v1/loads reports the queue
        assert load["num_running_reqs"] == 1
        for path, body in (("/generate", gen()), ("/v1/completions", {"prompt": "hi", "max_tokens": 1})):
            resp = await c.post(path, json=body)
            err = assert_error(resp, 503, None)
            assert "queue is full" in err["message"] and err["type"] == "server_error"
            assert resp.headers["retry-after"] == "1"
        t0 = time.perf_counter()
        assert (await c.get("/health")).status_code == 200
        assert time.perf_counter() - t0 < 1.0
        assert (await c.post("/abort_request", json={"abort_all": True})).status_code == 200
        for task in (first, second):
            out = (await task).json()
            assert out["meta_info"]["finish_reason"]["type"] == "abort"

    try:
        s.run(scenario())
    finally:
        s.close()


def test_health_stays_fast_under_full_load(served: Served) -> None:
    async def scenario() -> list[float]:
        c = served.client
        body = {"input_ids": list(range(3, 23)), "sampling_params": {"max_new_tokens": 100, "ignore_eos": True},
                "stream": True}
        load = [asyncio.create_task(c.post("/generate", json=body)) for _ in range(64)]
        waits = []
        await asyncio.sleep(0.05)
        while not all(t.done() for t in load):
            t0 = time.perf_counter()
            assert (await c.get("/health")).status_code == 200
            waits.append(time.perf_counter() - t0)
            await asyncio.sleep(0.02)
        assert all(t.result().status_code == 200 for t in load)
        return waits

    waits = served.run(scenario())
    assert waits, "the load finished before /health was asked"
    assert max(waits) < 1.0, waits


def test_batch_file_lines_nested_too_deeply_are_line_errors() -> None:
    from core.server.openai.batches import parse_batch_input

    deep = '{"custom_id": "a", "body": ' + "[" * 5000 + "]" * 5000 + "}"  # past Python's recursion limit
    mid = '{"custom_id": "b", "body": {"x": ' + "[" * 100 + "]" * 100 + "}}"
    ok = '{"custom_id": "c", "body": {"messages": []}}'
    lines, errors = parse_batch_input("\n".join([deep, mid, ok]).encode(), "/v1/chat/completions")
    assert [item["custom_id"] for item in lines] == ["c"]
    assert [(e["line"], "nests deeper than 64" in e["message"]) for e in errors] == [(1, True), (2, True)]
