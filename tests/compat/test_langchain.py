"""langchain-openai's ``ChatOpenAI(base_url=..., api_key="none")`` against a live ``core serve``:
invoke, stream, batch, ``bind_tools`` with a forced tool call, and ``with_structured_output`` with
each of its methods (function_calling, json_mode, json_schema)."""

from __future__ import annotations

import pytest

from tests.compat.conftest import MODEL, client

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lc():
    return client("langchain_openai")


@pytest.fixture(scope="module")
def chat(lc, compat_server):
    def make(**kw):
        return lc.ChatOpenAI(base_url=compat_server + "/v1", api_key="none", model=MODEL, temperature=0,
                             max_retries=0, timeout=120, **{"max_tokens": 8, **kw})
    return make


def test_invoke(chat):
    msg = chat().invoke("Say hello.")
    assert type(msg).__name__ == "AIMessage"
    assert isinstance(msg.content, str) and msg.content
    assert msg.response_metadata["finish_reason"] in ("stop", "length")
    assert msg.usage_metadata and 0 < msg.usage_metadata["output_tokens"] <= 8
    assert msg.usage_metadata["total_tokens"] == msg.usage_metadata["input_tokens"] + msg.usage_metadata["output_tokens"]


def test_stream(chat):
    chunks = list(chat(stream_usage=True).stream("Say hello."))
    assert chunks and all(type(c).__name__ == "AIMessageChunk" for c in chunks)
    full = chunks[0]
    for c in chunks[1:]:
        full += c
    assert isinstance(full.content, str) and full.content
    assert full.response_metadata.get("finish_reason") in ("stop", "length")
    assert full.usage_metadata and 0 < full.usage_metadata["output_tokens"] <= 8


def test_batch(chat):
    out = chat().batch(["Say hello.", "Name a color."])
    assert len(out) == 2 and all(isinstance(m.content, str) and m.content for m in out)


def test_bind_tools_forced_call(chat):
    pydantic = client("pydantic")

    class get_weather(pydantic.BaseModel):  # noqa: N801 - the tool's name
        """Get the current weather of a city."""
        city: str = pydantic.Field(max_length=20)

    llm = chat(max_tokens=100).bind_tools([get_weather], tool_choice="get_weather")
    msg = llm.invoke("What is the weather in Paris?")
    assert not msg.invalid_tool_calls, msg.invalid_tool_calls
    assert len(msg.tool_calls) == 1, msg
    call = msg.tool_calls[0]
    assert call["name"] == "get_weather" and call["id"]
    get_weather.model_validate(call["args"])
    # streamed: the chunks add up to the same kind of call
    full = None
    for c in llm.stream("What is the weather in Paris?"):
        full = c if full is None else full + c
    assert [tc["name"] for tc in full.tool_calls] == ["get_weather"], full
    get_weather.model_validate(full.tool_calls[0]["args"])


@pytest.mark.parametrize("method", ["function_calling", "json_mode", "json_schema"])
def test_with_structured_output(chat, City, method):
    # json_mode sends only response_format json_object: the prompt has to name the keys
    prompt = 'Reply with JSON like {"name": "...", "country": "..."}: name a city in France.'
    llm = chat(max_tokens=100).with_structured_output(City, method=method, include_raw=True)
    out = llm.invoke(prompt)
    assert out["parsing_error"] is None, out
    assert isinstance(out["parsed"], City), out
