"""Tool-calling and request fields that were accepted but not honoured (each test failed before its fix):
a constrained answer under a reasoning parser whose output starts inside the think block,
``parallel_tool_calls: false`` with ``tool_choice: auto``, ``strict`` tools under ``auto``, and the
Responses and Messages APIs' unknown fields."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from tests.test_robustness_limits import Served

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("get_weather", "get_time")]
CALL_W = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_T = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
STRICT = [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris"]}}, "required": ["city"],
    "additionalProperties": False}}}]
STRICT_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
HI = [{"role": "user", "content": "hi"}]


def _sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.fixture(scope="module")
def qwen(tiny_llama):
    s = Served(tiny_llama()[0], "--tool-call-parser", "qwen25")
    yield s
    s.close()


@pytest.fixture(scope="module")
def r1(tiny_llama):
    s = Served(tiny_llama()[0], "--reasoning-parser", "deepseek-r1", "--tool-call-parser", "qwen25")
    yield s
    s.close()


# ---- a constraint under a reasoning parser whose output starts inside <think>


@pytest.mark.parametrize("stream", [False, True])
def test_a_constrained_answer_is_content_not_reasoning(r1, stream):
    """The grammar holds from the first token, so the output has no think block: deepseek-r1's
    parser had put all of it into reasoning_content, leaving content empty."""
    body = {"messages": HI, "temperature": 0, "max_tokens": 30, "ebnf": 'root ::= "{\\"a\\": 1}"', "stream": stream}
    r = r1.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if stream:
        deltas = [c["choices"][0]["delta"] for c in _sse(r.text) if c["choices"]]
        content = "".join(d.get("content") or "" for d in deltas)
        reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    else:
        msg = r.json()["choices"][0]["message"]
        content, reasoning = msg["content"], msg.get("reasoning_content") or ""
    assert (content, reasoning) == ('{"a": 1}', "")


def test_a_required_tool_call_survives_a_reasoning_parser(r1):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris"]}}, "required": ["city"],
        "additionalProperties": False}}}]
    body = {"messages": HI, "temperature": 0, "max_tokens": 80, "tools": tools, "tool_choice": "required",
            "parallel_tool_calls": False}
    r = r1.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert choice["finish_reason"] == "tool_calls"


def test_a_messages_json_answer_is_a_text_block(r1):
    body = {"messages": HI, "max_tokens": 30, "temperature": 0,
            "output_config": {"format": {"type": "json_schema", "schema": {"type": "object", "properties": {
                "a": {"type": "integer", "enum": [1]}}, "required": ["a"], "additionalProperties": False}}}}
    r = r1.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    blocks = r.json()["content"]
    assert [b["type"] for b in blocks] == ["text"]
    assert json.loads(blocks[0]["text"]) == {"a": 1}


# ---- parallel_tool_calls: false under tool_choice auto


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_keeps_one_call(qwen, stream):
    """The output (dictated by the ebnf) holds two calls; at most one was asked for: the first."""
    body = {"messages": HI, "tools": TOOLS, "temperature": 0, "parallel_tool_calls": False, "stream": stream,
            "ebnf": "root ::= " + json.dumps(CALL_W + "\n" + CALL_T)}
    r = qwen.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [c for c in _sse(r.text) if c["choices"]]
        calls = [t for c in chunks for t in c["choices"][0]["delta"].get("tool_calls") or []]
        assert {t["index"] for t in calls} == {0}
        assert [t["function"]["name"] for t in calls if "id" in t] == ["get_weather"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    else:
        choice = r.json()["choices"][0]
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
        assert choice["finish_reason"] == "tool_calls"
    body["parallel_tool_calls"] = None  # the default: both
    body["stream"] = False
    calls = qwen.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]


# ---- strict tools under tool_choice auto


def test_strict_tools_under_auto_hold_the_calls_to_their_schemas(qwen):
    from core.server.openai.tools import _strict_auto

    r = type("R", (), {"tools": STRICT, "parallel_tool_calls": None})()
    kind, spec = _strict_auto(qwen.state, r, 0)
    assert kind == "structural_tag"
    grammar = xgr.Grammar.from_structural_tag(spec)
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(["a"])).compile_grammar(grammar)

    def accepted(text: str) -> bool:
        return xgr.GrammarMatcher(compiled).accept_string(text)

    assert accepted("Sure, let me look that up. ")  # free text
    assert accepted("Sure. " + STRICT_CALL)  # a call that follows the schema
    assert not accepted("Sure. " + STRICT_CALL.replace("Paris", "Rome"))  # one that does not


def test_strict_tools_under_auto_are_constrained_through_the_api(qwen):
    from core.server.openai.chat import prepare_chat
    from core.server.openai.protocol import ChatCompletionRequest
    import msgspec

    r = msgspec.convert({"messages": HI, "tools": STRICT, "tool_choice": "auto"}, ChatCompletionRequest)
    assert json.loads(prepare_chat(qwen.state, r).reqs[0].params.structural_tag)["format"]["type"] == "triggered_tags"
    body = {"messages": HI, "tools": STRICT, "temperature": 0, "max_tokens": 8}
    assert qwen.post("/v1/chat/completions", json=body).status_code == 200
    # strict false, or no strict: nothing constrains the output
    loose = [{**STRICT[0], "function": {**STRICT[0]["function"], "strict": False}}]
    r = msgspec.convert({"messages": HI, "tools": loose, "tool_choice": "auto"}, ChatCompletionRequest)
    assert prepare_chat(qwen.state, r).reqs[0].params.structural_tag is None


def test_strict_tools_under_auto_without_a_parser_that_can_hold_them_is_a_400(tiny_llama):
    s = Served(tiny_llama()[0])  # no --tool-call-parser
    try:
        r = s.post("/v1/chat/completions", json={"messages": HI, "tools": STRICT, "max_tokens": 4})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "tools[0].function.strict"
    finally:
        s.close()


# ---- unknown fields on /v1/responses and /v1/messages


@pytest.mark.parametrize("field,value", [("no_such_field", 1), ("n", 3), ("max_tool_calls", 1)])
def test_responses_refuses_unknown_fields(qwen, field, value):
    r = qwen.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_responses_takes_sglangs_penalties_and_stop(qwen):
    """SGLang's extras on /v1/responses are honoured: a stop string cuts the answer where the same
    request without it goes on."""
    base = {"input": "hi", "max_output_tokens": 12, "temperature": 0}
    full = qwen.post("/v1/responses", json=base).json()["output"][-1]["content"][0]["text"]
    assert len(full) > 3
    cut = qwen.post("/v1/responses", json={**base, "stop": [full[2:4]]}).json()["output"][-1]["content"][0]["text"]
    assert cut == full[:full.index(full[2:4])]
    for field in ("frequency_penalty", "presence_penalty"):
        assert qwen.post("/v1/responses", json={**base, field: 0.5}).status_code == 200
    ignored = qwen.post("/v1/responses", json={**base, "service_tier": "auto", "prompt_cache_key": "k"})
    assert ignored.status_code == 200


@pytest.mark.parametrize("field,value", [("no_such_field", 1), ("stop", ["a"]), ("n", 2), ("context_management", {})])
def test_messages_refuses_unknown_fields(qwen, field, value):
    r = qwen.post("/v1/messages", json={"messages": HI, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and field in r.json()["error"]["message"]
    r = qwen.post("/v1/messages/count_tokens", json={"messages": HI, field: value})
    assert r.status_code == 400, r.text
