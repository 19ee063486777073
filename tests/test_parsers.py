"""Tool-call and reasoning parsers on recorded outputs; streaming split at every character must agree."""

from __future__ import annotations

import json

import pytest

from core.plugins import load_plugins

PM = load_plugins()
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("get_weather", "get_time")]


def stream_tool(name: str, text: str, cut: list[int]):
    p = PM.resolve("tool_parser", name)()
    normal, calls = "", {}
    pieces = [text[a:b] for a, b in zip([0, *cut], [*cut, len(text)])]
    for piece in pieces:
        t, cs = p.parse_streaming(piece, TOOLS)
        normal += t
        for c in cs:
            entry = calls.setdefault(c.index, ["", ""])
            if c.name:
                assert not entry[0], "name sent twice"
                entry[0] = c.name
            entry[1] += c.arguments
    t, cs = p.flush(TOOLS)
    normal += t
    for c in cs:
        entry = calls.setdefault(c.index, ["", ""])
        entry[0] = entry[0] or c.name
        entry[1] += c.arguments
    return normal, [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())]


W = ("get_weather", {"city": "Paris"})
T = ("get_time", {"tz": "UTC", "n": 2})

TOOL_CASES = [
    ("qwen25", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "", [W]),
    ("qwen25", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC", "n": 2}}\n</tool_call>', "Let me check.\n\n", [W, T]),
    ("qwen25", '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>', []),
    ("qwen25", "No tools needed: 2 < 3.", "No tools needed: 2 < 3.", []),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [W]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"tz": "UTC", "n": 2}}', "", [W, T]),
    ("llama3", 'Sure. <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', "Sure. ", [W]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": ', '{"name": "get_weather", "parameters": {"city": ', []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {"tz": "UTC", "n": 2}}]', "", [W, T]),
    ("mistral", 'Checking. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', "Checking. ", [W]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [W]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city" "Paris"}}]', '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city" "Paris"}}]', []),
    ("deepseekv3", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>'
                   '\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{"tz": "UTC", "n": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "\n", [W, T]),
    ("deepseekv3", 'Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Sure.", [W]),
    ("pythonic", '[get_weather(city="Paris"), get_time(tz="UTC", n=2)]', "", [W, T]),
    ("pythonic", 'Calling now: [get_weather(city="Paris")]', "Calling now: ", [W]),
    ("pythonic", "A list [1, 2] is not a call.", "A list [1, 2] is not a call.", []),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>", "", [W]),
    ("qwen3_coder", "I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n"
                    "<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n<parameter=n>\n2\n</parameter>\n</function>\n</tool_call>",
     "I'll check.\n\n", [W, T]),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|>"
                "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{\"tz\": \"UTC\", \"n\": 2}<|tool_call_end|><|tool_calls_section_end|>", "", [W, T]),
    ("glm45", "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>", "Checking.\n", [W]),
    ("gpt-oss", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>', "", [W]),
]


@pytest.mark.parametrize("name,text,normal,calls", TOOL_CASES)
def test_tool_parser(name, text, normal, calls):
    p = PM.resolve("tool_parser", name)()
    got_normal, got = p.parse(text, TOOLS)
    assert got_normal == normal
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert [c.index for c in got] == list(range(len(calls)))
    # streaming: whole, every single split point, and character by character
    for cut in [[], *([k] for k in range(1, len(text))), list(range(1, len(text)))]:
        assert stream_tool(name, text, cut) == (normal, calls), cut


def test_undefined_tool_dropped():
    p = PM.resolve("tool_parser", "qwen25")()
    _, calls = p.parse('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', TOOLS)
    assert calls == []


REASONING_CASES = [
    ("deepseek-r1", "<think>Let me think. 2+2=4.</think>\n\nThe answer is 4.", "Let me think. 2+2=4.", "The answer is 4."),
    ("deepseek-r1", "Let me think. 2+2=4.</think>The answer is 4.", "Let me think. 2+2=4.", "The answer is 4."),
    ("deepseek-r1", "Still thinking about <b> tags and </thin", "Still thinking about <b> tags and </thin", ""),
    ("qwen3", "<think>\nHmm.\n</think>\n\nHello!", "\nHmm.\n", "Hello!"),
    ("qwen3", "Hello, no thinking here.", "", "Hello, no thinking here."),
    ("qwen3", "<think>never closes", "never closes", ""),
    ("qwen3-thinking", "I should greet.\n</think>\n\nHi there.", "I should greet.\n", "Hi there."),
    ("qwen3-thinking", "unfinished reasoning <", "unfinished reasoning <", ""),
    ("kimi", "◁think▷Short thought.◁/think▷Answer.", "Short thought.", "Answer."),
    ("gpt-oss", "<|channel|>analysis<|message|>User asks time.<|end|><|start|>assistant<|channel|>final<|message|>It is noon.<|return|>",
     "User asks time.", "It is noon."),
]


@pytest.mark.parametrize("name,text,reasoning,content", REASONING_CASES)
def test_reasoning_parser(name, text, reasoning, content):
    assert PM.resolve("reasoning_parser", name)().parse(text) == (reasoning, content)
    for cut in [*([k] for k in range(1, len(text))), list(range(1, len(text)))]:
        p = PM.resolve("reasoning_parser", name)()
        r = c = ""
        for a, b in zip([0, *cut], [*cut, len(text)]):
            dr, dc = p.parse_streaming(text[a:b])
            r, c = r + dr, c + dc
        dr, dc = p.flush()
        assert (r + dr, c + dc) == (reasoning, content), cut
