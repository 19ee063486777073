"""LiteLLM against a live ``core serve``, through its ``openai/`` and ``hosted_vllm/`` providers
(``litellm.completion(model="<provider>/<name>", api_base=<base>/v1, api_key="none")``): chat,
stream, a forced tool call, a tool call cut off by ``max_tokens`` (a tool call with
finish_reason "length", streamed and not, never raw ``<tool_call>`` text in the content) and
parallel calls (the whitespace between them is never streamed as content)."""

from __future__ import annotations

import json
import os

import pytest

from tests.compat.conftest import MODEL, WEATHER_Q, WEATHER_TOOL, client, validate

pytestmark = pytest.mark.slow

# LiteLLM downloads its model cost map from GitHub at import unless told to use the bundled copy
# (set before any test imports it: collection runs first)
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

PROVIDERS = ["openai", "hosted_vllm"]
TWO_CITIES = [{"role": "user", "content": "What is the weather in Paris and in Tokyo?"}]


@pytest.fixture(scope="module")
def litellm():
    mod = client("litellm")
    mod.telemetry = False
    return mod


@pytest.fixture(scope="module")
def complete(litellm, compat_server):
    def call(provider: str, **kw):
        if provider not in litellm.provider_list:
            pytest.skip(f"this litellm has no {provider}/ provider")
        return litellm.completion(model=f"{provider}/{MODEL}", api_base=compat_server + "/v1", api_key="none",
                                  temperature=0, num_retries=0, timeout=120, **kw)
    return call


def _collect(stream) -> tuple[list[tuple[int, str]], dict[int, dict], str | None]:
    """Content deltas as (chunk position, text); tool calls by index as {name, arguments, first
    chunk position}; the finish reason."""
    contents, calls, finish = [], {}, None
    for pos, chunk in enumerate(stream):
        for c in chunk.choices:
            if c.delta.content:
                contents.append((pos, c.delta.content))
            for tc in c.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"name": None, "arguments": "", "pos": pos})
                call["name"] = call["name"] or tc.function.name
                call["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return contents, calls, finish


@pytest.mark.parametrize("provider", PROVIDERS)
def test_chat(complete, provider):
    r = complete(provider, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8)
    ch = r.choices[0]
    assert isinstance(ch.message.content, str) and ch.message.content
    assert ch.finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


@pytest.mark.parametrize("provider", PROVIDERS)
def test_stream(complete, provider):
    chunks = list(complete(provider, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, stream=True,
                           stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text and finish and finish[-1] in ("stop", "length"), (text, finish)
    usage = [getattr(c, "usage", None) for c in chunks if getattr(c, "usage", None)]
    assert usage and 0 < usage[-1].completion_tokens <= 8


@pytest.mark.parametrize("provider", PROVIDERS)
def test_forced_tool_call(complete, provider):
    r = complete(provider, messages=WEATHER_Q, tools=[WEATHER_TOOL], max_tokens=100,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    ch = r.choices[0]
    assert ch.finish_reason in ("tool_calls", "stop"), ch
    assert not (ch.message.content or "").strip(), ch.message.content
    (call,) = ch.message.tool_calls
    assert call.id and call.function.name == "get_weather"
    validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_tool_call_cut_by_max_tokens(complete, provider, stream):
    """A call whose arguments are cut by max_tokens is still a tool call (finish_reason "length"),
    with the arguments generated so far; its ``<tool_call>`` markup is never content."""
    kw = dict(messages=WEATHER_Q, tools=[WEATHER_TOOL], tool_choice="required", parallel_tool_calls=False,
              max_tokens=36)  # past the name, inside the arguments
    if stream:
        contents, streamed, finish = _collect(complete(provider, stream=True, **kw))
        content = "".join(t for _, t in contents)
        calls = [(c["name"], c["arguments"]) for _, c in sorted(streamed.items())]
    else:
        ch = complete(provider, **kw).choices[0]
        content, finish = ch.message.content or "", ch.finish_reason
        calls = [(tc.function.name, tc.function.arguments) for tc in ch.message.tool_calls or []]
    assert "<tool" not in content and not content.strip(), content
    assert finish == "length"
    assert [name for name, _ in calls] == ["get_weather"], calls
    assert calls[0][1].startswith("{"), calls


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
def test_parallel_tool_calls(complete, stream):
    """Several calls in one reply: all of them tool calls (the last may be cut by max_tokens),
    and the whitespace the model writes between them is never streamed as content."""
    kw = dict(messages=TWO_CITIES, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=100)
    if stream:
        contents, streamed, finish = _collect(complete("openai", stream=True, **kw))
        assert len(streamed) >= 2, (streamed, contents)
        first_call = min(c["pos"] for c in streamed.values())
        after = [t for p, t in contents if p >= first_call]
        assert not after, f"content streamed between/after the tool calls: {after!r}"
        assert "<tool" not in "".join(t for _, t in contents)
        calls = [(c["name"], c["arguments"]) for _, c in sorted(streamed.items())]
    else:
        ch = complete("openai", **kw).choices[0]
        finish = ch.finish_reason
        assert not (ch.message.content or "").strip(), ch.message.content
        calls = [(tc.function.name, tc.function.arguments) for tc in ch.message.tool_calls or []]
        assert len(calls) >= 2, (ch.message.content, calls)
    assert finish in ("tool_calls", "length")
    complete_calls = calls if finish == "tool_calls" else calls[:-1]
    for name, arguments in complete_calls:
        assert name == "get_weather"
        validate(json.loads(arguments), WEATHER_TOOL["function"]["parameters"])
