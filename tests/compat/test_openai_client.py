"""The official ``openai`` SDK against a live ``core serve`` (SmolLM2): chat (stream with
``stream_options.include_usage`` and not), completions, logprobs / top_logprobs (finite numbers,
also under a grammar constraint, streamed and not), a forced ``tool_choice``, ``response_format``
json_schema (and the SDK's ``parse`` / ``stream`` helpers with pydantic types), ``n`` > 1 and the
models list.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from tests.compat.conftest import CITY_Q, CITY_SCHEMA, MODEL, WEATHER_Q, WEATHER_TOOL, client, validate

pytestmark = pytest.mark.slow



def is_finite_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_chat_logprobs(items: list[Any], top: int) -> None:
    """OpenAI: every token has a ``logprob`` (a number <= 0) and up to ``top`` alternatives, each
    with a number too; a masked or impossible alternative must never come back as null/-inf."""
    assert items, "logprobs requested but none returned"
    for t in items:
        assert is_finite_number(t.logprob) and t.logprob <= 1e-6, t
        assert 1 <= len(t.top_logprobs) <= top, t
        for alt in t.top_logprobs:
            assert is_finite_number(alt.logprob) and alt.logprob <= 1e-6, (t.token, alt)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def oai(compat_server):
    openai = client("openai")
    return openai.OpenAI(base_url=compat_server + "/v1", api_key="none", max_retries=0, timeout=120)


# --------------------------------------------------------------------------- tests


def test_models_list(oai):
    ids = [m.id for m in oai.models.list()]
    assert MODEL in ids, ids
    assert oai.models.retrieve(MODEL).id == MODEL


def test_chat(oai):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                    max_tokens=8, temperature=0)
    ch = r.choices[0]
    assert r.object == "chat.completion" and r.model and r.id
    assert ch.index == 0 and ch.message.role == "assistant"
    assert isinstance(ch.message.content, str) and ch.message.content
    assert ch.finish_reason in ("stop", "length")
    u = r.usage
    assert 0 < u.completion_tokens <= 8 and u.prompt_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_chat_stream_include_usage(oai):
    chunks = list(oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    # OpenAI: with include_usage every chunk carries usage null except one extra last chunk, which
    # has the usage and an empty choices list
    *body, last = chunks
    assert last.choices == [] and last.usage is not None, last
    assert all(c.usage is None for c in body), [c.usage for c in body]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in body if c.choices)
    finish = [c.choices[0].finish_reason for c in body if c.choices and c.choices[0].finish_reason]
    assert text and finish in (["stop"], ["length"]), (text, finish)
    assert 0 < last.usage.completion_tokens <= 8
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens


def test_completions(oai):
    r = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert r.object == "text_completion"
    ch = r.choices[0]
    assert isinstance(ch.text, str) and ch.text and ch.finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= 5
    # a list of prompts: one choice per prompt, in order
    r = oai.completions.create(model=MODEL, prompt=["One, two,", "Red, green,"], max_tokens=3, temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1]
    # streamed: text deltas, one finish reason
    chunks = list(oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5,
                                         temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] in (["stop"], ["length"])


def _check_completion_logprobs(ch, n: int) -> None:
    lp = ch.logprobs
    assert lp is not None and lp.tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert "".join(lp.tokens).startswith(ch.text)  # (a stop token may be listed after the text)
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert is_finite_number(val) and val <= 1e-6, (tok, val)
        # "up to logprobs+1 elements": the sampled token may be added to the n most likely
        assert top and len(top) <= n + 1, (tok, top)
        assert all(is_finite_number(v) and v <= 1e-6 for v in top.values()), (tok, top)


def test_completions_logprobs(oai):
    r = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=2)
    _check_completion_logprobs(r.choices[0], 2)
    # under a grammar (SGLang's regex through extra_body) the masked alternatives stay numbers
    r = oai.completions.create(model=MODEL, prompt="A phone number:", max_tokens=10, temperature=0, logprobs=3,
                               extra_body={"regex": r"[0-9]{3}-[0-9]{4}"})
    _check_completion_logprobs(r.choices[0], 3)


def test_chat_logprobs(oai):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                    max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    check_chat_logprobs(content, 3)
    assert "".join(t.token for t in content).startswith(r.choices[0].message.content)


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
def test_chat_logprobs_under_json_schema(oai, stream):
    kw = dict(model=MODEL, messages=CITY_Q, max_tokens=60, temperature=0, logprobs=True, top_logprobs=5,
              response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}})
    if stream:
        items, text, finish = [], "", None
        for chunk in oai.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                text += c.delta.content or ""
                if c.logprobs is not None and c.logprobs.content:
                    items += c.logprobs.content
                finish = c.finish_reason or finish
    else:
        r = oai.chat.completions.create(**kw)
        items, text, finish = r.choices[0].logprobs.content, r.choices[0].message.content, r.choices[0].finish_reason
    check_chat_logprobs(items, 5)
    assert finish == "stop", text
    validate(json.loads(text), CITY_SCHEMA)


def test_response_format_json_schema(oai):
    r = oai.chat.completions.create(model=MODEL, messages=CITY_Q, max_tokens=60, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    validate(json.loads(r.choices[0].message.content), CITY_SCHEMA)


def test_parse_and_stream_helpers_with_pydantic(oai):
    """The SDK's ``parse`` / ``stream`` helpers turn a pydantic type into a strict json_schema
    ``response_format`` and parse the reply back into it."""
    pydantic = client("pydantic")
    from typing import Literal

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        country: Literal["France", "Japan", "Peru"]

    r = oai.chat.completions.parse(model=MODEL, messages=CITY_Q, max_tokens=60, temperature=0, response_format=City)
    assert isinstance(r.choices[0].message.parsed, City), r.choices[0].message.content
    with oai.chat.completions.stream(model=MODEL, messages=CITY_Q, max_tokens=60, temperature=0,
                                     response_format=City) as s:
        deltas = [e.delta for e in s if e.type == "content.delta"]
        final = s.get_final_completion()
    assert deltas and isinstance(final.choices[0].message.parsed, City)


def test_forced_tool_choice(oai):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice, extra in ((named, {}), ("required", {"parallel_tool_calls": False})):
        r = oai.chat.completions.create(model=MODEL, messages=WEATHER_Q, tools=[WEATHER_TOOL], tool_choice=tool_choice,
                                        max_tokens=100, temperature=0, **extra)
        ch = r.choices[0]
        # OpenAI reports "stop" for a named function, "tool_calls" otherwise; SGLang/vLLM "tool_calls"
        assert ch.finish_reason in ("tool_calls", "stop"), (tool_choice, ch)
        assert not (ch.message.content or "").strip(), ch.message.content
        assert len(ch.message.tool_calls) == 1, ch.message.tool_calls
        call = ch.message.tool_calls[0]
        assert call.id and call.type == "function" and call.function.name == "get_weather"
        validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
    # streamed: id, type and name in the first delta of the call, then argument fragments
    names, args, content, finish = {}, {}, "", None
    for chunk in oai.chat.completions.create(model=MODEL, messages=WEATHER_Q, tools=[WEATHER_TOOL], tool_choice=named,
                                             max_tokens=100, temperature=0, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for tc in c.delta.tool_calls or []:
                if tc.index not in names:
                    assert tc.id and tc.type == "function" and tc.function.name, tc
                    names[tc.index] = tc.function.name
                args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
    assert names == {0: "get_weather"} and finish in ("tool_calls", "stop"), (names, finish)
    assert not content.strip(), content
    validate(json.loads(args[0]), WEATHER_TOOL["function"]["parameters"])


def test_parse_with_pydantic_function_tool(oai):
    openai, pydantic = client("openai"), client("pydantic")

    class GetWeather(pydantic.BaseModel):
        """Get the current weather of a city"""
        city: str = pydantic.Field(max_length=20)

    r = oai.chat.completions.parse(model=MODEL, messages=WEATHER_Q, tools=[openai.pydantic_function_tool(GetWeather)],
                                   tool_choice={"type": "function", "function": {"name": "GetWeather"}},
                                   max_tokens=100, temperature=0)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "GetWeather" and isinstance(call.function.parsed_arguments, GetWeather), call


def test_n_choices(oai):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me a word."}],
                                    max_tokens=6, temperature=0.8, seed=1, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(isinstance(c.message.content, str) and c.message.content for c in r.choices)
    assert r.usage.completion_tokens <= 12
    r = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0.8, seed=1, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1]
