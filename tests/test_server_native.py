"""`core serve` end to end: the real server as a subprocess on the default model (SmolLM2).

Two servers for the whole module: ``srv`` (API key, metrics, request logs, context 256)
and ``cfg_srv`` (started from a YAML --config; one running + one queued request at
most; no key, no metrics), which the last test stops with SIGTERM. Parser-level checks
(unsupported flags, --help groups, YAML errors, plugin flags) run in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import types
from typing import Any, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_utils import ServerProcess, start_server_process

pytestmark = pytest.mark.slow

KEY = "sk-test-secret-key-9f8e7d"
AUTH = {"Authorization": f"Bearer {KEY}"}
CTX = 256


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def srv() -> Iterator[ServerProcess]:
    with start_server_process("--enable-metrics", "--api-key", KEY, "--log-requests", "--log-level", "info",
                              "--context-length", str(CTX)) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.base_url, headers=AUTH, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def cfg_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    cfg = tmp_path_factory.mktemp("cfg") / "serve.yaml"
    cfg.write_text(
        "served-model-name: from-yaml\n"
        "max_running_requests: 1\n"  # underscores work too
        "--max-queued-requests: 1\n"
        "stream-interval: 2\n"
        "incremental-streaming-output: true\n"
        "graceful-shutdown-timeout: 1\n"
        "enable-metrics: false\n"
    )
    with start_server_process("--config", str(cfg), "--served-model-name", "from-cli") as s:
        yield s


@pytest.fixture(scope="module")
def cfg_client(cfg_srv: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cfg_srv.base_url, timeout=60) as c:
        yield c


# ---------------------------------------------------------------------------- helpers
def gen(client: httpx.Client, **body: Any) -> httpx.Response:
    return client.post("/generate", json=body)


def greedy(n: int = 8, **extra: Any) -> dict:
    return {"max_new_tokens": n, "temperature": 0, **extra}


def sse_events(resp: httpx.Response) -> list[Any]:
    """Parse an SSE body into JSON payloads, with the final "[DONE]" kept as a string."""
    events: list[Any] = []
    for line in resp.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(resp: httpx.Response, status: int, param: str | None = "__any__") -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param != "__any__":
        assert err["param"] == param, err
    return err


def metrics(client: httpx.Client) -> dict[str, float]:
    """sample name (+ sorted non-model labels) -> value."""
    resp = client.get("/metrics")
    assert resp.status_code == 200, resp.text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(resp.text):
        for s in fam.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            key = s.name + (json.dumps(labels, sort_keys=True) if labels else "")
            out[key] = s.value
    return out


def wait_for(pred, timeout: float = 10.0, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(interval)


def load(client: httpx.Client) -> dict:
    resp = client.get("/v1/loads")
    assert resp.status_code == 200, resp.text
    return resp.json()["loads"][0]


# ---------------------------------------------------------------------------- auth and health
def test_health_is_open_and_everything_else_needs_the_key(srv: ServerProcess) -> None:
    url = srv.base_url
    for path in ("/health", "/health_generate", "/metrics"):  # probes and scrapers, as SGLang leaves them
        assert httpx.get(url + path).status_code != 401, path
    for method, path in [("GET", "/get_model_info"), ("GET", "/get_server_info"), ("GET", "/v1/loads"),
                         ("POST", "/generate"), ("GET", "/ping")]:  # (SGLang's /ping takes the key too)
        err = assert_error(httpx.request(method, url + path, json={"text": "hi"}), 401)
        assert err["code"] == "invalid_api_key"
    assert_error(httpx.get(url + "/get_model_info", headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(httpx.get(url + "/get_model_info", headers={"Authorization": KEY}), 401)  # no scheme
    assert httpx.get(url + "/get_model_info", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    assert httpx.get(url + "/get_model_info", headers=AUTH).status_code == 200
    # the anthropic client's header; its routes answer in Anthropic's error shape
    assert httpx.get(url + "/get_model_info", headers={"x-api-key": KEY}).status_code == 200
    assert_error(httpx.get(url + "/get_model_info", headers={"x-api-key": "wrong"}), 401)
    denied = httpx.post(url + "/v1/messages", headers={"x-api-key": "wrong"}, json={})
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
    assert denied.json()["type"] == "error"


def test_no_key_server_is_open_and_metrics_off_is_404(cfg_client: httpx.Client) -> None:
    assert cfg_client.get("/get_model_info").status_code == 200
    assert_error(cfg_client.get("/metrics"), 404)


def test_health_generate(client: httpx.Client) -> None:
    assert client.get("/health_generate").status_code == 200


def test_sagemakers_ping_and_invocations(client: httpx.Client) -> None:
    """SGLang's SageMaker routes: /ping is an empty 200 while serving, /invocations is chat."""
    ping = client.get("/ping")
    assert ping.status_code == 200 and ping.content == b""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    inv, chat = client.post("/invocations", json=body), client.post("/v1/chat/completions", json=body)
    assert inv.status_code == 200 and inv.json()["object"] == "chat.completion"
    assert inv.json()["choices"][0]["message"] == chat.json()["choices"][0]["message"]


# ---------------------------------------------------------------------------- /generate
def test_generate_text(client: httpx.Client) -> None:
    resp = gen(client, text="The capital of France is", sampling_params=greedy(6))
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert isinstance(out["text"], str) and out["text"]
    assert len(out["output_ids"]) == 6
    meta = out["meta_info"]
    assert {"id", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason", "e2e_latency"} <= set(meta)
    assert meta["completion_tokens"] == 6 and meta["prompt_tokens"] > 0 and 0 <= meta["cached_tokens"] < meta["prompt_tokens"]
    assert meta["finish_reason"]["type"] == "length"
    assert meta["e2e_latency"] > 0
    again = gen(client, text="The capital of France is", sampling_params=greedy(6)).json()
    assert again["text"] == out["text"]  # greedy is deterministic
    assert again["meta_info"]["id"] != meta["id"]


def test_generate_input_ids_rid_and_batch(client: httpx.Client) -> None:
    one = gen(client, text="Hello there", sampling_params=greedy(4)).json()
    ids = gen(client, text="Hello there", sampling_params=greedy(0)).json()
    assert ids["meta_info"]["completion_tokens"] == 0
    prompt_ids = list(range(100, 100 + one["meta_info"]["prompt_tokens"]))
    by_ids = gen(client, input_ids=prompt_ids, sampling_params=greedy(4), rid="my-rid").json()
    assert by_ids["meta_info"]["id"] == "my-rid" and by_ids["meta_info"]["prompt_tokens"] == len(prompt_ids)

    batch = gen(client, text=["Hello there", "One, two, three,"], sampling_params=greedy(4)).json()
    assert isinstance(batch, list) and len(batch) == 2
    assert batch[0]["text"] == one["text"]
    per = gen(client, text=["a b c", "d e f"], sampling_params=[greedy(2), greedy(3)], rid=["r-a", "r-b"]).json()
    assert [o["meta_info"]["completion_tokens"] for o in per] == [2, 3]
    assert [o["meta_info"]["id"] for o in per] == ["r-a", "r-b"]
    nested = gen(client, input_ids=[[1, 2, 3], [4, 5]], sampling_params=greedy(2)).json()
    assert [o["meta_info"]["prompt_tokens"] for o in nested] == [3, 2]
    many = gen(client, text="Pick a color:", sampling_params={"max_new_tokens": 3, "n": 3, "seed": 1}).json()
    assert isinstance(many, list) and len(many) == 3


def test_generate_stop_token(client: httpx.Client) -> None:
    first = gen(client, text="Count: one, two, three,", sampling_params=greedy(8)).json()
    target = first["output_ids"][2]
    out = gen(client, text="Count: one, two, three,", sampling_params=greedy(8, stop_token_ids=[target])).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": target}
    assert out["meta_info"]["completion_tokens"] <= 3


def test_generate_logprobs(client: httpx.Client) -> None:
    body = {"text": "The sky is", "sampling_params": greedy(3), "return_logprob": True, "top_logprobs_num": 2,
            "logprob_start_len": 0}
    plain = client.post("/generate", json=body).json()["meta_info"]
    assert len(plain["output_token_logprobs"]) == 3
    # SGLang's triples (logprob, token id, text), the text null without return_text_in_logprobs
    assert all(len(t) == 3 and t[0] <= 0 and t[2] is None for t in plain["output_token_logprobs"])
    assert [t[1] for t in plain["output_token_logprobs"]] == client.post("/generate", json=body).json()["output_ids"]
    assert all(len(pos) == 2 and all(len(t) == 3 for t in pos) for pos in plain["output_top_logprobs"])
    # greedy: the chosen token is the top-1 candidate
    assert all(pos[0][1] == t[1] for pos, t in zip(plain["output_top_logprobs"], plain["output_token_logprobs"]))
    assert plain["input_token_logprobs"][0][0] is None and len(plain["input_token_logprobs"]) == plain["prompt_tokens"]
    assert plain["input_top_logprobs"][0] is None and all(len(pos) == 2 for pos in plain["input_top_logprobs"][1:])

    texted = client.post("/generate", json={**body, "return_text_in_logprobs": True}).json()
    with_text = texted["meta_info"]
    # the output itself is the same with the logprobs' texts (it once came back as the logprobs' token ids)
    assert texted["output_ids"] == [t[1] for t in plain["output_token_logprobs"]]
    assert texted["text"] == client.post("/generate", json=body).json()["text"]
    assert all(len(t) == 3 and isinstance(t[2], str) for t in with_text["output_token_logprobs"])
    assert all(len(t) == 3 for pos in with_text["output_top_logprobs"] for t in pos)
    no_lp = gen(client, text="The sky is", sampling_params=greedy(2)).json()["meta_info"]
    assert "output_token_logprobs" not in no_lp


def test_generate_logprob_lists_are_present_whenever_asked(client: httpx.Client) -> None:
    """SGLang's shape: with return_logprob the input list is there (empty without
    logprob_start_len), the top lists too once top_logprobs_num asks for them."""
    meta = gen(client, text="The sky is", sampling_params=greedy(2), return_logprob=True).json()["meta_info"]
    assert meta["input_token_logprobs"] == [] and len(meta["output_token_logprobs"]) == 2
    assert "output_top_logprobs" not in meta
    meta = gen(client, text="The sky is", sampling_params=greedy(2), return_logprob=True,
               top_logprobs_num=2).json()["meta_info"]
    assert meta["input_token_logprobs"] == [] and meta["input_top_logprobs"] == []
    assert len(meta["output_top_logprobs"]) == 2
    # a scoring request (no new tokens) without logprob_start_len: the whole prompt, first entry null
    scored = gen(client, input_ids=[[1, 2, 3, 4]], sampling_params={"max_new_tokens": 0},
                 return_logprob=True).json()[0]["meta_info"]
    assert [t[1] for t in scored["input_token_logprobs"]] == [1, 2, 3, 4]
    assert scored["input_token_logprobs"][0][0] is None
    assert all(isinstance(t[0], float) for t in scored["input_token_logprobs"][1:])


def test_generate_logprobs_are_finite_numbers_under_a_grammar(client: httpx.Client) -> None:
    """A grammar masks most of the vocabulary: the masked candidates among the top logprobs
    are numbers (OpenAI's -9999.0), never null, streamed or not."""
    body = {"text": "Answer yes or no:", "sampling_params": greedy(3, regex="(yes|no)"), "return_logprob": True,
            "top_logprobs_num": 5}
    metas = [gen(client, **body).json()["meta_info"]]
    with client.stream("POST", "/generate", json={**body, "stream": True}) as resp:
        metas += [e["meta_info"] for e in sse_events(resp)[:-1]]
    for meta in metas:
        tops = [t for pos in meta["output_top_logprobs"] for t in pos]
        values = [t[0] for t in meta["output_token_logprobs"]] + [t[0] for t in tops]
        assert values and all(isinstance(v, float) and math.isfinite(v) for v in values), meta
    assert any(t[0] == -9999.0 for t in tops)  # masked alternatives are among the five


def test_generate_stop_regex(client: httpx.Client) -> None:
    """SGLang's stop_regex: generation ends at the token that completes a match, the match stays
    in the text, and the finish reason names the pattern; streamed the same way."""
    prompt = "Count from one: 1, 2, 3, 4, 5, 6,"
    free = gen(client, text=prompt, sampling_params=greedy(24)).json()
    assert re.search(r"\d", free["text"]), free["text"]  # the model keeps counting
    out = gen(client, text=prompt, sampling_params=greedy(24, stop_regex=r"\d")).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": r"\d"}
    assert free["text"].startswith(out["text"]) and re.search(r"\d", out["text"])
    assert out["output_ids"] == free["output_ids"][: len(out["output_ids"])]
    # the token before the last had not completed a match
    before = client.post("/detokenize", json={"tokens": out["output_ids"][:-1]}).json()
    assert not re.search(r"\d", before["text"]), before
    with client.stream("POST", "/generate", json={"text": prompt, "stream": True,
                                                  "sampling_params": greedy(24, stop_regex=[r"\d"])}) as resp:
        last = sse_events(resp)[-2]
    assert last["text"] == out["text"] and last["meta_info"]["finish_reason"]["matched"] == r"\d"


def test_generate_ignores_unknown_top_level_fields_as_sglang(srv: ServerProcess, client: httpx.Client) -> None:
    """What sglang-router adds to /generate bodies (model, background, no_logs, return_bytes,
    return_entropy as false) and fields no version knows are ignored and logged once per name;
    an unknown *sampling* key stays a 400."""
    body = {"text": "Hi", "sampling_params": greedy(2), "model": "default", "background": False, "no_logs": False,
            "return_bytes": False, "return_entropy": False, "routing_key": "k", "frobnicate_level": 3}
    for _ in range(2):
        r = gen(client, **body)
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["completion_tokens"] == 2
    wait_for(lambda: "frobnicate_level" in srv.logs(), timeout=5)
    ignored = [line for line in srv.logs().splitlines() if "generate.unknown_field_ignored" in line]
    assert sum("frobnicate_level" in line for line in ignored) == 1  # once per name, not per request
    assert sum(re.search(r"\bmodel\b", line) is not None for line in ignored) == 1
    assert not any(name in line for line in ignored for name in ("background", "no_logs", "routing_key"))
    assert_error(gen(client, text="Hi", sampling_params={"frobnicate_level": 3}), 400, "frobnicate_level")


def test_no_logs_keeps_a_request_out_of_the_request_log(srv: ServerProcess, client: httpx.Client) -> None:
    gen(client, text="Secret prompt for no_logs", sampling_params=greedy(2), rid="quiet-rid", no_logs=True)
    gen(client, text="Loud prompt", sampling_params=greedy(2), rid="loud-rid")
    wait_for(lambda: "loud-rid" in srv.logs() and "request.output" in srv.logs(), timeout=5)
    time.sleep(0.2)
    quiet = [line for line in srv.logs().splitlines() if "quiet-rid" in line]
    # neither its input nor its output is written (the engine's metadata line stays, content-free)
    assert not any("request.received" in line or "request.output" in line for line in quiet), quiet
    assert "Secret prompt" not in srv.logs()


def test_get_load_is_sglangs_per_rank_list(client: httpx.Client) -> None:
    loads = client.get("/get_load").json()
    assert isinstance(loads, list) and len(loads) == 1
    assert set(loads[0]) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}
    assert loads[0]["dp_rank"] == 0 and loads[0]["num_reqs"] == 0 and loads[0]["num_waiting_reqs"] == 0


def test_generate_stream(client: httpx.Client) -> None:
    with client.stream("POST", "/generate", json={"text": "Once upon a time", "sampling_params": greedy(6),
                                                  "stream": True}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2
    for prev, cur in zip(chunks, chunks[1:]):  # cumulative text and ids
        assert cur["text"].startswith(prev["text"])
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert chunks[-1]["meta_info"]["completion_tokens"] == 6
    full = gen(client, text="Once upon a time", sampling_params=greedy(6)).json()
    assert chunks[-1]["text"] == full["text"]
    assert "index" not in chunks[0]

    with client.stream("POST", "/generate", json={"text": ["A", "B"], "sampling_params": greedy(3),
                                                  "stream": True}) as resp:
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    finals = {c["index"]: c for c in events[:-1] if c["meta_info"]["finish_reason"]}
    assert set(finals) == {0, 1}


def test_stream_interval(cfg_client: httpx.Client) -> None:
    """stream-interval 2 (from the YAML): the first token at once, then every 2 tokens, plus the final one."""
    with cfg_client.stream("POST", "/generate", json={"text": "Hi", "sampling_params": greedy(5),
                                                      "stream": True}) as resp:
        chunks = sse_events(resp)[:-1]
    counts = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert counts[-1] == 5 and len(counts) <= 4, counts  # [1, 3, 5] unless steps coalesced
    assert all(b - a >= 2 for a, b in zip(counts[:-2], counts[1:-1])), counts


def test_incremental_streaming_output(client: httpx.Client, cfg_client: httpx.Client) -> None:
    """--incremental-streaming-output (the YAML's): each chunk holds the text, output_ids and output
    logprobs new since the last one, and together they are the whole output; completion_tokens
    and the prompt's logprobs stay whole, as in SGLang. Without the flag every chunk is cumulative."""
    body = {"text": "Hello", "sampling_params": greedy(7, ignore_eos=True), "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": 2}
    whole = gen(cfg_client, **body).json()
    with cfg_client.stream("POST", "/generate", json={**body, "stream": True}) as resp:
        chunks = sse_events(resp)[:-1]
    assert len(chunks) >= 2
    meta = [c["meta_info"] for c in chunks]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert sum((c["output_ids"] for c in chunks), []) == whole["output_ids"]
    for key in ("output_token_logprobs", "output_top_logprobs"):
        assert sum((m[key] for m in meta), []) == whole["meta_info"][key], key
    assert all(len(c["output_ids"]) == len(m["output_token_logprobs"]) for c, m in zip(chunks, meta))
    assert [m["completion_tokens"] for m in meta][-1] == 7
    assert all(m["input_token_logprobs"] == whole["meta_info"]["input_token_logprobs"] for m in meta)
    assert cfg_client.get("/get_server_info").json()["incremental_streaming_output"] is True
    with client.stream("POST", "/generate", json={**body, "stream": True}) as resp:  # (the other server: cumulative)
        plain = sse_events(resp)[:-1]
    assert plain[-1]["output_ids"] == gen(client, **body).json()["output_ids"]
    assert all(len(c["output_ids"]) == c["meta_info"]["completion_tokens"] for c in plain)


@pytest.mark.parametrize("body,param", [
    ({"text": 5}, "text"),
    ({"text": "hi", "sampling_params": "fast"}, "sampling_params"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": "5"}}, "max_new_tokens"),
    ({"text": "hi", "sampling_params": {"bogus_param": 1}}, "bogus_param"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"text": "hi", "sampling_params": {"temperature": -0.5}}, "temperature"),
    ({"text": "hi", "sampling_params": {"top_p": 1.5}}, "top_p"),
    ({"text": "hi", "sampling_params": {"n": 0}}, "n"),
    ({"text": ""}, "text"),
    ({"text": []}, "text"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1, "2"]}, "input_ids"),
    ({"input_ids": [10 ** 9]}, "input_ids"),
    ({}, "text"),
    ({"text": "a", "input_ids": [1]}, "text"),
    ({"text": "hi", "image_data": "x.png"}, "image_data"),
    # SGLang fields of features this server lacks: a 400 once set, though the names are known
    ({"text": "hi", "return_entropy": True}, "return_entropy"),
    ({"text": "hi", "lora_path": "my-adapter"}, "lora_path"),
    ({"text": "hi", "custom_logit_processor": "{}"}, "custom_logit_processor"),  # (without --enable-custom-logit-processor)
    ({"text": "hi", "sampling_params": {"beam_width": 4}}, "beam_width"),
    ({"text": "hi", "sampling_params": {"stop_regex": "(unclosed"}}, "stop_regex"),
    ({"text": "hi", "sampling_params": {"stop_regex": [""]}}, "stop_regex"),
    ({"text": "hello " * 400}, "prompt"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
    ({"text": "hi", "return_logprob": True, "top_logprobs_num": 50}, "top_logprobs_num"),
    ({"text": "hi", "stream": "yes"}, "stream"),
    # booleans and stop strings are type-checked (a truthy string once read as true)
    ({"text": "hi", "sampling_params": {"skip_special_tokens": 0}}, "skip_special_tokens"),
    ({"text": "hi", "sampling_params": {"ignore_eos": "false"}}, "ignore_eos"),
    ({"text": "hi", "sampling_params": {"no_stop_trim": "x"}}, "no_stop_trim"),
    ({"text": "hi", "sampling_params": {"spaces_between_special_tokens": [1]}}, "spaces_between_special_tokens"),
    ({"text": "hi", "sampling_params": {"stop": {"a": 1}}}, "stop"),
    ({"text": "hi", "sampling_params": {"stop": 5}}, "stop"),
    # SGLang's rule: an explicit max_new_tokens that cannot fit beside the prompt is refused
    ({"text": "hi", "sampling_params": {"max_new_tokens": CTX}}, "max_new_tokens"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": 10 ** 12}}, "max_new_tokens"),
    # a grammar that no token can start
    ({"text": "hi", "sampling_params": {"ebnf": "root ::= root"}}, "ebnf"),
    ({"text": "hi", "sampling_params": {"ebnf": "root ::= a\na ::= b\nb ::= a"}}, "ebnf"),
])
def test_generate_bad_input_is_400(client: httpx.Client, body: dict, param: str) -> None:
    assert_error(client.post("/generate", json=body), 400, param)


def test_generate_max_new_tokens_omitted_or_fitting_is_served(client: httpx.Client) -> None:
    prompt = gen(client, text="hi", sampling_params=greedy(1)).json()["meta_info"]["prompt_tokens"]
    assert gen(client, text="hi", sampling_params=greedy(CTX - prompt - 1, ignore_eos=True)).status_code == 200
    assert gen(client, text="hi", sampling_params={"temperature": 0}).status_code == 200


def test_malformed_and_empty_bodies_are_400(client: httpx.Client) -> None:
    headers = {"content-type": "application/json"}
    for path, body in (("/generate", b'{"text": "\xff\xfe"}'), ("/v1/chat/completions", b'{"messages": [{"role": '
                       b'"user", "content": "\xff\x80"}]}'), ("/v1/batches", b'{"input_file_id": "\xff"}')):
        assert "UTF-8" in assert_error(client.post(path, content=body, headers=headers), 400)["message"]
    empty_type = {"content-type": ""}  # read as JSON, as FastAPI does
    assert client.post("/generate", content=b'{"text": "ok", "sampling_params": {"max_new_tokens": 1}}',
                       headers=empty_type).status_code == 200
    assert_error(client.post("/generate", content=b"{not json", headers=headers), 400)
    assert_error(client.post("/generate", content=b"", headers=headers), 400)
    assert_error(client.post("/generate", content=b"[1, 2]", headers=headers), 400)
    assert_error(client.post("/abort_request", content=b"{\"rid\": 5}", headers=headers), 400, "rid")
    assert_error(client.get("/no_such_route"), 404)
    assert_error(client.get("/generate"), 405)
    # and the server keeps serving
    assert gen(client, text="ok", sampling_params=greedy(1)).status_code == 200


# ---------------------------------------------------------------------------- info endpoints
def test_get_model_info(client: httpx.Client) -> None:
    info = client.get("/get_model_info").json()
    assert info["is_generation"] is True
    assert {"model_path", "tokenizer_path", "weight_version", "preferred_sampling_params"} <= set(info)
    assert info["context_length"] == CTX


def test_get_server_info_redacts_the_key(client: httpx.Client) -> None:
    resp = client.get("/get_server_info")
    info = resp.json()
    assert KEY not in resp.text
    assert info["api_key"] == "<redacted>"
    assert info["port"] > 0 and info["host"] == "127.0.0.1"
    assert info["max_total_num_tokens"] == 16384
    assert info["context_length"] == CTX and info["enable_metrics"] is True
    assert isinstance(info["internal_states"], list) and "version" in info
    # flags left unset report what the engine resolved, as SGLang's resolved server args
    assert isinstance(info["random_seed"], int) and isinstance(info["chunked_prefill_size"], int)
    assert info["page_size"] >= 1 and info["max_running_requests"] >= 1


def test_tokenize_counts_what_generate_and_chat_send(client: httpx.Client) -> None:
    text = "The capital of France is"
    tok = client.post("/tokenize", json={"prompt": text}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == CTX
    meta = gen(client, text=text, sampling_params=greedy(1)).json()["meta_info"]
    assert meta["prompt_tokens"] == tok["count"]
    assert client.post("/v1/tokenize", json={"prompt": text, "model": "x"}).json() == tok
    assert client.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {"text": text, "prompt": text}

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    chat = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    counted = client.post("/tokenize", json={"messages": messages}).json()
    assert counted["count"] == chat["usage"]["prompt_tokens"]
    no_prompt = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert no_prompt["count"] < counted["count"] and counted["tokens"][:no_prompt["count"]] == no_prompt["tokens"]

    batch = client.post("/tokenize", json={"prompt": [text, "Hi"], "return_token_strs": True}).json()
    assert batch["tokens"][0] == tok["tokens"] and batch["count"] == [len(t) for t in batch["tokens"]]
    assert [len(s) for s in batch["token_strs"]] == batch["count"] and all(isinstance(s, str) for s in batch["token_strs"][1])
    texts = client.post("/v1/detokenize", json={"tokens": batch["tokens"]}).json()
    assert texts == {"text": [text, "Hi"], "prompt": [text, "Hi"]}
    assert client.post("/detokenize", json={"tokens": []}).json() == {"text": "", "prompt": ""}

    long = client.post("/tokenize", json={"prompt": "word " * 1000}).json()  # longer than the context: counted
    assert long["count"] > CTX
    special = client.post("/tokenize", json={"messages": messages, "add_special_tokens": True})
    assert special.status_code == 200 and special.json()["count"] >= counted["count"]


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": []}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": [1, [2]]}, "tokens"),
    ("/v1/detokenize", {"tokens": [[1], [True]]}, "tokens"),
])
def test_tokenize_bad_input_is_400(client: httpx.Client, path: str, body: dict, param: str) -> None:
    assert_error(client.post(path, json=body), 400, param)
    assert_error(client.get(path), 405, None)


def test_loads_idle(client: httpx.Client) -> None:
    body = client.get("/v1/loads").json()
    l0 = body["loads"][0]
    assert l0["num_running_reqs"] == 0 and l0["num_waiting_reqs"] == 0
    assert l0["num_used_tokens"] == 0 and l0["token_usage"] == 0
    assert l0["max_total_num_tokens"] == 16384


def test_flush_cache_idle_and_busy(client: httpx.Client) -> None:
    assert client.post("/flush_cache").status_code == 200
    with client.stream("POST", "/generate", json={"text": "Tell me a story", "stream": True,
                                                  "sampling_params": greedy(200, ignore_eos=True)}) as resp:
        it = resp.iter_lines()
        next(it)  # running now
        assert client.post("/flush_cache").status_code == 400
    wait_for(lambda: load(client)["num_running_reqs"] == 0)
    assert client.get("/flush_cache").status_code == 200


def test_the_server_freezes_the_collector_once_ready_and_on_freeze_gc(srv: ServerProcess, client: httpx.Client) -> None:
    def frozen() -> list[tuple[str, int]]:
        return [(c, int(n)) for c, n in re.findall(r"gc\.frozen\s+context=(\S+)\s+objects=(\d+)", srv.logs())]

    first = frozen()
    assert first and first[0][0] == "server" and first[0][1] > 10_000  # the start-up heap (torch, the model, ...)
    for method in ("POST", "GET"):  # SGLang's /freeze_gc answers both
        resp = client.request(method, "/freeze_gc")
        assert resp.status_code == 200 and resp.text == "Garbage collection frozen.\n"
    wait_for(lambda: len(frozen()) == len(first) + 2)
    assert all(c == "engine" and n >= first[0][1] for c, n in frozen()[len(first):])
    assert client.post("/generate", json={"text": "hi", "sampling_params": greedy(3)}).status_code == 200


def test_abort_request(client: httpx.Client) -> None:
    with client.stream("POST", "/generate", json={"text": "Write a long essay", "rid": "to-abort", "stream": True,
                                                  "sampling_params": greedy(200, ignore_eos=True)}) as resp:
        it = resp.iter_lines()
        next(it)
        assert client.post("/abort_request", json={"rid": "to-abort"}).status_code == 200
        events = [json.loads(line[6:]) for line in it if line.startswith("data: {")]
    last = events[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < 200
    assert client.post("/abort_request", json={"rid": "no-such-rid"}).status_code == 200
    assert_error(client.post("/abort_request", json={}), 400, "rid")


def test_request_ids_abort_their_own_group_only(client: httpx.Client) -> None:
    long = greedy(200, ignore_eos=True)
    with client.stream("POST", "/generate", json={"text": "Tell a story", "rid": "job-1", "stream": True,
                                                  "sampling_params": long}) as resp:
        it = resp.iter_lines()
        next(it)
        # "job" is another request's id, not a prefix: aborting it leaves "job-1" running
        assert client.post("/abort_request", json={"rid": "job"}).status_code == 200
        # a second request may not take an id that is running (its abort would reach the first)
        assert_error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                               "rid": "job-1", "max_tokens": 2}), 400, "rid")
        assert_error(gen(client, text="x", rid="job-1", sampling_params=greedy(2)), 400, "rid")
        assert_error(gen(client, text=["x", "y"], rid=["twin", "twin"], sampling_params=greedy(2)), 400, "rid")
        events = [json.loads(line[6:]) for line in it if line.startswith("data: {")]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert events[-1]["meta_info"]["completion_tokens"] == 200
    # every sequence of one API request answers to its id: n > 1 copies and batch items
    with client.stream("POST", "/generate", json={"text": ["a", "b"], "rid": "grp", "stream": True,
                                                  "sampling_params": {**long, "n": 2}}) as resp:
        it = resp.iter_lines()
        next(it)
        assert client.post("/abort_request", json={"rid": "grp"}).status_code == 200
        finals = {}
        for line in it:
            if line.startswith("data: {"):
                e = json.loads(line[6:])
                if e["meta_info"]["finish_reason"]:
                    finals[e["index"]] = e["meta_info"]["finish_reason"]["type"]
    assert finals == {0: "abort", 1: "abort", 2: "abort", 3: "abort"}
    wait_for(lambda: load(client)["num_running_reqs"] == 0)


def test_profile_traces_forward_steps(client: httpx.Client, tmp_path) -> None:
    import gzip

    assert_error(client.post("/stop_profile"), 400)  # nothing running
    started = client.post("/start_profile", json={"output_dir": str(tmp_path), "profile_prefix": "t"})
    assert started.status_code == 200, started.text
    path = started.json()["trace"]
    assert path.startswith(str(tmp_path)) and path.endswith(".trace.json.gz")
    assert_error(client.post("/start_profile", json={"output_dir": str(tmp_path)}), 400)  # one at a time
    assert gen(client, text="Profile me", sampling_params=greedy(3)).status_code == 200
    stopped = client.post("/stop_profile")
    assert stopped.status_code == 200 and stopped.json()["trace"] == path
    events = json.loads(gzip.open(path).read())["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)  # the forward's ops are in it

    # num_steps: it stops by itself after that many forwards
    auto = client.post("/start_profile", json={"output_dir": str(tmp_path / "auto"), "num_steps": 2}).json()["trace"]
    assert gen(client, text="Two steps", sampling_params=greedy(4)).status_code == 200
    wait_for(lambda: os.path.exists(auto), timeout=30)
    assert_error(client.post("/stop_profile"), 400)  # already stopped


def test_concurrent_profile_starts_take_one(srv: ServerProcess, tmp_path) -> None:
    async def race() -> list[int]:
        async with httpx.AsyncClient(base_url=srv.base_url, headers=AUTH, timeout=60) as c:
            resps = await asyncio.gather(*(c.post("/start_profile", json={"output_dir": str(tmp_path), "profile_prefix":
                                                                         f"r{i}"}) for i in range(6)))
            statuses = sorted(r.status_code for r in resps)
            stopped = await c.post("/stop_profile")
            assert stopped.status_code == 200 and os.path.exists(stopped.json()["trace"])
            return statuses

    assert asyncio.run(race()) == [200, 400, 400, 400, 400, 400]
    assert len(os.listdir(tmp_path)) == 1  # the one that started wrote its trace; no other was promised


@pytest.mark.parametrize("body,param", [
    ({"activities": ["TPU"]}, "activities"),
    ({"activities": []}, "activities"),
    ({"activities": ["GPU"]}, "activities"),  # the engine runs on the CPU
    ({"num_steps": 0}, "num_steps"),
    ({"start_step": 3}, "start_step"),
    ({"output_dir": "/proc/no/such/dir"}, "output_dir"),
    ({"output_dir": "/tmp/a\u0000b"}, "output_dir"),
    ({"profile_prefix": "sub/dir/x"}, "profile_prefix"),
    ({"profile_prefix": ".."}, "profile_prefix"),
    ({"profile_prefix": "x" * 300}, "profile_prefix"),
    ({"unknown": 1}, "unknown"),
])
def test_profile_bad_options_are_400(client: httpx.Client, body: dict, param: str) -> None:
    assert_error(client.post("/start_profile", json=body), 400, param)
    assert_error(client.post("/stop_profile"), 400)  # and nothing was started


def test_update_weights_from_disk(client: httpx.Client) -> None:
    from core.engine.model_loader.loader import default_model_path

    before = gen(client, text="The best fruit is", sampling_params=greedy(5)).json()["text"]
    path = str(default_model_path())
    resp = client.post("/update_weights_from_disk", json={"model_path": path, "weight_version": "v2"})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["success"] is True and body["message"].startswith("Succeeded to update model weights")
    info = client.get("/get_model_info").json()
    assert info["weight_version"] == "v2" and info["model_path"] == path
    assert gen(client, text="The best fruit is", sampling_params=greedy(5)).json()["text"] == before

    bad = client.post("/update_weights_from_disk", json={"model_path": "/no/such/model"})
    assert bad.status_code == 400 and bad.json()["success"] is False and bad.json()["message"]
    assert gen(client, text="The best fruit is", sampling_params=greedy(5)).json()["text"] == before
    assert_error(client.post("/update_weights_from_disk", json={}), 400, "model_path")


# ---------------------------------------------------------------------------- metrics
def test_metrics_change_after_a_request(client: httpx.Client) -> None:
    m0 = metrics(client)
    for name in ("sglang:prompt_tokens_total", "sglang:generation_tokens_total", "sglang:num_running_reqs",
                 "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate", "sglang:gen_throughput",
                 "sglang:time_to_first_token_seconds_count", "sglang:inter_token_latency_seconds_count",
                 "sglang:e2e_request_latency_seconds_count", "sglang:num_requests_total"):
        assert name in m0, name
    out = gen(client, text="Metrics are", sampling_params=greedy(5)).json()
    m1 = metrics(client)
    assert m1["sglang:prompt_tokens_total"] == m0["sglang:prompt_tokens_total"] + out["meta_info"]["prompt_tokens"]
    assert m1["sglang:generation_tokens_total"] == m0["sglang:generation_tokens_total"] + 5
    assert m1["sglang:num_requests_total"] == m0["sglang:num_requests_total"] + 1
    assert m1["sglang:time_to_first_token_seconds_count"] == m0["sglang:time_to_first_token_seconds_count"] + 1
    assert m1["sglang:e2e_request_latency_seconds_count"] == m0["sglang:e2e_request_latency_seconds_count"] + 1
    assert m1["sglang:inter_token_latency_seconds_count"] >= m0["sglang:inter_token_latency_seconds_count"] + 4
    assert m1["sglang:gen_throughput"] > 0
    assert m1["sglang:num_running_reqs"] == 0 and m1["sglang:token_usage"] == 0


def test_client_disconnect_mid_stream_frees_everything(client: httpx.Client) -> None:
    aborted0 = metrics(client).get("sglang:num_aborted_requests_total", 0)
    with client.stream("POST", "/generate", json={"text": "Describe the ocean", "stream": True,
                                                  "sampling_params": greedy(200, ignore_eos=True)}) as resp:
        it = resp.iter_lines()
        seen = 0
        for line in it:
            if line.startswith("data: {"):
                seen += 1
            if seen == 2:
                break
        assert metrics(client)["sglang:num_running_reqs"] == 1
        assert load(client)["num_used_tokens"] > 0
    # the response is closed mid-stream: the connection drops
    wait_for(lambda: metrics(client)["sglang:num_running_reqs"] == 0, timeout=5)
    l0 = load(client)
    assert l0["num_running_reqs"] == 0 and l0["num_waiting_reqs"] == 0
    assert l0["num_used_tokens"] == 0 and l0["token_usage"] == 0 and l0["num_free_tokens"] == l0["max_total_num_tokens"]
    m = metrics(client)
    assert m["sglang:num_aborted_requests_total"] == aborted0 + 1
    assert m["sglang:token_usage"] == 0


def test_client_disconnect_non_stream_aborts(srv: ServerProcess, client: httpx.Client) -> None:
    """A plain (non-streaming) request whose client goes away while it runs is aborted. The
    connection is a raw socket closed once the server reports the request running, so this
    does not depend on how fast the engine generates."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(srv.base_url)
    aborted0 = metrics(client)["sglang:num_aborted_requests_total"]
    body = json.dumps({"text": "Slow", "sampling_params": greedy(CTX - 8, ignore_eos=True)}).encode()
    sock = socket.create_connection((url.hostname, url.port), timeout=10)
    try:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: {AUTH['Authorization']}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_for(lambda: load(client)["num_running_reqs"] == 1, timeout=10)
    finally:
        sock.close()
    wait_for(lambda: load(client)["num_running_reqs"] == 0, timeout=5)
    assert load(client)["num_used_tokens"] == 0
    assert metrics(client)["sglang:num_aborted_requests_total"] == aborted0 + 1


def test_fifty_concurrent_streaming_clients(srv: ServerProcess) -> None:
    async def one(c: httpx.AsyncClient, i: int) -> dict:
        body = {"text": f"Request number {i} says", "stream": True, "sampling_params": greedy(4 + i % 3)}
        last, done = None, False
        async with c.stream("POST", "/generate", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    last = json.loads(line[6:])
        assert done and last is not None
        return last

    async def main() -> list[dict]:
        limits = httpx.Limits(max_connections=60, max_keepalive_connections=60)
        async with httpx.AsyncClient(base_url=srv.base_url, headers=AUTH, timeout=120, limits=limits) as c:
            return await asyncio.gather(*(one(c, i) for i in range(50)))

    results = asyncio.run(main())
    assert len(results) == 50
    for i, r in enumerate(results):
        assert r["meta_info"]["finish_reason"]["type"] == "length"
        assert r["meta_info"]["completion_tokens"] == 4 + i % 3
    assert len({r["meta_info"]["id"] for r in results}) == 50


def test_request_logs(srv: ServerProcess, client: httpx.Client) -> None:
    gen(client, text="Log me please", sampling_params=greedy(2), rid="logged-rid")

    def logged() -> bool:
        logs = srv.logs()
        return "request.received" in logs and "request.output" in logs and "logged-rid" in logs

    wait_for(logged, timeout=5)
    logs = srv.logs()
    assert "Log me please" in logs
    assert KEY not in logs


@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
def test_bench_serving_against_the_server(srv: ServerProcess, client: str, monkeypatch) -> None:
    from core.bench_serving import _AiohttpClient, add_bench_command, format_report, http_client, run_benchmark

    if client == "httpx":  # aiohttp not installed: httpx's client
        monkeypatch.setitem(sys.modules, "aiohttp", None)
    picked = http_client("http://x", {}, 1, 1.0)
    assert isinstance(picked, _AiohttpClient) == (client == "aiohttp")
    if client == "httpx":
        asyncio.run(picked.aclose())

    root = argparse.ArgumentParser()
    add_bench_command(root.add_subparsers(dest="command"))
    ns = root.parse_args(["bench", "serving", "--base-url", srv.base_url, "--api-key", KEY, "--num-prompts", "6",
                          "--random-input-len", "24", "--random-output-len", "6", "--request-rate", "20",
                          "--max-concurrency", "4"])
    result = asyncio.run(run_benchmark(ns))
    assert result["completed"] == 6 and result["failed"] == 0, result["errors"]
    assert result["output_throughput"] > 0 and result["request_throughput"] > 0
    assert 0 < result["p50_ttft_ms"] <= result["p99_ttft_ms"] and result["p50_itl_ms"] > 0
    report = format_report(result)
    assert "Output token throughput (tok/s)" in report and "P99 ITL (ms)" in report
    assert "profile_trace" not in result

    ns = root.parse_args(["bench", "serving", "--base-url", srv.base_url, "--api-key", KEY, "--num-prompts", "2",
                          "--random-input-len", "8", "--random-output-len", "2", "--profile"])
    result = asyncio.run(run_benchmark(ns))  # the trace lands where the server says (here /tmp)
    assert result["completed"] == 2 and os.path.exists(result["profile_trace"])
    assert result["profile_trace"] in format_report(result)
    os.unlink(result["profile_trace"])


# ---------------------------------------------------------------------------- config, queue limit, shutdown
def test_config_yaml_and_cli_precedence(cfg_client: httpx.Client) -> None:
    info = cfg_client.get("/get_server_info").json()
    assert info["served_model_name"] == "from-cli"  # the command line wins over the file
    assert info["max_queued_requests"] == 1 and info["max_running_requests"] == 1
    assert info["stream_interval"] == 2 and info["enable_metrics"] is False
    assert info["api_key"] is None


def test_more_sequences_than_the_queue_holds_is_400(cfg_client: httpx.Client) -> None:
    resp = cfg_client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "n": 2,
                                                         "max_tokens": 2})
    assert "--max-queued-requests 1" in assert_error(resp, 400, "n")["message"]  # not a 503: a retry cannot help


def test_queue_full_is_503(cfg_srv: ServerProcess, cfg_client: httpx.Client) -> None:
    long = {"text": "Go on forever", "stream": True, "sampling_params": greedy(400, ignore_eos=True)}
    with httpx.Client(base_url=cfg_srv.base_url, timeout=60) as c1, httpx.Client(base_url=cfg_srv.base_url, timeout=60) as c2:
        with c1.stream("POST", "/generate", json=long) as r1:
            assert r1.status_code == 200
            wait_for(lambda: load(cfg_client)["num_running_reqs"] == 1)
            with c2.stream("POST", "/generate", json=long) as r2:
                assert r2.status_code == 200
                wait_for(lambda: load(cfg_client)["num_waiting_reqs"] == 1)
                err = assert_error(cfg_client.post("/generate", json={"text": "one more"}), 503)
                assert "queue" in err["message"]
                # a refusal of the server's own is logged, not only answered
                wait_for(lambda: "server.request_refused" in cfg_srv.logs())
                assert any("status=503" in line for line in cfg_srv.logs().splitlines() if "server.request_refused" in line)
                assert cfg_client.post("/abort_request", json={"rid": "", "abort_all": True}).status_code == 200
    wait_for(lambda: load(cfg_client)["num_total_reqs"] == 0)
    assert gen(cfg_client, text="fits now", sampling_params=greedy(1)).status_code == 200


def test_sigterm_during_a_stream_exits_0(cfg_srv: ServerProcess) -> None:
    """Last test on cfg_srv: SIGTERM stops it; the running stream ends within the 1 s grace period."""
    body = {"text": "A very long story", "stream": True, "sampling_params": greedy(2000, ignore_eos=True)}
    with httpx.Client(base_url=cfg_srv.base_url, timeout=30) as c:
        with c.stream("POST", "/generate", json=body) as resp:
            it = resp.iter_lines()
            next(it)
            t0 = time.monotonic()
            cfg_srv.proc.send_signal(signal.SIGTERM)
            events = [line for line in it if line]
    assert events[-1] == "data: [DONE]"
    final = json.loads(events[-2][6:])
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert cfg_srv.proc.wait(15) == 0
    assert time.monotonic() - t0 < 10
    with pytest.raises(httpx.ConnectError):
        httpx.get(cfg_srv.base_url + "/health", timeout=2)


# ---------------------------------------------------------------------------- parser (in-process, no model)
def _parse(*argv: str):
    from core.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_parallel_flags_parse_with_sglangs_spellings() -> None:
    ns = _parse("--tp", "2", "--dp", "2", "--load-balance-method", "prefix", "--nnodes", "2", "--node-rank", "1",
                "--dist-init-addr", "10.0.0.1:5000")  # --tp / --dp: SGLang's documented abbreviations
    assert (ns.tp_size, ns.dp_size, ns.load_balance_method, ns.nnodes, ns.node_rank, ns.dist_init_addr) == (
        2, 2, "prefix", 2, 1, "10.0.0.1:5000")
    assert _parse("--tensor-parallel-size", "4").tp_size == 4 and _parse("--data-parallel-size", "3").dp_size == 3
    assert _parse("--speculative-draft-model", "d").speculative_draft_model_path == "d"  # (SGLang's alias)


@pytest.mark.parametrize("argv,message", [
    (["--schedule-conservativeness", "0"], "--schedule-conservativeness must be > 0"),
    (["--num-continuous-decode-steps", "0"], "--num-continuous-decode-steps must be >= 1, got 0"),
    (["--pp-size", "2"], "--pp-size 2 is not supported yet"),
    (["--ep", "2"], "--ep-size 2 is not supported yet"),
    (["--enable-dp-attention"], "--enable-dp-attention is not supported yet"),
    (["--speculative-algorithm", "DFLASH"], "--speculative-algorithm DFLASH is not supported yet"),
])
def test_unsupported_flags_are_errors(argv: list[str], message: str) -> None:
    from core.errors import CoreError
    from core.server.args import validate_serve_args

    ns = _parse(*argv)
    with pytest.raises(CoreError, match="^" + message.replace("-", r"\-")):
        validate_serve_args(ns)


@pytest.mark.parametrize("argv", [[], ["--grammar-backend", "none"], ["--grammar-backend", "llguidance"],
                                  ["--tool-call-parser", "qwen25"], ["--reasoning-parser", "deepseek-r1"], ["--chunked-prefill-size", "-1"],
                                  ["--schedule-policy", "fcfs"], ["--tp-size", "1"], ["--chunked-prefill-size", "4096"],
                                  ["--schedule-policy", "lpm"], ["--schedule-policy", "dfs-weight"], ["--enable-mixed-chunk"],
                                  ["--disable-radix-cache"], ["--radix-eviction-policy", "lfu"], ["--enable-priority-scheduling"],
                                  ["--num-continuous-decode-steps", "8"]])
def test_supported_values_pass_validation(argv: list[str]) -> None:
    from core.server.args import validate_serve_args

    validate_serve_args(_parse(*argv))


def test_unsupported_flag_exits_2_with_one_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "core.cli", "serve", "--enable-dp-attention"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "core serve: error: --enable-dp-attention is not supported yet"


def test_defaults_match_sglang() -> None:
    ns = _parse()
    assert (ns.host, ns.port) == ("127.0.0.1", 30000)
    assert ns.api_key is None and ns.enable_metrics is False and ns.stream_interval == 1
    assert ns.file_storage_path == "sglang_storage" and ns.schedule_policy == "fcfs"
    assert _parse("--model", "m.gguf").model_path == "m.gguf"


def test_help_groups_follow_sglang(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        _parse("--help")
    assert e.value.code == 0
    out = capsys.readouterr().out
    titles = ["Model and tokenizer:", "HTTP server:", "Quantization and data type:", "Memory and scheduling:",
              "Runtime options:", "Logging:", "API related:", "LoRA:", "Configuration file:"]
    positions = [out.index(t) for t in titles]
    assert positions == sorted(positions)
    http = out[out.index("HTTP server:"):out.index("Quantization and data type:")]
    assert "--port" in http and "--host" in http
    api = out[out.index("API related:"):out.index("Data parallelism:")]
    assert "--api-key" in api and "--served-model-name" in api


def test_config_file_precedence_and_errors(tmp_path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("port: 4000\nmax-running-requests: 3\nenable_metrics: true\nmodel: x.gguf\n")
    ns = _parse("--config", str(cfg), "--port", "5000")
    assert ns.port == 5000 and ns.max_running_requests == 3 and ns.enable_metrics is True
    assert ns.model_path == "x.gguf"
    bad = tmp_path / "bad.yaml"
    bad.write_text("no-such-flag: 1\n")
    with pytest.raises(SystemExit) as e:
        _parse("--config", str(bad))
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        _parse("--config", str(tmp_path / "missing.yaml"))


def test_plugin_cli_options_reach_engine_args_extra(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    import types

    import core.plugins as plugins
    from core import hookimpl
    from core.server.args import engine_args_from_namespace

    mod = types.ModuleType("fakeplug")

    @hookimpl
    def add_cli_options(parser):
        parser.add_argument("--fakeplug-scale", type=float, default=1.0)

    mod.add_cli_options = add_cli_options

    class EP:
        name, value, dist = "fakeplug", "fakeplug", None

        def load(self):
            return mod

    monkeypatch.setattr(plugins, "_entry_points", lambda: [EP()])
    ns = _parse("--fakeplug-scale", "2.5")
    args = engine_args_from_namespace(ns, ns._plugin_dests)
    assert args.extra == {"fakeplug_scale": 2.5}
    cfg = tmp_path / "p.yaml"
    cfg.write_text("fakeplug-scale: 4\n")
    ns = _parse("--config", str(cfg))
    assert engine_args_from_namespace(ns, ns._plugin_dests).extra == {"fakeplug_scale": 4.0}


# ---------------------------------------------------------------------------- app-level (in-process, stub engine)
def _broken_load() -> dict:
    raise RuntimeError("scheduler exploded")


def _stub_app(**args: Any):
    from core.server.app import create_app
    from core.server.args import ServerArgs
    from core.server.metrics import Metrics
    from core.server.state import ServerState

    engine = types.SimpleNamespace(load=_broken_load, finish_listeners=[], step_listeners=[])
    state = ServerState(engine=engine, args=ServerArgs(**args), metrics=Metrics("stub", enabled=False),  # type: ignore[arg-type]
                        served_model_name="stub")
    return state, create_app(state)


def test_unexpected_error_is_500_and_the_app_keeps_serving() -> None:
    from starlette.testclient import TestClient

    state, app = _stub_app()
    with TestClient(app, raise_server_exceptions=False) as c:
        err = assert_error(c.get("/v1/loads"), 500)
        assert err["type"] == "server_error" and "scheduler exploded" in err["message"]
        assert c.get("/health").status_code == 503  # not ready yet
        state.ready = True
        assert c.get("/health").status_code == 200
        assert_error(c.get("/v1/loads"), 500)


def test_api_key_middleware_in_process() -> None:
    from starlette.testclient import TestClient

    state, app = _stub_app(api_key="k1")
    state.ready = True
    with TestClient(app, raise_server_exceptions=False) as c:
        assert c.get("/health").status_code == 200
        # health, readiness and metrics stay open for probes and scrapers, as SGLang leaves them
        for path in ("/health_generate", "/metrics", "/ready"):
            assert c.get(path).status_code != 401, path
        err = assert_error(c.get("/get_model_info"), 401, None)
        assert err["code"] == "invalid_api_key"
        assert c.get("/no/route", headers={"Authorization": "Bearer k1"}).status_code == 404
        assert_error(c.get("/no/route", headers={"Authorization": "Bearer k2"}), 401)


def test_error_response_shape() -> None:
    from core.server.http import ApiError

    def error_response(status: int, message: str, **kw: Any):
        return ApiError(status, message, **kw).response()

    resp = error_response(422, "bad thing", param="x")
    assert resp.status_code == 422
    assert json.loads(resp.body) == {"error": {"message": "bad thing", "type": "invalid_request_error", "param": "x",
                                               "code": 422}}
    resp = error_response(401, "no key", code="invalid_api_key")
    assert json.loads(resp.body)["error"]["code"] == "invalid_api_key"
    assert json.loads(error_response(503, "busy").body)["error"] == {"message": "busy", "type": "server_error",
                                                                    "param": None, "code": 503}


def test_api_error_is_the_one_mapping() -> None:
    """Every exception becomes the same error object: bad input 400 naming the field, a full queue 503, bugs 500."""
    import msgspec

    from core.errors import CoreError, InvalidRequest
    from core.server.http import ApiError, api_error, decode_body
    from core.server.state import ServiceUnavailable

    class Body(msgspec.Struct, forbid_unknown_fields=True):
        n: int = 1

    def shape(exc: BaseException) -> tuple:
        e = api_error(exc)
        return e.status, e.type, e.param, e.code

    assert shape(InvalidRequest("bad", param="n")) == (400, "invalid_request_error", "n", 400)
    assert shape(ServiceUnavailable("queue full")) == (503, "server_error", None, 503)
    assert shape(CoreError("no")) == (400, "invalid_request_error", None, 400)
    assert shape(RuntimeError("boom")) == (500, "server_error", None, 500)
    assert api_error(RuntimeError("boom")).message == "internal server error: RuntimeError: boom"
    err = ApiError(404, "gone", param="id", code="not_found")
    assert api_error(err) is err and err.to_dict() == {"error": {"message": "gone", "type": "invalid_request_error",
                                                                 "param": "id", "code": "not_found"}}
    for raw, param in ((b'{"n": "2"}', "n"), (b'{"m": 1}', "m"), (b"[1]", None), (b"{x", None), (b" ", None)):
        with pytest.raises(InvalidRequest) as e:
            decode_body(raw, Body)
        assert e.value.param == param, (raw, e.value.message)


def test_auto_truncate_is_one_rule_on_every_endpoint() -> None:
    """--allow-auto-truncate keeps the head of an over-long prompt (its first context - 1 tokens, as
    SGLang does) on /generate, /v1/completions and /v1/chat/completions alike; without it all three 400."""
    from core.cli import build_parser
    from core.engine import AsyncEngine
    from core.engine.config import engine_args_from_namespace
    from core.server.app import create_app
    from core.server.args import ServerArgs
    from core.server.state import build_state

    ctx = 48
    ns = build_parser().parse_args(["serve", "--allow-auto-truncate", "--context-length", str(ctx), "--cpu-threads", "1",
                                    "--max-total-tokens", "4096", "--grammar-backend", "none"])

    async def main() -> None:
        engine = AsyncEngine(engine_args_from_namespace(ns))
        state = build_state(engine, ServerArgs.from_namespace(ns))
        state.ready = True
        seen: list[list[int]] = []
        engine.finish_listeners.append(lambda req: seen.append(list(req.prompt_ids)))
        text = "The quick brown fox jumps over the lazy dog, again and again. " * 12
        ids = engine.tokenize(text, None)
        chat = [{"role": "user", "content": text}]
        rendered = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
                                           add_special_tokens=False)
        assert len(ids) > ctx and len(rendered) > ctx
        calls = [
            ("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}, ids),
            ("/generate", {"text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}, ids),
            ("/v1/completions", {"prompt": ids, "max_tokens": 4, "temperature": 0}, ids),
            ("/v1/completions", {"prompt": text, "max_tokens": 4, "temperature": 0}, ids),
            ("/v1/chat/completions", {"messages": chat, "max_tokens": 4, "temperature": 0}, rendered),
        ]
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://t") as c:
                for path, body, full in calls:
                    r = await c.post(path, json=body)
                    assert r.status_code == 200, (path, r.text)
                    assert seen[-1] == full[: ctx - 1], path  # the head, not the tail
                    out = r.json()
                    tokens = out["meta_info"]["completion_tokens"] if path == "/generate" else out["usage"]["completion_tokens"]
                    assert tokens == 1, path  # max tokens cut to what still fits
                state.args = ServerArgs()  # the flag off: the same requests are rejected
                for path, body, _ in calls:
                    assert_error(await c.post(path, json=body), 400)
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_large_bodies_are_prepared_off_the_event_loop() -> None:
    """A request whose body is large is validated and tokenized on a worker thread, so its
    tokenizing never stalls the loop that streams the other requests; a small one stays."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from core.server.http import OFF_LOOP_BODY_BYTES, prepare_off_loop

    async def where(size: int) -> str:
        request = SimpleNamespace(_body=b"x" * size)
        return await prepare_off_loop(request, lambda: threading.current_thread().name)

    main = threading.current_thread().name
    assert asyncio.run(where(100)) == main
    assert asyncio.run(where(OFF_LOOP_BODY_BYTES + 1)) != main
