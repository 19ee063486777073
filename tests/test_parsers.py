"""Tool-call and reasoning parsers beyond the conformance kit's cases: incremental streaming,
undefined tools, chat-template switches, structural tags, schema-typed parameters, tool plans."""

from __future__ import annotations

import json

import pytest

from core.plugins import load_plugins
from core.testing import TOOL_SAMPLES

PM = load_plugins()
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("get_weather", "get_time")]


# Parsing each recorded sample (core.testing.TOOL_SAMPLES / REASONING_SAMPLES), streaming it
# split anywhere, malformed input and argument round trips are the conformance kit's cases, run
# for every built-in parser in tests/test_conformance_parsers.py. What is checked here goes
# beyond the parser contract.

INCREMENTAL = [(name, i) for name, samples in TOOL_SAMPLES.items() for i, s in enumerate(samples)
               if s.calls and not s.malformed]


@pytest.mark.parametrize("name,i", INCREMENTAL)
def test_tool_call_streams_incrementally(name, i):
    """The first call's name is sent alone before its block ends, and JSON arguments stream below
    parameter granularity (as SGLang's detectors do)."""
    text, calls = TOOL_SAMPLES[name][i].text, TOOL_SAMPLES[name][i].calls
    p = PM.resolve("tool_parser", name)()
    first = [c for k in range(len(text) - 1) for c in p.parse_streaming(text[k], TOOLS)[1]]
    assert first and first[0].name == calls[0][0] and not first[0].arguments  # the name alone, then fragments
    if name not in ("pythonic", "qwen3_coder", "glm45"):  # parameter formats send one fragment per parameter
        assert len([c for c in first if c.index == 0 and c.arguments]) > 3


def test_undefined_tool_dropped():
    p = PM.resolve("tool_parser", "qwen25")()
    _, calls = p.parse('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', TOOLS)
    assert calls == []


@pytest.mark.parametrize("text", ["<think>\nHmm.\n</think>\n\nHello!", "Hello, no thinking here.", "<think>never closes"])
def test_qwen3_enable_thinking_false(text):
    """chat_template_kwargs enable_thinking=false: no separation, everything is content (as SGLang)."""
    for kwargs, expect in (({"enable_thinking": False}, ("", text)), ({"enable_thinking": True}, None), ({}, None)):
        p = PM.resolve("reasoning_parser", "qwen3")()
        p.configure(kwargs)
        want = expect or PM.resolve("reasoning_parser", "qwen3")().parse(text)
        assert p.parse(text) == want
        p = PM.resolve("reasoning_parser", "qwen3")()
        p.configure(kwargs)
        r = c = ""
        for ch in text:
            dr, dc = p.parse_streaming(ch)
            r, c = r + dr, c + dc
        dr, dc = p.flush()
        assert (r + dr, c + dc) == want
    p = PM.resolve("reasoning_parser", "deepseek-r1")()  # no such switch: still separates
    p.configure({"enable_thinking": False})
    assert p.parse("a</think>b") == ("a", "b")


STRUCT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}},
]
NATIVE = {  # a valid output in each native format, and one that breaks the schema
    "qwen25": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>',
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima", "days": 3}}\n</tool_call>'),
    "llama3": ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; {"name": "get_time", "parameters": {"tz": "UTC"}}',
               '{"name": "get_weather", "parameters": {"city": "Paris", "days": 9}}'),
    "mistral": ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, {"name": "get_time", "arguments": {"tz": "UTC"}}]',
                '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
    "pythonic": ('[get_weather(city="Paris", days=3), get_time(tz="UTC")]', '[get_weather(city="Lima", days=3)]'),
    "deepseekv3": ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜>'
                   '\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{"tz": "UTC"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
                   '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_nothing\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    "kimi_k2": ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                '{"city": "Paris", "days": 3}<|tool_call_end|><|tool_calls_section_end|>',
                "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                '{"city": 3}<|tool_call_end|><|tool_calls_section_end|>'),
    "gpt-oss": ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Tokyo", "days": 1}<|call|>',
                '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Tokyo"}<|call|>'),
    "qwen3_coder": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
                    "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=tz>\n0800\n</parameter>\n</function>\n</tool_call>",
                    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"),
    "glm45": ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
              "</tool_call>\n<tool_call>get_time\n<arg_key>tz</arg_key>\n<arg_value>0800</arg_value>\n</tool_call>",
              "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"),
}


STOP = 96


@pytest.fixture(scope="module")
def xgr_compiler():
    xgr = pytest.importorskip("xgrammar")
    vocab = [chr(i) for i in range(32, 127)] + ["\n", "</s>"]  # accept_string works on text, any vocab does
    assert len(vocab) - 1 == STOP
    return xgr, xgr.GrammarCompiler(xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1]), max_threads=1)


@pytest.mark.parametrize("parser", sorted(NATIVE))
def test_structural_tag_native_format(parser, xgr_compiler):
    """Each parser's call format compiles with xgrammar for a 2-tool list, accepts its own valid
    output (which it parses back), and rejects output breaking the parameter schema."""
    xgr, compiler = xgr_compiler
    good, bad = NATIVE[parser]
    cls = PM.resolve("tool_parser", parser)

    def accepts(tag, text):
        m = xgr.GrammarMatcher(compiler.compile_structural_tag(json.dumps(tag)))
        return m.accept_string(text) and m.accept_token(STOP)  # then the stop token

    tag = cls().structural_tag(STRUCT_TOOLS)
    assert accepts(tag, good)
    assert not accepts(tag, bad)
    _, calls = cls().parse(good, STRUCT_TOOLS)
    assert calls and calls[0].name == "get_weather"
    if parser in ("qwen3_coder", "glm45"):  # XML parameters read back by the schema: "0800" stays a string
        assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris", "days": 3}, {"tz": "0800"}]
    single = cls().structural_tag(STRUCT_TOOLS, parallel=False)
    first = good if len(calls) == 1 else None
    if first is not None:
        assert accepts(single, first)
    else:
        assert not accepts(single, good)  # one call at most
    named = cls().structural_tag(STRUCT_TOOLS, name="get_time")
    assert not accepts(named, good.split("get_time")[0]) or parser == "pythonic"


@pytest.mark.parametrize("parser", ["qwen3_coder", "glm45"])
def test_xml_parameters_typed_by_schema(parser):
    """XML-style parameter values are read by the tool's schema, streamed or not: a string-typed
    value that looks like a number stays a string; untyped ones are still JSON-decoded."""
    good = NATIVE[parser][0]
    want = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "0800"})]
    _, calls = PM.resolve("tool_parser", parser)().parse(good, STRUCT_TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == want
    p = PM.resolve("tool_parser", parser)()
    args: dict[int, str] = {}
    for t in [p.parse_streaming(ch, STRUCT_TOOLS) for ch in good] + [p.flush(STRUCT_TOOLS)]:
        for c in t[1]:
            args[c.index] = args.get(c.index, "") + c.arguments
    assert [json.loads(a) for _, a in sorted(args.items())] == [a for _, a in want]
    good = good.replace("0800", "42")
    _, calls = PM.resolve("tool_parser", parser)().parse(good, STRUCT_TOOLS)
    assert json.loads(calls[1].arguments) == {"tz": "42"}
    _, calls = PM.resolve("tool_parser", parser)().parse(good, TOOLS)  # no property types: JSON where it parses
    assert json.loads(calls[1].arguments) == {"tz": 42}


# ----------------------------------------------------------------------------- the tool plan of a chat request


def _plan(tool_call_parser=None, reasoning_parser=None, grammar="xgrammar", plugins=PM, **body):
    from types import SimpleNamespace

    import msgspec

    from core.server.args import ServerArgs
    from core.server.openai.protocol import ChatCompletionRequest
    from core.server.openai.tools import plan_tools

    state = SimpleNamespace(engine=SimpleNamespace(plugins=plugins, grammar=SimpleNamespace(name=grammar)),
                            args=ServerArgs(tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser))
    r = msgspec.convert({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **body}, ChatCompletionRequest)
    return plan_tools(state, r), r


def test_tool_plan_decides_mode_constraint_and_parsers_once():
    from core.server.openai.tools import ChoicePost

    qwen, json_array = PM.resolve("tool_parser", "qwen25"), PM.resolve("tool_parser", "json_array")
    plan, _ = _plan("qwen25")
    assert (plan.mode, plan.constraint, plan.tool_parser, plan.hides_tools) == ("auto", None, qwen, False)
    plan, _ = _plan("qwen25", tool_choice="none")
    assert plan.tool_parser is None and plan.hides_tools
    plan, _ = _plan(None)  # no --tool-call-parser: tools reach the template, the output stays text
    assert plan.mode == "auto" and plan.tool_parser is None
    # required with xgrammar and a parser that describes its format: the model's own format, read back by it
    plan, _ = _plan("qwen25", tool_choice="required")
    assert plan.constraint[0] == "structural_tag" and plan.tool_parser is qwen
    # otherwise SGLang's JSON array, read back by the json_array plugin, resolved by name
    plan, r = _plan("qwen25", grammar="llguidance", tool_choice="required", parallel_tool_calls=False)
    assert plan.constraint[0] == "json_schema" and json.loads(plan.constraint[1])["maxItems"] == 1
    assert plan.tool_parser is json_array
    reasoning, content, calls, reason = ChoicePost(plan, r).full('[{"name": "get_time", "parameters": {"tz": "UTC"}}]', "stop")
    assert (content, reason, calls[0]["function"]) == (None, "tool_calls", {"name": "get_time", "arguments": '{"tz": "UTC"}'})
    # a named function without a native format: its parameter schema, the whole output is the arguments
    plan, r = _plan(None, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert plan.named_args and json.loads(plan.constraint[1]) == {"type": "object"}
    assert ChoicePost(plan, r).full('{"tz": "UTC"}', "stop")[2][0]["function"]["name"] == "get_time"
    # reasoning: the parser class, unless the request turns separation off
    assert _plan(None, "qwen3")[0].reasoning_parser is PM.resolve("reasoning_parser", "qwen3")
    assert _plan(None, "qwen3", separate_reasoning=False)[0].reasoning_parser is None


def test_tool_plan_without_the_json_array_plugin_is_a_clear_400():
    from core.errors import InvalidRequest

    no_parsers = load_plugins(["grammar"])  # the built-in parsers plugin not loaded
    with pytest.raises(InvalidRequest) as e:
        _plan(None, plugins=no_parsers, grammar="llguidance", tool_choice="required")
    assert e.value.param == "tool_choice" and "json_array" in e.value.message
