"""Recorded outputs and call formats for the built-in parsers, keyed by their registered names.

A third-party parser brings its own (the ``tool_parser_samples`` / ``tool_parser_format``
fixtures, or the ``samples`` / ``format_calls`` arguments of :func:`core.testing.check_plugin`).
"""

from __future__ import annotations

import json
from typing import Any, Callable

import attrs

Call = tuple[str, dict]


@attrs.define(frozen=True)
class ToolSample:
    """A complete model output, the normal text ``parse`` returns and the calls it finds
    (name, decoded arguments). ``malformed``: the text holds a call block that does not
    parse, so ``parse`` finds no call; a stream may already have announced it (an announced
    call cannot be withdrawn), so only the streamed normal text must agree."""

    text: str
    normal: str
    calls: tuple[Call, ...] = ()
    malformed: bool = False


@attrs.define(frozen=True)
class ReasoningSample:
    """A complete output and the (reasoning, content) that ``parse`` returns."""

    text: str
    reasoning: str
    content: str


TOOLS: list[dict] = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
                     for n in ("get_weather", "get_time")]

W = ("get_weather", {"city": "Paris"})
T = ("get_time", {"tz": "UTC", "n": 2})
_DS = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```"
       "<｜tool▁call▁end｜>")

TOOL_SAMPLES: dict[str, list[ToolSample]] = {
    "qwen25": [
        ToolSample('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "", (W,)),
        ToolSample('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                   '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC", "n": 2}}\n</tool_call>', "Let me check.\n\n", (W, T)),
        ToolSample('<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>',
                   '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>', (), malformed=True),
        ToolSample("No tools needed: 2 < 3.", "No tools needed: 2 < 3."),
    ],
    "llama3": [
        ToolSample('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", (W,)),
        ToolSample('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                   '{"name": "get_time", "parameters": {"tz": "UTC", "n": 2}}', "", (W, T)),
        ToolSample('Sure. <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', "Sure. ", (W,)),
        ToolSample('{"name": "get_weather", "parameters": {"city": ', '{"name": "get_weather", "parameters": {"city": ', (),
                   malformed=True),
    ],
    "mistral": [
        ToolSample('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                   '{"name": "get_time", "arguments": {"tz": "UTC", "n": 2}}]', "", (W, T)),
        ToolSample('Checking. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', "Checking. ", (W,)),
        ToolSample('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", (W,)),
        ToolSample('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city" "Paris"}}]',
                   '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city" "Paris"}}]', (), malformed=True),
    ],
    "deepseekv3": [
        ToolSample(_DS + '\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{"tz": "UTC", "n": 2}\n```'
                   "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "\n", (W, T)),
        ToolSample("Sure." + _DS + "<｜tool▁calls▁end｜>", "Sure.", (W,)),
    ],
    "pythonic": [
        ToolSample('[get_weather(city="Paris"), get_time(tz="UTC", n=2)]', "", (W, T)),
        ToolSample('Calling now: [get_weather(city="Paris")]', "Calling now: ", (W,)),
        ToolSample("A list [1, 2] is not a call.", "A list [1, 2] is not a call."),
    ],
    "qwen3_coder": [
        ToolSample("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>", "", (W,)),
        ToolSample("I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                   "</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n<parameter=n>\n2\n"
                   "</parameter>\n</function>\n</tool_call>", "I'll check.\n\n", (W, T)),
    ],
    "kimi_k2": [
        ToolSample("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                   '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>'
                   '{"tz": "UTC", "n": 2}<|tool_call_end|><|tool_calls_section_end|>', "", (W, T)),
    ],
    "glm45": [
        ToolSample("Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
                   "Checking.\n", (W,)),
    ],
    "json_array": [
        ToolSample('[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
                   '{"name": "get_time", "parameters": {"tz": "UTC", "n": 2}}]', "", (W, T)),
        ToolSample('\n[{"name": "get_weather", "parameters": {"city": "Paris"}}]', "\n", (W,)),
        ToolSample("Not an array: [1, 2]", "Not an array: [1, 2]"),
        ToolSample('[{"name": "get_weather", "parameters": {"city" "Paris"}}]',
                   '[{"name": "get_weather", "parameters": {"city" "Paris"}}]', (), malformed=True),
    ],
    "gpt-oss": [
        ToolSample('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
                   "", (W,)),
    ],
}

REASONING_SAMPLES: dict[str, list[ReasoningSample]] = {
    "deepseek-r1": [
        ReasoningSample("<think>Let me think. 2+2=4.</think>\n\nThe answer is 4.", "Let me think. 2+2=4.", "The answer is 4."),
        ReasoningSample("Let me think. 2+2=4.</think>The answer is 4.", "Let me think. 2+2=4.", "The answer is 4."),
        ReasoningSample("Still thinking about <b> tags and </thin", "Still thinking about <b> tags and </thin", ""),
    ],
    "qwen3": [
        ReasoningSample("<think>\nHmm.\n</think>\n\nHello!", "\nHmm.\n", "Hello!"),
        ReasoningSample("Hello, no thinking here.", "", "Hello, no thinking here."),
        ReasoningSample("<think>never closes", "never closes", ""),
    ],
    "qwen3-thinking": [
        ReasoningSample("I should greet.\n</think>\n\nHi there.", "I should greet.\n", "Hi there."),
        ReasoningSample("unfinished reasoning <", "unfinished reasoning <", ""),
    ],
    "kimi": [ReasoningSample("◁think▷Short thought.◁/think▷Answer.", "Short thought.", "Answer.")],
    "gpt-oss": [
        ReasoningSample("<|channel|>analysis<|message|>User asks time.<|end|><|start|>assistant<|channel|>final"
                        "<|message|>It is noon.<|return|>", "User asks time.", "It is noon."),
    ],
}

# --------------------------------------------------------------------------- call formats


def _json(args: dict) -> str:
    return json.dumps(args, ensure_ascii=False)


def _xml_value(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


def _py(v: Any) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_py(k)}: {_py(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(map(_py, v)) + "]"
    return repr(v)  # str, int, float, bool, None: Python literals


TOOL_FORMATS: dict[str, Callable[[list[Call]], str]] = {
    "qwen25": lambda calls: "\n".join(
        f'<tool_call>\n{_json({"name": n, "arguments": a})}\n</tool_call>' for n, a in calls),
    "llama3": lambda calls: "<|python_tag|>" + "; ".join(_json({"name": n, "parameters": a}) for n, a in calls),
    "mistral": lambda calls: "[TOOL_CALLS] " + _json([{"name": n, "arguments": a} for n, a in calls]),
    "deepseekv3": lambda calls: "<｜tool▁calls▁begin｜>" + "\n".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{_json(a)}\n```<｜tool▁call▁end｜>" for n, a in calls)
        + "<｜tool▁calls▁end｜>",
    "pythonic": lambda calls: "[" + ", ".join(f"{n}({', '.join(f'{k}={_py(v)}' for k, v in a.items())})"
                                              for n, a in calls) + "]",
    "qwen3_coder": lambda calls: "\n".join(
        f"<tool_call>\n<function={n}>\n" + "".join(f"<parameter={k}>\n{_xml_value(v)}\n</parameter>\n" for k, v in a.items())
        + "</function>\n</tool_call>" for n, a in calls),
    "kimi_k2": lambda calls: "<|tool_calls_section_begin|>" + "".join(
        f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{_json(a)}<|tool_call_end|>"
        for i, (n, a) in enumerate(calls)) + "<|tool_calls_section_end|>",
    "glm45": lambda calls: "\n".join(
        f"<tool_call>{n}\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{_xml_value(v)}</arg_value>\n" for k, v in a.items())
        + "</tool_call>" for n, a in calls),
    "json_array": lambda calls: _json([{"name": n, "parameters": a} for n, a in calls]),
    "gpt-oss": lambda calls: "<|start|>assistant".join(
        f"<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>{_json(a)}<|call|>" for n, a in calls),
}

# Arguments that stress a format: non-ASCII, quotes and backslashes, numbers, literals, nesting
# with closing brackets inside strings, an empty object.
ROUND_TRIP_ARGUMENTS: list[dict] = [
    {"city": "São Paulo", "note": "naïve — ok ✓"},
    {"q": 'say "hi"\nand \\ back', "path": "C:\\temp"},
    {"n": -12.5, "big": 12345678901, "ok": True, "none": None},
    {"nested": {"a": [1, {"b": "}]"}], "c": {}}, "list": []},
    {},
    {"code": "if (a < b) { return 'x'; }", "zip": "01234"},
]
ROUND_TRIP_CALLS: list[list[Call]] = (
    [[("get_weather", a)] for a in ROUND_TRIP_ARGUMENTS]
    + [[("get_weather", ROUND_TRIP_ARGUMENTS[0]), ("lookup_2", ROUND_TRIP_ARGUMENTS[2])],
       [("lookup_2", ROUND_TRIP_ARGUMENTS[3]), ("get_weather", ROUND_TRIP_ARGUMENTS[1]), ("lookup_2", {})]]
)


def _json_type(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null",
            list: "array", dict: "object"}[type(v)]


def tools_for(calls: list[Call]) -> list[dict]:
    """Tool definitions covering ``calls``, each parameter typed by its value (so a parser that
    reads values by the schema, like the XML formats, keeps ``"01234"`` a string)."""
    props: dict[str, dict] = {}
    for n, a in calls:
        props.setdefault(n, {}).update({k: {"type": _json_type(v)} for k, v in a.items()})
    return [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": p}}}
            for n, p in props.items()]
