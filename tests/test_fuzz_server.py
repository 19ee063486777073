"""Property-based fuzzing of every endpoint with hypothesis, against the real app in this
process (a tiny random Llama with a short context, so a valid request costs milliseconds).

* Any JSON body (random, or a valid request with one part mutated), any bytes, any path id:
  never a 5xx, the server keeps serving, and every error is the OpenAI error object with a
  message (streams included: an in-band error event carries one too; /update_weights_from_disk
  and /flush_cache keep SGLang's own shapes, ``{"success", "message"}`` and plain text).
* /generate's sampling parameters: valid ones never error (and honour ``max_new_tokens``);
  one invalid field is a 400 naming that field.

CI runs the ``ci`` profile (few examples, derandomized, so a run is fast and repeatable);
``CORE_FUZZ_PROFILE=long`` runs thousands of random examples locally.
"""

from __future__ import annotations

import json
import os
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import assert_pool_free
from tests.test_robustness_limits import Served

_COMMON = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                      HealthCheck.function_scoped_fixture])
settings.register_profile("ci", max_examples=40, derandomize=True, **_COMMON)
settings.register_profile("long", max_examples=3000, **_COMMON)
PROFILE = settings.get_profile(os.environ.get("CORE_FUZZ_PROFILE", "ci"))
CONTEXT = 48
VOCAB = 256  # the tiny model's


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    s = Served(tiny_llama()[0], "--context-length", str(CONTEXT), "--max-running-requests", "64",
               "--file-storage-path", str(tmp_path_factory.mktemp("files")), "--tool-call-parser", "qwen25",
               "--reasoning-parser", "deepseek-r1")
    yield s
    try:  # the fuzzing left the server serving and leaked nothing
        assert s.get("/health").status_code == 200
        ok = s.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        assert ok.status_code == 200, ok.text
        s.run(_idle(s))
        assert_pool_free(s.engine)
    finally:
        s.close()


async def _idle(s: Served) -> None:
    import asyncio

    for _ in range(500):
        if not s.engine.has_work():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("requests still running after the fuzzing")


# ---------------------------------------------------------------------------- checking one answer
def check_answer(resp: Any) -> None:
    """Never a 5xx; an error is ``{"error": {"message": <non-empty str>, ...}}``; an event
    stream's in-band errors too."""
    assert resp.status_code < 500, (resp.request.method, resp.request.url.path, resp.status_code, resp.text[:2000])
    path = resp.request.url.path
    if resp.status_code >= 400 and path == "/flush_cache":  # SGLang's plain-text refusal
        assert resp.text.startswith("Cache not flushed"), resp.text
    elif resp.status_code >= 400 and path == "/update_weights_from_disk" and "error" not in resp.json():
        body = resp.json()  # SGLang's own shape for this endpoint
        assert body["success"] is False and isinstance(body["message"], str) and body["message"], body
    elif resp.status_code >= 400:
        body = resp.json()
        err = body.get("error") if isinstance(body, dict) else None
        assert isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"], resp.text[:2000]
    elif resp.headers.get("content-type", "").startswith("text/event-stream"):
        for line in resp.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if isinstance(event, dict) and "error" in event:
                    assert isinstance(event["error"].get("message"), str) and event["error"]["message"], event


# ---------------------------------------------------------------------------- strategies
scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
json_values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                                                              max_size=4), max_leaves=10)


def _fields(struct: Any) -> list[str]:
    return [f.name for f in msgspec.structs.fields(struct)]


def _known_keys() -> dict[str, list[str]]:
    from core.server.native import AbortReq, GenerateReqInput, UpdateWeightFromDiskReqInput
    from core.server.openai.protocol import BatchRequest, ChatCompletionRequest, CompletionRequest

    return {
        "/generate": _fields(GenerateReqInput),
        "/v1/chat/completions": _fields(ChatCompletionRequest),
        "/v1/completions": _fields(CompletionRequest),
        "/v1/embeddings": ["input", "model", "encoding_format", "dimensions"],
        "/encode": ["text", "input_ids"],
        "/classify": ["text", "input_ids"],
        "/abort_request": _fields(AbortReq),
        "/update_weights_from_disk": _fields(UpdateWeightFromDiskReqInput),
        "/parse_function_call": ["text", "tool_call_parser", "tools"],
        "/separate_reasoning": ["text", "reasoning_parser"],
        "/v1/batches": _fields(BatchRequest),
        "/v1/files": ["file", "purpose"],
        "/flush_cache": [],
        "/health": [],
        "/health_generate": [],
    }


KNOWN = _known_keys()
# the update path only ever names a folder that does not exist (never a real model to load)
MODEL_PATHS = st.text(alphabet="abc/", max_size=6).map(lambda s: "/nonexistent-" + s)

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SEEDS: dict[str, list[dict]] = {
    "/generate": [
        {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
        {"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": [{"max_new_tokens": 3}, {"max_new_tokens": 2, "n": 2}],
         "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0},
        {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 3, "stop": ["x"], "regex": "[ab]{1,3}"}},
    ],
    "/v1/chat/completions": [
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], "max_tokens": 3},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 3, "stream": True,
         "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2, "n": 2},
        {"messages": [{"role": "user", "content": "weather?"}], "max_tokens": 12, "tools": [TOOL],
         "tool_choice": "required"},
        {"messages": [{"role": "user", "content": "json"}], "max_tokens": 8,
         "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
    ],
    "/v1/completions": [
        {"prompt": "Once upon", "max_tokens": 3, "temperature": 0.5, "seed": 3},
        {"prompt": [[5, 6], [7, 8, 9]], "max_tokens": 2, "echo": True, "logprobs": 2, "stream": True},
        {"prompt": ["a", "b"], "max_tokens": 2, "n": 2, "stop": ["\n"], "json_schema": '{"type": "string"}'},
    ],
    "/abort_request": [{"rid": "nope"}, {"abort_all": False, "rid": "x"}],
    "/update_weights_from_disk": [{"model_path": "/nonexistent-model"}],
    "/parse_function_call": [{"text": '{"name": "get_weather", "arguments": {"city": "Paris"}}',
                              "tool_call_parser": "qwen25", "tools": [TOOL]}],
    "/separate_reasoning": [{"text": "<think>hmm</think>yes", "reasoning_parser": "deepseek-r1"}],
    "/v1/batches": [{"input_file_id": "file-nope", "endpoint": "/v1/chat/completions", "completion_window": "24h"}],
    "/v1/embeddings": [{"input": "hi"}],
}


def _safe(path: str, body: Any) -> Any:
    if path == "/update_weights_from_disk" and isinstance(body, dict) and "model_path" in body:
        body = {**body, "model_path": "/nonexistent-" + str(body["model_path"])[:20]}
    return body


@st.composite
def random_bodies(draw: Any) -> tuple[str, Any]:
    path = draw(st.sampled_from(sorted(KNOWN)))
    keys = KNOWN[path]
    if keys and draw(st.booleans()):  # an object of the endpoint's own fields, values random
        chosen = draw(st.lists(st.sampled_from(keys), unique=True, max_size=min(6, len(keys))))
        body: Any = {k: draw(json_values) for k in chosen}
        if path == "/update_weights_from_disk":
            body["model_path"] = draw(MODEL_PATHS)
    else:
        body = draw(json_values)
    return path, _safe(path, body)


def _paths(v: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(v, dict):
        for k, x in v.items():
            out += _paths(x, prefix + (k,))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            out += _paths(x, prefix + (i,))
    return out


def _replace(v: Any, path: tuple, new: Any, delete: bool) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(v, dict):
        v = dict(v)
        if delete and not rest:
            v.pop(head, None)
        else:
            v[head] = _replace(v[head], rest, new, delete)
    else:
        v = list(v)
        if delete and not rest:
            v.pop(head)
        else:
            v[head] = _replace(v[head], rest, new, delete)
    return v


EDGES = st.sampled_from([0, -1, 1, 2**31, 2**63, -(2**63), 1e308, -1e-308, 0.5, "", "x" * 200, [], {}, None, True, False,
                         [[]], {"": None}])


@st.composite
def mutated_bodies(draw: Any) -> tuple[str, Any]:
    path = draw(st.sampled_from(sorted(SEEDS)))
    body = draw(st.sampled_from(SEEDS[path]))
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(_paths(body)))
        if not where:
            continue
        if draw(st.integers(0, 4)) == 0:
            body = _replace(body, where, None, delete=True)
        else:
            body = _replace(body, where, draw(EDGES | json_values), delete=False)
    if isinstance(body, dict) and draw(st.booleans()):
        body = {**body, draw(st.sampled_from(KNOWN[path] or ["x"])): draw(EDGES | json_values)}
    return path, _safe(path, body)


# ---------------------------------------------------------------------------- properties: every endpoint
@settings(PROFILE)
@given(case=random_bodies())
def test_random_bodies_never_5xx(served: Served, case: tuple[str, Any]) -> None:
    path, body = case
    check_answer(served.post(path, json=body))


@settings(PROFILE)
@given(case=mutated_bodies())
def test_mutated_valid_bodies_never_5xx(served: Served, case: tuple[str, Any]) -> None:
    path, body = case
    check_answer(served.post(path, json=body))


@settings(PROFILE)
@given(path=st.sampled_from(sorted(KNOWN)), raw=st.binary(max_size=64) | st.text(max_size=64).map(str.encode),
       ctype=st.sampled_from(["application/json", "text/plain", None]))
def test_raw_bytes_never_5xx(served: Served, path: str, raw: bytes, ctype: str | None) -> None:
    headers = {"content-type": ctype} if ctype else {}
    check_answer(served.post(path, content=raw, headers=headers))


@settings(PROFILE)
@given(kind=st.sampled_from(["/v1/models/", "/v1/files/", "/v1/batches/", "/v1/files/{}/content", "/v1/batches/{}/cancel"]),
       ident=st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=16))
def test_random_ids_never_5xx(served: Served, kind: str, ident: str) -> None:
    from urllib.parse import quote

    url = kind.replace("{}", quote(ident, safe="")) if "{}" in kind else kind + quote(ident, safe="")
    check_answer(served.post(url) if url.endswith("/cancel") else served.get(url))


# ---------------------------------------------------------------------------- properties: /generate sampling params
@st.composite
def valid_sampling_params(draw: Any) -> dict:
    max_new = draw(st.integers(0, 8))
    sp = draw(st.fixed_dictionaries({}, optional={
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0, 1, exclude_min=True),
        "top_k": st.just(-1) | st.integers(0, 300),
        "min_p": st.floats(0, 1),
        "frequency_penalty": st.floats(-2, 2),
        "presence_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0, 2, exclude_min=True),
        "stop": st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4), max_size=4),
        "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=4),
        "ignore_eos": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "spaces_between_special_tokens": st.booleans(),
        "no_stop_trim": st.booleans(),
        "n": st.integers(1, 3),
        "seed": st.integers(0, 2**63 - 1),
        "regex": st.sampled_from(["[ab]+", "(yes|no)", "[0-9]{1,3}"]),
        "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=3),
    }))
    sp["max_new_tokens"] = max_new
    if draw(st.booleans()):
        sp["min_new_tokens"] = draw(st.integers(0, max_new))
    return sp


INVALID: dict[str, Any] = {
    "max_new_tokens": (st.integers(max_value=-1) | st.just(1.5) | st.just("8") | st.just(True)
                       | st.integers(min_value=CONTEXT - 4, max_value=10**12)),  # cannot fit beside the prompt
    "min_new_tokens": st.integers(max_value=-1) | st.just("x"),
    "temperature": st.floats(max_value=-1e-9, allow_infinity=False) | st.just("hot") | st.just(False),
    "top_p": st.just(0) | st.floats(min_value=1.0000001, allow_infinity=False) | st.floats(max_value=-1e-9, allow_infinity=False),
    "top_k": st.integers(max_value=-2) | st.just(2.5),
    "min_p": st.floats(min_value=1.0000001, allow_infinity=False) | st.floats(max_value=-1e-9, allow_infinity=False),
    "frequency_penalty": st.floats(min_value=2.0000001, allow_infinity=False) | st.floats(max_value=-2.0000001, allow_infinity=False),
    "presence_penalty": st.floats(min_value=2.0000001, allow_infinity=False) | st.just([1]),
    "repetition_penalty": st.just(0) | st.floats(min_value=2.0000001, allow_infinity=False) | st.floats(max_value=0, allow_infinity=False),
    "n": st.integers(max_value=0) | st.integers(min_value=129, max_value=10**9) | st.just("2"),
    "seed": st.integers(max_value=-1) | st.integers(min_value=2**63, max_value=2**64 - 1) | st.just(1.5) | st.just("s"),
    "stop": (st.just([""]) | st.just([1, 2]) | st.lists(st.just("s"), min_size=65, max_size=70) | st.just({"a": 1})
             | st.just(5)),
    "ignore_eos": st.just("false") | st.just(0) | st.just(None.__class__.__name__),
    "skip_special_tokens": st.just(1) | st.just("x") | st.just([True]),
    "spaces_between_special_tokens": st.just({"a": 1}) | st.just(1.0),
    "no_stop_trim": st.just("yes") | st.just(0),
    "logit_bias": (st.just({"x": 1}) | st.just({str(VOCAB): 1}) | st.just({"1": 100.5}) | st.just({"1": "2"})
                   | st.just([1])),
    "stop_token_ids": st.lists(st.integers(max_value=-1), min_size=1, max_size=2) | st.just([VOCAB]) | st.just(["a"]),
}


@settings(PROFILE)
@given(sp=valid_sampling_params(), stream=st.booleans())
def test_valid_sampling_params_never_error(served: Served, sp: dict, stream: bool) -> None:
    resp = served.post("/generate", json={"input_ids": [5, 6, 7, 8], "sampling_params": sp, "stream": stream})
    assert resp.status_code == 200, (sp, resp.text[:2000])
    if stream:
        events = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
        assert not any("error" in e for e in events), events
        finals: dict[int, dict] = {e.get("index", 0): e for e in events}
        outs = list(finals.values())
    else:
        body = resp.json()
        outs = body if isinstance(body, list) else [body]
    assert len(outs) == sp.get("n", 1)
    for out in outs:
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] in ("length", "stop"), (sp, reason)
        assert len(out["output_ids"]) <= sp["max_new_tokens"]


@settings(PROFILE)
@given(base=valid_sampling_params(), field=st.sampled_from(sorted(INVALID)), data=st.data())
def test_one_invalid_sampling_param_is_400_naming_it(served: Served, base: dict, field: str, data: Any) -> None:
    value = data.draw(INVALID[field], label=field)
    sp = {**base, field: value}
    resp = served.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": sp})
    assert resp.status_code == 400, (sp, resp.text[:500])
    err = resp.json()["error"]
    assert err["param"] == field or field in err["message"], (field, value, err)


@settings(PROFILE)
@given(key=st.text(min_size=1, max_size=10).filter(lambda k: k not in _fields_of_sampling()))
def test_unknown_sampling_param_is_400_naming_it(served: Served, key: str) -> None:
    resp = served.post("/generate", json={"input_ids": [5, 6], "sampling_params": {key: 1}})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == key, resp.text[:500]


def _fields_of_sampling() -> set[str]:
    import attrs

    from core.engine.sampling_params import SamplingParams

    return {f.name for f in attrs.fields(SamplingParams)} | {"stream_interval", "sampling_seed"}
