"""The parser suites of the conformance kit: every built-in tool and reasoning parser passes
them (samples, streaming agreement under any split, malformed input, round trips), and broken
parsers are caught with a message naming the case."""

from __future__ import annotations

import pytest

from core.interfaces import ToolCall
from core.plugins import load_plugins
from core.testing import TOOL_FORMATS, TOOL_SAMPLES, check_plugin, reasoning_parser_conformance, tool_parser_conformance
from core_plugins.parsers.reasoning import DeepSeekR1ReasoningParser
from core_plugins.parsers.tools import Qwen25ToolParser

pytest_plugins = ["core.testing.pytest_plugin"]

PM = load_plugins("parsers")


@pytest.fixture(params=PM.names("tool_parser"))
def tool_parser(request):
    return request.param


@pytest.fixture(params=PM.names("reasoning_parser"))
def reasoning_parser(request):
    return request.param


def test_every_builtin_tool_parser_has_samples_and_a_format():
    """So the suite's sample and round-trip cases run for each (aliases share their class's)."""
    classes = {PM.resolve("tool_parser", n) for n in PM.names("tool_parser")}
    covered = {PM.resolve("tool_parser", n) for n in TOOL_SAMPLES if n in PM.names("tool_parser")}
    assert classes <= covered, classes - covered
    assert set(TOOL_SAMPLES) <= set(TOOL_FORMATS)


# --------------------------------------------------------------------------- broken parsers


class LosesAFragment(Qwen25ToolParser):
    """Drops the second argument fragment it streams."""

    def __init__(self):
        super().__init__()
        self.fragments = 0

    def parse_streaming(self, delta, tools=None):
        text, calls = super().parse_streaming(delta, tools)
        kept = []
        for c in calls:
            if not c.name and c.arguments:
                self.fragments += 1
                if self.fragments == 2:
                    continue
            kept.append(c)
        return text, kept


class RaisesOnJunk(Qwen25ToolParser):
    def parse(self, text, tools=None):
        if text.count("{") != text.count("}"):
            raise ValueError("unbalanced braces")
        return super().parse(text, tools)


class WrongIndex(Qwen25ToolParser):
    def parse(self, text, tools=None):
        normal, calls = super().parse(text, tools)
        return normal, [ToolCall(c.name, c.arguments, c.index + 1) for c in calls]


def qwen25(parser) -> dict:
    return {r.case: r for r in check_plugin(parser, "tool_parser", samples=TOOL_SAMPLES["qwen25"],
                                            format_calls=TOOL_FORMATS["qwen25"])}


def test_a_parser_losing_a_streamed_argument_fragment_is_caught():
    r = qwen25(LosesAFragment)
    assert r["samples_parse"].status == "passed"  # parse itself is fine: only streaming loses text
    assert r["streaming_agreement"].status == "failed" and r["round_trip"].status == "failed"
    msg = r["streaming_agreement"].message
    assert msg.startswith("tool_parser 'LosesAFragment' case 'streaming_agreement[1]': split [")
    assert "call 'get_weather' streamed arguments" in msg and "a fragment lost or repeated" in msg
    if r["streaming_hypothesis"].status != "skipped":  # hypothesis installed: it finds (and shrinks) a split too
        assert "case 'streaming_hypothesis[0]'" in r["streaming_hypothesis"].message


def test_a_parser_raising_on_malformed_text_is_caught():
    r = qwen25(RaisesOnJunk)
    assert r["malformed_never_raises"].status == "failed"
    assert r["malformed_never_raises"].message.startswith(
        "tool_parser 'RaisesOnJunk' case 'malformed_never_raises': '{' raised ValueError: unbalanced braces")


def test_call_indices_are_checked():
    r = qwen25(WrongIndex)
    assert r["samples_parse"].status == "failed" and "call indices [1] are not 0..0" in r["samples_parse"].message


class DropsOneCharReasoning(DeepSeekR1ReasoningParser):
    """Loses the reasoning of one-character deltas (parse itself is right)."""

    def parse_streaming(self, delta):
        reasoning, content = super().parse_streaming(delta)
        return ("" if len(delta) == 1 else reasoning), content


def test_a_reasoning_parser_losing_streamed_text_is_caught():
    from core.testing import REASONING_SAMPLES

    r = {x.case: x for x in check_plugin(DropsOneCharReasoning, "reasoning_parser",
                                         samples=REASONING_SAMPLES["deepseek-r1"])}
    assert r["samples_parse"].status == "passed"
    assert r["streaming_agreement"].status == "failed"
    assert r["streaming_agreement"].message.startswith(
        "reasoning_parser 'DropsOneCharReasoning' case 'streaming_agreement[0]': split [1] of 'The weather")


def test_a_parser_without_samples_still_gets_the_generic_cases():
    r = {x.case: x for x in check_plugin(WrongIndex, "tool_parser", samples=[])}
    assert r["samples_parse"].status == "skipped" and r["round_trip"].status == "skipped"
    assert r["streaming_agreement"].status == "passed" and r["malformed_never_raises"].status == "passed"
