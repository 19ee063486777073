"""Constrained decoding (xgrammar and llguidance), tool calls and reasoning end to end with SmolLM2."""

from __future__ import annotations

import asyncio
import json
import re
import types

import httpx
import jsonschema
import msgspec
import openai
import pytest

from tests.server_utils import start_server

pytestmark = pytest.mark.slow

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                                      "age": {"type": "integer", "minimum": 18, "maximum": 99}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                               "minItems": 1, "maxItems": 3},
                                      "loc": {"type": "object", "properties": {"lat": {"type": "number"}, "ok": {"type": "boolean"}},
                                              "required": ["lat", "ok"], "additionalProperties": False}},
     "required": ["city", "tags", "loc"], "additionalProperties": False},
]
REGEXES = [r"\d{3}-\d{4}", r"(yes|no), because [a-z ]{1,20}\."]
EBNF = 'root ::= city ", " country\ncity ::= "Paris" | "Tokyo" | "Lima"\ncountry ::= "France" | "Japan" | "Peru"'
EBNF_RE = r"(Paris|Tokyo|Lima), (France|Japan|Peru)"


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def server(request):
    # float32 (dense weights): greedy paths then do not depend on the CPU's bf16 rounding, and a tiny
    # model's greedy JSON is not left to fall into a digit or whitespace loop the schema allows
    with start_server("--grammar-backend", request.param, "--tool-call-parser", "qwen25", "--dtype", "float32",
                      "--reasoning-parser", "qwen3") as url:
        yield url


def gen(url, sp, text="Answer in the requested format. Tell me about a person:", **kw):
    r = httpx.post(url + "/generate", json={"text": text, "sampling_params": sp, **kw}, timeout=120)
    return r


@pytest.mark.parametrize("temperature", [0, 0.9])
def test_generate_constraints(server, temperature):
    for schema in SCHEMAS:
        # Whitespace is valid JSON anywhere, and a sampled 135M model can fall into a newline loop:
        # a frequency penalty (what a client would set) and room for long values let the object close.
        sp = {"temperature": temperature, "max_new_tokens": 200, "json_schema": json.dumps(schema), "seed": 1}
        if temperature:
            sp["frequency_penalty"] = 0.5
        out = gen(server, sp).json()
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), schema)
    for rx in REGEXES:
        out = gen(server, {"temperature": temperature, "max_new_tokens": 30, "regex": rx, "n": 2, "seed": 2}).json()
        for o in out:
            assert re.fullmatch(rx, o["text"]), o["text"]
    out = gen(server, {"temperature": temperature, "max_new_tokens": 12, "ebnf": EBNF}, text="Name a city and its country:").json()
    assert re.fullmatch(EBNF_RE, out["text"]), out["text"]


def test_constraint_errors_and_length(server):
    for sp in ({"regex": "(("}, {"json_schema": "{bad"}, {"ebnf": "root ::= nothing"},
               {"regex": "a", "ebnf": 'root ::= "a"'}):
        r = gen(server, {"max_new_tokens": 4, **sp})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"]
    out = gen(server, {"max_new_tokens": 3, "temperature": 0, "json_schema": json.dumps(SCHEMAS[1])}).json()
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    out = gen(server, {"max_new_tokens": 40, "temperature": 0, "regex": r"[a-z ]{5,30}!", "stop": ["e"]}).json()
    assert "e" not in out["text"]  # stop strings still apply
    assert gen(server, {"max_new_tokens": 2}).status_code == 200  # still serving


def test_openai_response_format(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="x")
    msgs = [{"role": "user", "content": "Describe a city as JSON."}]
    r = client.chat.completions.create(model="m", messages=msgs, max_tokens=200, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMAS[1]}})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[1])
    r = client.chat.completions.create(model="m", messages=msgs, max_tokens=60, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "length" or isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.chat.completions.create(model="m", messages=msgs, max_tokens=20, temperature=0, extra_body={"regex": REGEXES[0]})
    assert re.fullmatch(REGEXES[0], r.choices[0].message.content)
    r = client.completions.create(model="m", prompt="City:", max_tokens=12, temperature=0, extra_body={"ebnf": EBNF})
    assert re.fullmatch(EBNF_RE, r.choices[0].text)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=msgs, max_tokens=5, extra_body={"regex": "(("})


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["tz"], "additionalProperties": False}}}


# SmolLM2 does not reason, but under the qwen3 parser it may open "<think>" (plain characters here), after
# which a call waits for the reasoning to end: these requests turn thinking off, so the grammar holds from the start
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def test_tool_choice_required_and_named(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="x")
    msgs = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
    r = client.chat.completions.create(model="m", messages=msgs, tools=[WEATHER, TIME], tool_choice="required",
                                       max_tokens=120, temperature=0, parallel_tool_calls=False, extra_body=NO_THINKING)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    assert len(ch.message.tool_calls) == 1 and ch.message.tool_calls[0].id
    call = ch.message.tool_calls[0].function
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.arguments), schema)
    r = client.chat.completions.create(model="m", messages=msgs, tools=[WEATHER, TIME],
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       max_tokens=60, temperature=0, extra_body=NO_THINKING)
    call = r.choices[0].message.tool_calls[0].function
    assert call.name == "get_time" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.arguments), TIME["function"]["parameters"])
    # streaming: the name once, argument fragments that concatenate to valid JSON
    stream = client.chat.completions.create(model="m", messages=msgs, tools=[WEATHER], tool_choice="required",
                                            max_tokens=120, temperature=0, stream=True, parallel_tool_calls=False,
                                            extra_body=NO_THINKING)
    names, args, reasons = {}, {}, []
    for chunk in stream:
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            for tc in c.delta.tool_calls or []:
                if tc.function.name:
                    assert tc.index not in names and tc.id and tc.type == "function"  # id, type, name in the first delta
                    names[tc.index] = tc.function.name
                else:
                    assert tc.index in names  # arguments only after the name
                args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
    assert list(names.values()) == ["get_weather"] and reasons[-1] == "tool_calls"
    for k in names:
        jsonschema.validate(json.loads(args[k]), WEATHER["function"]["parameters"])
    # history with assistant tool_calls and a tool message reaches the template
    hist = msgs + [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.chat.completions.create(model="m", messages=hist, tools=[WEATHER], max_tokens=8, temperature=0)
    assert r.choices[0].message.content is not None
    bad = httpx.post(server + "/v1/chat/completions", json={"messages": msgs, "tool_choice": "required"})
    assert bad.status_code == 400
    bad = httpx.post(server + "/v1/chat/completions", json={"messages": msgs, "tools": [WEATHER],
                                                            "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert bad.status_code == 400


def test_native_parse_endpoints(server):
    text = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    r = httpx.post(server + "/parse_function_call", json={"text": text, "tool_call_parser": "qwen25", "tools": [WEATHER]}).json()
    assert r["normal_text"] == "Sure." and r["calls"][0]["name"] == "get_weather"
    assert json.loads(r["calls"][0]["parameters"]) == {"city": "Paris", "days": 2}
    r = httpx.post(server + "/separate_reasoning", json={"text": "<think>hmm</think>ok", "reasoning_parser": "qwen3"}).json()
    assert r == {"text": "ok", "reasoning_text": "hmm"}
    assert httpx.post(server + "/separate_reasoning", json={"text": "x", "reasoning_parser": "nope"}).status_code == 400


# ----------------------------------------------------------------------------- plugin proof (in-process)

class EchoToolParser:
    """A test-local format: CALL name {json}"""

    def __init__(self):
        self.buf, self.done = "", False

    def parse(self, text, tools):
        from core.interfaces import ToolCall
        m = re.search(r"CALL (\w+) (\{.*\})", text)
        return (text, []) if not m else (text[: m.start()], [ToolCall(m.group(1), m.group(2), 0)])

    def parse_streaming(self, delta, tools):
        self.buf += delta
        return "", []

    def flush(self, tools):
        return self.parse(self.buf, tools)


class BangReasoningParser:
    """Everything before '!' is reasoning."""

    def __init__(self):
        self.buf = ""

    def parse(self, text):
        head, sep, tail = text.partition("!")
        return (head, tail) if sep else ("", text)

    def parse_streaming(self, delta):
        self.buf += delta
        return "", ""

    def flush(self):
        return self.parse(self.buf)


def test_local_plugin_parsers_end_to_end():
    from core import hookimpl
    from core.cli import build_parser
    from core.engine import AsyncEngine
    from core.plugins import load_plugins
    from core.engine.config import engine_args_from_namespace
    from core.server.app import create_app
    from core.server.args import ServerArgs
    from core.server.openai.protocol import ChatCompletionRequest
    from core.server.openai.tools import ChoicePost, plan_tools
    from core.server.state import build_state

    mod = types.ModuleType("local_parsers")

    @hookimpl
    def register_tool_parsers(register):
        register("echo_calls", EchoToolParser)

    @hookimpl
    def register_reasoning_parsers(register):
        register("bang", BangReasoningParser)

    mod.register_tool_parsers, mod.register_reasoning_parsers = register_tool_parsers, register_reasoning_parsers
    pm = load_plugins(extra_modules=[("local_parsers", mod)])
    ns = build_parser().parse_args(["serve", "--tool-call-parser", "echo_calls", "--reasoning-parser", "bang",
                                    "--cpu-threads", "1", "--max-total-tokens", "4096", "--grammar-backend", "none"])

    async def main():
        engine = AsyncEngine(engine_args_from_namespace(ns), plugins=pm)
        app = create_app(build_state(engine, ServerArgs.from_namespace(ns)))
        state = app.state.core
        state.ready = True
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                r = (await c.post("/parse_function_call", json={"text": 'x CALL f {"a": 1}', "tool_call_parser": "echo_calls"})).json()
                assert r["calls"][0]["name"] == "f"
                r = (await c.post("/separate_reasoning", json={"text": "think!answer", "reasoning_parser": "bang"})).json()
                assert r == {"text": "answer", "reasoning_text": "think"}
                # end to end through chat: the post-processors see the model's text
                body = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 6, "temperature": 0,
                        "tools": [WEATHER]}
                full = (await c.post("/v1/chat/completions", json=body)).json()
                msg = full["choices"][0]["message"]
                text = (await c.post("/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 1}})).json()
                assert "content" in msg
                # a response with reasoning_content comes through the local reasoning parser
                req = msgspec.convert({"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]},
                                      ChatCompletionRequest)
                post = ChoicePost(plan_tools(state, req), req)
                reasoning, content, calls, reason = post.full('hmm!ok CALL get_weather {"city": "Paris"}', "stop")
                assert reasoning == "hmm" and content == "ok " and reason == "tool_calls"
                assert calls[0]["function"]["name"] == "get_weather"
                assert text is not None
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_grammar_that_rejects_the_sampled_token_ends_its_request():
    """Only a mask that left nothing allowed lets a rejected token through (a dead end of the
    grammar, or non-finite logits): the request is ended with a reason, never continued unconstrained."""
    from types import SimpleNamespace

    from core.engine.grammar import GrammarManager

    class DeadEnd:
        def is_terminated(self) -> bool:
            return False

        def accept_token(self, tok: int) -> bool:
            return False

    gm = GrammarManager(None, "none", None, 32, (0,))
    req = SimpleNamespace(grammar=DeadEnd(), finished=False, params=SimpleNamespace(max_new_tokens=4), rid="r",
                          aborted=False, abort_message="request aborted")
    free = SimpleNamespace(grammar=None, finished=False, params=SimpleNamespace(max_new_tokens=4), rid="f",
                           aborted=False, abort_message="request aborted")
    gm.accept([req, free], [7, 7])
    assert req.aborted and req.abort_message == "the grammar allows no further token"
    assert not free.aborted
    gm.shutdown()


def test_a_grammar_ending_on_eos_under_ignore_eos_reports_it_as_matched(tiny_llama):
    """SGLang reports a terminated grammar's last token as the match (the EOS here); under
    ignore_eos the finish said ``matched: None``, so meta_info and OpenAI's matched_stop were null."""
    from tests.conftest import make_engine

    e = make_engine(tiny_llama()[0])
    try:
        sp = {"max_new_tokens": 20, "temperature": 0, "regex": "ab(c|d)"}
        plain = e.generate(input_ids=[5, 40, 41, 42, 43], sampling_params=sp)
        ignored = e.generate(input_ids=[5, 40, 41, 42, 43], sampling_params={**sp, "ignore_eos": True})
    finally:
        e.shutdown()
    assert plain["output_ids"] == ignored["output_ids"] and plain["output_ids"][-1] == 2
    assert plain["meta_info"]["finish_reason"] == ignored["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    assert plain["text"] == ignored["text"]
