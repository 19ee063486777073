"""A tool call is one truth: cut off by max_tokens it is a call (its arguments as far as they were
written, ``finish_reason: "length"``), streamed and whole, never also text; whitespace before,
between and after calls is not content; non-whitespace text stays content.

Checked on every built-in parser through the chat post-processor (each format cut at every
character, streamed in pieces against the whole reply), then end to end on the real app over a
tiny model whose output an ``ebnf`` constraint dictates (``--tool-call-parser qwen25``): chat
completions streamed and not, and ``/v1/responses``."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from core.plugins import load_plugins
from core.server.openai.tools import ChoicePost, ToolPlan
from core.testing import TOOL_FORMATS

PM = load_plugins()
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("get_weather", "get_time")]
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC", "n": 2})]
PREFIX = "Let me check. \n"  # text, then whitespace before the first call
NO_PREFIX = {"json_array"}  # its array must open the output


def _post(parser: str | None = None, named: str | None = None) -> ChoicePost:
    if named:
        return ChoicePost(ToolPlan("named", named, named_args=True), SimpleNamespace(tools=TOOLS))
    return ChoicePost(ToolPlan("auto", tool_parser=PM.resolve("tool_parser", parser)), SimpleNamespace(tools=TOOLS))


def _whole(post: ChoicePost, text: str, reason: str) -> tuple[str | None, list[tuple[str, str]], str | None]:
    _, content, calls, reason = post.full(text, reason)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls or []], reason


def _streamed(post: ChoicePost, text: str, step: int = 1) -> tuple[list[str], list[tuple[str, str]]]:
    """Content deltas and calls (name, joined arguments) of ``text`` streamed ``step`` characters at a time."""
    pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        _, delta, deltas = post.delta(piece, last)
        if delta:
            content.append(delta)
        for d in deltas:
            if d.get("id"):
                assert d["index"] not in calls, "a call announced twice"
                calls[d["index"]] = [d["function"]["name"], ""]
            calls[d["index"]][1] += d["function"]["arguments"]
    return content, [(n, a) for _, (n, a) in sorted(calls.items())]


def _text(parser: str) -> str:
    return ("" if parser in NO_PREFIX else PREFIX) + TOOL_FORMATS[parser](CALLS)


# ----------------------------------------------------------------------------- every built-in parser


@pytest.mark.parametrize("parser", sorted(TOOL_FORMATS))
def test_a_cut_call_streams_as_it_reads_whole(parser: str) -> None:
    """Cut at every character: the whole reply and the stream agree on content and calls, and
    each call is the complete call's name with a prefix of its arguments."""
    text = _text(parser)
    _, done, _ = _whole(_post(parser), text, "stop")
    assert [n for n, _ in done] == [n for n, _ in CALLS]
    for k in range(1, len(text) + 1):
        content, calls, reason = _whole(_post(parser), text[:k], "length")
        assert reason == "length"
        streamed, streamed_calls = _streamed(_post(parser), text[:k], step=5)
        assert ("".join(streamed) or None, streamed_calls) == (content, calls), (parser, text[:k])
        for (name, args), (want_name, want_args) in zip(calls, done):
            # a parameter format may close the object of the parameters written so far (glm45)
            assert name == want_name and want_args.startswith(args.removesuffix("}")), (parser, text[:k])


@pytest.mark.parametrize("parser", sorted(TOOL_FORMATS))
def test_whitespace_around_calls_is_not_content(parser: str) -> None:
    """Whitespace before, between (one block per call) and after the calls is neither in the
    whole reply's content nor sent as a content delta."""
    fmt = TOOL_FORMATS[parser]
    blocks = fmt(CALLS) if parser == "json_array" else fmt(CALLS[:1]) + "\n \n" + fmt(CALLS[1:])  # one array only
    text = ("\n" if parser in NO_PREFIX else PREFIX) + blocks + " \n"
    content, calls, reason = _whole(_post(parser), text, "stop")
    want = None if parser in NO_PREFIX else "Let me check."
    assert (content, [n for n, _ in calls], reason) == (want, [n for n, _ in CALLS], "tool_calls")
    streamed, streamed_calls = _streamed(_post(parser), text)
    assert ("".join(streamed) or None, streamed_calls) == (content, calls)
    assert all(d.strip() for d in streamed)  # no whitespace-only delta


def test_a_qwen25_call_cut_in_its_arguments() -> None:
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    want = ("Sure.", [("get_weather", '{"city": "Par')], "length")
    assert _whole(_post("qwen25"), text, "length") == want
    assert _streamed(_post("qwen25"), text) == (list("Sure."), want[1])
    # stopped there (a stop string, say): the same call, the finish reason of a call
    assert _whole(_post("qwen25"), text, "stop") == ("Sure.", want[1], "tool_calls")
    # no name yet: nothing was announced, the text stays text
    assert _whole(_post("qwen25"), "Sure. <tool_call>\n{", "length") == ("Sure. <tool_call>\n{", [], "length")
    # text that only looks like a call's beginning, and plain text, keep their whitespace
    assert _whole(_post("qwen25"), "2 < 3 \n", "length") == ("2 < 3 \n", [], "length")
    assert "".join(_streamed(_post("qwen25"), " a  b \n")[0]) == " a  b \n"


def test_named_tool_choice_cut_off() -> None:
    """A named tool_choice under SGLang's JSON-schema constraint: the whole output is the arguments."""
    assert _whole(_post(named="get_time"), ' {"tz": "UT', "length") == (None, [("get_time", '{"tz": "UT')], "length")
    assert _streamed(_post(named="get_time"), ' {"tz": "UT') == ([], [("get_time", '{"tz": "UT')])
    assert _whole(_post(named="get_time"), '{"tz": "UTC"}', "stop") == (None, [("get_time", '{"tz": "UTC"}')], "tool_calls")


# ----------------------------------------------------------------------------- end to end: the app over a tiny model

NOTE = "la " * 90  # long enough that max_tokens below cuts inside it (a token is one or two characters)
CUT_ARGS = json.dumps({"city": "Paris", "note": NOTE})
CALL_CUT = '<tool_call>\n{"name": "get_weather", "arguments": ' + CUT_ARGS + "}\n</tool_call>"
CALL_W = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_T = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'


@pytest.fixture(scope="module")
def served(tiny_llama):
    from tests.test_robustness_limits import Served

    s = Served(tiny_llama()[0], "--tool-call-parser", "qwen25")
    yield s
    s.close()


def _chat(output: str, **body: Any) -> dict:
    """A chat request whose output an ebnf constraint dictates (greedy on the tiny model)."""
    return {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "temperature": 0,
            "ebnf": "root ::= " + json.dumps(output), **body}


def _sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def _chat_both(served: Any, output: str, **body: Any) -> tuple[dict, tuple[list[str], list[tuple[str, str]], str]]:
    """The whole reply's choice, and the stream's (content deltas, calls, finish_reason)."""
    whole = served.post("/v1/chat/completions", json=_chat(output, **body))
    assert whole.status_code == 200, whole.text
    resp = served.post("/v1/chat/completions", json=_chat(output, stream=True, **body))
    assert resp.status_code == 200, resp.text
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in _sse(resp.text):
        for choice in chunk["choices"]:
            delta, finish = choice["delta"], choice["finish_reason"] or finish
            if delta.get("content"):
                content.append(delta["content"])
            for d in delta.get("tool_calls") or []:
                if d.get("id"):
                    calls[d["index"]] = [d["function"]["name"], ""]
                calls[d["index"]][1] += d["function"]["arguments"]
    return whole.json()["choices"][0], (content, [(n, a) for _, (n, a) in sorted(calls.items())], finish)


def _calls(choice: dict) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"].get("tool_calls") or []]


def test_chat_a_call_cut_off_by_max_tokens(served) -> None:
    """Cut inside its arguments: a call in the stream and in the whole reply alike, finish_reason
    "length", and its text is nowhere in the content."""
    choice, (content, calls, finish) = _chat_both(served, "Checking.\n" + CALL_CUT, max_tokens=100)
    assert choice["finish_reason"] == finish == "length"
    assert choice["message"]["content"] == "".join(content) == "Checking."
    ((name, args),) = _calls(choice)
    assert name == "get_weather" and args.startswith('{"city": "Paris", "note": "la') and CUT_ARGS.startswith(args)
    assert args != CUT_ARGS and calls == [(name, args)]


def test_chat_parallel_calls_and_the_whitespace_around_them(served) -> None:
    """Two complete calls: "tool_calls"; the whitespace before, between and after them is no content."""
    choice, (content, calls, finish) = _chat_both(served, "Sure. \n" + CALL_W + "\n\n" + CALL_T + "\n")
    want = [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "UTC"}')]
    assert choice["finish_reason"] == finish == "tool_calls" and _calls(choice) == calls == want
    assert choice["message"]["content"] == "".join(content) == "Sure." and all(d.strip() for d in content)
    choice, (content, calls, finish) = _chat_both(served, "\n\n" + CALL_W + "\n")  # only whitespace besides the call
    assert choice["message"]["content"] is None and content == [] and calls == _calls(choice) == want[:1]
    assert choice["finish_reason"] == finish == "tool_calls"


def test_responses_a_call_cut_off_is_an_incomplete_function_call(served) -> None:
    """/v1/responses reads calls through the same post-processor: the cut call is an incomplete
    function_call whole and streamed, with no message beside it."""
    enum = {"type": "string", "enum": ["Paris, " + NOTE]}
    tools = [{"type": "function", "name": "get_weather",
              "parameters": {"type": "object", "properties": {"city": enum}, "required": ["city"]}}]
    body = {"input": "hi", "tools": tools, "tool_choice": "required", "parallel_tool_calls": False,
            "max_output_tokens": 80, "temperature": 0}
    whole = served.post("/v1/responses", json=body).json()
    assert whole["status"] == "incomplete"
    assert [(o["type"], o["status"], o.get("name")) for o in whole["output"]] == [("function_call", "incomplete", "get_weather")]
    args = whole["output"][0]["arguments"]
    assert args.startswith("{") and not args.endswith("}")
    events = [json.loads(line[6:]) for line in served.post("/v1/responses", json={**body, "stream": True}).text.splitlines()
              if line.startswith("data: ")]
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete"
    assert [(o["type"], o["status"], o["arguments"]) for o in final["output"]] == [("function_call", "incomplete", args)]
    assert "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta") == args
