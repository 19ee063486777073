"""``/v1/responses`` with a reasoning parser: ``output_text`` logprobs are the answer's own tokens,
streamed as whole. The output is forced (a regex) to reasoning, its closing tag, whitespace the
parser drops, then the answer; streamed at several ``--stream-interval`` values, a step may hold
the end of the reasoning and the start of the answer together, or the whole output."""

from __future__ import annotations

import json

import attrs
import pytest

from tests.test_robustness_limits import Served

OUTPUT = "<think>ab cd</think>\n\nHello world"
BODY = {"input": "hi", "max_output_tokens": 60, "temperature": 0, "include": ["message.output_text.logprobs"]}


@pytest.fixture(scope="module")
def served(tiny_llama):
    s = Served(tiny_llama()[0], "--reasoning-parser", "qwen3")
    yield s
    s.close()


@pytest.fixture
def forced(monkeypatch):
    """The Responses API has no regex field: its chat request gets one, which (the gate that holds a
    grammar back until the reasoning ends turned off) holds the whole output, reasoning included."""
    import core.server.openai.chat as chat
    import core.server.openai.responses as responses

    monkeypatch.setattr(chat, "reasoning_gate", lambda tags: None)

    made = responses.chat_request

    def with_regex(*a, **k):
        chat = made(*a, **k)
        chat.regex = OUTPUT
        return chat
    monkeypatch.setattr(responses, "chat_request", with_regex)


def _message(response: dict) -> dict:
    (item,) = [i for i in response["output"] if i["type"] == "message"]
    return item["content"][0]


@pytest.mark.parametrize("interval", [1, 3, 100])
def test_streamed_output_text_logprobs_are_the_whole_answers(served, forced, interval):
    whole = _message(served.post("/v1/responses", json=BODY).json())
    assert whole["text"] == "Hello world"
    tokens = [e["token"] for e in whole["logprobs"]]
    assert "".join(tokens).startswith("Hello world") and len("".join(tokens[:-1])) <= len("Hello world")
    old = served.state.args
    served.state.args = attrs.evolve(old, stream_interval=interval)
    try:
        text = served.post("/v1/responses", json={**BODY, "stream": True}).text
    finally:
        served.state.args = old
    events = [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(e["delta"] for e in deltas) == "Hello world"
    assert [x for e in deltas for x in e["logprobs"]] == whole["logprobs"]  # (the reasoning's and the tag's dropped)
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    assert done["logprobs"] == whole["logprobs"]
    assert _message(events[-1]["response"])["logprobs"] == whole["logprobs"]
