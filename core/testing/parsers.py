"""The tool-call and reasoning parser suites.

The property at their heart: feeding a text to ``parse_streaming`` in any split (then
``flush``) gives what ``parse`` gives for the whole text — the same normal text, and for tool
calls each name once, before its arguments, with argument fragments concatenating to
``parse``'s arguments exactly. Splits tried: the whole text, every single cut, one character
at a time, and seeded random multi-cut splits; with ``hypothesis`` installed, a further case
searches for a failing split (and shrinks it). Malformed and truncated texts must never raise,
and calls must survive a round trip: calls written in the parser's format (``format_calls``)
come back with the same names and arguments.
"""

from __future__ import annotations

import json
import random
from typing import Any, Callable, Iterator

import attrs

from core.interfaces import ToolCall
from core.testing.parser_samples import (
    REASONING_SAMPLES, ROUND_TRIP_CALLS, TOOL_FORMATS, TOOL_SAMPLES, TOOLS, ReasoningSample, ToolSample, tools_for,
)
from core.testing.suite import Case, ConformanceError, Skipped, fail, resolve_target, seed_for

PLAIN_TEXT = "The weather is fine today, thanks for asking."
JUNK = ["", " ", "{", "}", "}}}}", "[[[", "]]", "<", ">", "</", '"', "\\", "\n\n", "\x00", "{\"name\": ", "()", "<think>",
        "</think>", "<tool_call>", "</tool_call>", "<tool_call>{}</tool_call>", "[TOOL_CALLS]", "<|python_tag|>",
        "日本語🙂", "null", '{"name": 1, "arguments": []}']
RANDOM_SPLITS = 12
HYPOTHESIS_EXAMPLES = 25


def splits(text: str, seed: int, n_random: int = RANDOM_SPLITS) -> Iterator[list[int]]:
    """Cut points: none, each single cut, every character, and ``n_random`` random multi-cuts."""
    yield []
    for k in range(1, len(text)):
        yield [k]
    if len(text) > 2:
        yield list(range(1, len(text)))
        rng = random.Random(seed)
        for _ in range(n_random):
            yield sorted(rng.sample(range(1, len(text)), rng.randint(2, min(8, len(text) - 1))))


def show(cut: list[int]) -> str:
    """A split for a message: short ones in full."""
    return str(cut) if len(cut) <= 12 else f"[{cut[0]}, {cut[1]}, ... {cut[-1]}] ({len(cut)} cuts)"


def pieces(text: str, cut: list[int]) -> list[str]:
    return [text[a:b] for a, b in zip([0, *cut], [*cut, len(text)])]


def derived_texts(text: str, seed: int, limit: int = 12) -> list[tuple[str, list[list[int]]]]:
    """Truncations and corruptions of ``text`` (what a model cut off by max_tokens, or a confused
    one, writes), each with the splits to stream it in: ``limit`` truncations character by
    character; every one-character deletion and ``2 * limit`` junk insertions in one piece and
    in four random pieces."""
    rng = random.Random(seed)
    n = len(text)

    def few(t: str) -> list[list[int]]:
        return [[], sorted(rng.sample(range(1, len(t)), min(3, len(t) - 1)))] if len(t) > 1 else [[]]

    out = [(text[:k], [[], list(range(1, k))]) for k in sorted({*range(0, n, max(1, n // limit)), n - 1})]
    for i in range(n):
        out.append((t := text[:i] + text[i + 1:], few(t)))
    for _ in range(2 * limit if n else 0):
        i = rng.randrange(n)
        out.append((t := text[:i] + rng.choice(JUNK[1:]) + text[i:], few(t)))
    return out


# --------------------------------------------------------------------------- tool parsers


@attrs.define
class ToolParserSubject:
    """A tool parser under test: its factory, its samples, its call format (optional) and tools."""

    factory: Any
    label: str
    samples: list[ToolSample]
    format_calls: Callable[[list[tuple[str, dict]]], str] | None
    tools: list[dict]
    kind: str = "tool_parser"

    @classmethod
    def build(cls, target: Any, *, plugins: Any = None, samples: list[ToolSample] | None = None,
              format_calls: Callable | None = None, tools: list[dict] | None = None) -> ToolParserSubject:
        factory, label = resolve_target("tool_parser", target, plugins)
        builtin = _builtin_key(target, factory, plugins, TOOL_SAMPLES, "tool_parser")
        if samples is None:
            samples = TOOL_SAMPLES.get(builtin, [])
        if format_calls is None:
            format_calls = TOOL_FORMATS.get(builtin)
        return cls(factory, label, list(samples), format_calls, tools if tools is not None else TOOLS)


def _builtin_key(target: Any, factory: Any, plugins: Any, table: dict, kind: str) -> str | None:
    """The built-in name whose samples apply: the name itself, or an alias resolving to the same class."""
    if isinstance(target, str) and target in table:
        return target
    from core.testing.suite import default_plugins

    pm = plugins or default_plugins()
    for name in table:
        try:
            if pm.resolve(kind, name) is factory:
                return name
        except Exception:
            continue
    return None


def _stream_tool(s: ToolParserSubject, text: str, cut: list[int], tools: list[dict], where: str
                 ) -> tuple[str, list[tuple[str, str]]]:
    """Normal text and ``[(name, arguments)]`` from streaming ``text`` split at ``cut``; checks the
    delta protocol (the name once, in the call's first delta; fragments never before it)."""
    p = s.factory()
    normal, calls = "", {}
    results = [p.parse_streaming(piece, tools) for piece in pieces(text, cut)] + [p.flush(tools)]
    for k, (t, cs) in enumerate(results):
        _typed(s, where, t, cs)
        normal += t
        for c in cs:
            if c.name:  # the call's first delta (it may carry a first argument fragment too)
                if c.index in calls:
                    raise fail(s, where, f"split {show(cut)}: call {c.index}'s name sent twice (delta {k})")
                calls[c.index] = [c.name, c.arguments]
            else:
                if c.index not in calls:
                    raise fail(s, where, f"split {show(cut)}: arguments of call {c.index} before its name (delta {k})")
                calls[c.index][1] += c.arguments
    if sorted(calls) != list(range(len(calls))):
        raise fail(s, where, f"split {show(cut)}: call indices {sorted(calls)} are not 0..{len(calls) - 1}")
    return normal, [(n, a) for _, (n, a) in sorted(calls.items())]


def _typed(s: Any, where: str, text: Any, calls: Any) -> None:
    if not isinstance(text, str) or not isinstance(calls, list):
        raise fail(s, where, f"returned {type(text).__name__}, {type(calls).__name__}; expected (str, list[ToolCall])")
    for c in calls:
        if not (isinstance(c, ToolCall) or hasattr(c, "name")) or not isinstance(c.name, str) \
                or not isinstance(c.arguments, str) or not isinstance(c.index, int):
            raise fail(s, where, f"returned a call {c!r}; expected ToolCall(name: str, arguments: str, index: int)")


def _decoded(s: Any, where: str, arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        raise fail(s, where, f"arguments {arguments!r} are not JSON") from None


def _parse_tool(s: ToolParserSubject, text: str, tools: list[dict], where: str) -> tuple[str, list[ToolCall]]:
    normal, calls = s.factory().parse(text, tools)
    _typed(s, where, normal, calls)
    if [c.index for c in calls] != list(range(len(calls))):
        raise fail(s, where, f"parse() call indices {[c.index for c in calls]} are not 0..{len(calls) - 1}")
    return normal, calls


def _need_samples(s: ToolParserSubject) -> None:
    if not s.samples:
        raise Skipped("no samples for this parser (pass tool_parser_samples / samples=)")


def tool_samples_parse(s: ToolParserSubject) -> None:
    """``parse`` of each sample returns its normal text and calls."""
    _need_samples(s)
    for i, smp in enumerate([*s.samples, ToolSample(PLAIN_TEXT, PLAIN_TEXT)]):
        where = f"samples_parse[{i}]"
        normal, calls = _parse_tool(s, smp.text, s.tools, where)
        got = [(c.name, _decoded(s, where, c.arguments)) for c in calls]
        if normal != smp.normal or got != [tuple(c) for c in smp.calls]:
            raise fail(s, where, f"parse({smp.text!r}) gave normal {normal!r}, calls {got}; "
                                 f"expected {smp.normal!r}, {list(smp.calls)}")


def _agree(s: ToolParserSubject, smp: ToolSample, cut: list[int], where: str) -> None:
    want_normal, want = _parse_tool(s, smp.text, s.tools, where)
    normal, streamed = _stream_tool(s, smp.text, cut, s.tools, where)
    if normal != want_normal:
        raise fail(s, where, f"split {show(cut)} of {smp.text!r}: streamed normal text {normal!r}, parse gave {want_normal!r}")
    if smp.malformed:
        return
    if [n for n, _ in streamed] != [c.name for c in want]:
        raise fail(s, where, f"split {show(cut)} of {smp.text!r}: streamed calls {[n for n, _ in streamed]}, "
                             f"parse gave {[c.name for c in want]}")
    for (name, args), c in zip(streamed, want):
        if args != c.arguments:
            raise fail(s, where, f"split {show(cut)} of {smp.text!r}: call {name!r} streamed arguments {args!r}, "
                                 f"parse gave {c.arguments!r} (a fragment lost or repeated)")


def tool_streaming_agreement(s: ToolParserSubject) -> None:
    """Every split of every sample streams to what ``parse`` returns."""
    for i, smp in enumerate([ToolSample(PLAIN_TEXT, PLAIN_TEXT), *s.samples]):
        for cut in splits(smp.text, seed_for(s.label, i)):
            _agree(s, smp, cut, f"streaming_agreement[{i}]")


def tool_streaming_hypothesis(s: ToolParserSubject) -> None:
    """hypothesis searches the splits of each sample for a disagreement, and shrinks what it finds."""
    _need_samples(s)
    _search_splits(s.samples, lambda smp, cut, where: _agree(s, smp, cut, where))


def _search_splits(samples: Any, agree: Any) -> None:
    """Run ``agree(sample, cut points, case name)`` over the splits hypothesis draws for each sample."""
    given, settings, st = _hypothesis()
    for i, smp in enumerate(samples):
        if len(smp.text) < 2:
            continue

        @settings(max_examples=HYPOTHESIS_EXAMPLES, deadline=None, derandomize=True, database=None)
        @given(st.sets(st.integers(1, len(smp.text) - 1), max_size=12))
        def prop(cuts: set[int]) -> None:
            agree(smp, sorted(cuts), f"streaming_hypothesis[{i}]")

        prop()


def _hypothesis() -> tuple[Any, Any, Any]:
    try:
        from hypothesis import given, settings, strategies
    except ImportError:
        raise Skipped("hypothesis is not installed (the deterministic splits of streaming_agreement still ran)") from None
    return given, settings, strategies


def tool_malformed_never_raises(s: ToolParserSubject) -> None:
    """Truncated, corrupted and junk texts: no exception, well-typed results, JSON arguments."""
    texts = [(t, [[], list(range(1, len(t)))]) for t in JUNK]
    for i, smp in enumerate(s.samples):
        texts += derived_texts(smp.text, seed_for(s.label, "malformed", i))
    for text, cuts in texts:
        where = f"malformed_never_raises({text!r})"
        try:
            _, calls = _parse_tool(s, text, s.tools, where)
            for c in calls:
                _decoded(s, where, c.arguments)
            for cut in cuts:
                _stream_tool(s, text, cut, s.tools, where)
        except Exception as e:
            if isinstance(e, ConformanceError):
                raise
            raise fail(s, "malformed_never_raises", f"{text!r} raised {type(e).__name__}: {e}") from None


def tool_round_trip(s: ToolParserSubject) -> None:
    """Calls written in the parser's format come back with the same names and arguments, parsed
    whole and streamed (character by character and in random pieces)."""
    if s.format_calls is None:
        raise Skipped("no call format for this parser (pass tool_parser_format / format_calls=)")
    for i, calls in enumerate(ROUND_TRIP_CALLS):
        text, tools = s.format_calls(calls), tools_for(calls)
        where = f"round_trip[{i}]"
        _, got = _parse_tool(s, text, tools, where)
        decoded = [(c.name, _decoded(s, where, c.arguments)) for c in got]
        if decoded != [tuple(c) for c in calls]:
            raise fail(s, where, f"parse({text!r}) gave {decoded}, expected {calls}")
        for cut in [list(range(1, len(text))), *list(splits(text, seed_for(s.label, "rt", i), 4))[-4:]]:
            _, streamed = _stream_tool(s, text, cut, tools, where)
            if [(n, a) for n, a in streamed] != [(c.name, c.arguments) for c in got]:
                raise fail(s, where, f"split {show(cut)} of {text!r}: streamed {streamed}, parse gave "
                                     f"{[(c.name, c.arguments) for c in got]}")


def tool_parser_cases() -> list[Case]:
    return [
        Case("samples_parse", tool_samples_parse, tool_samples_parse.__doc__ or ""),
        Case("streaming_agreement", tool_streaming_agreement, tool_streaming_agreement.__doc__ or ""),
        Case("streaming_hypothesis", tool_streaming_hypothesis, tool_streaming_hypothesis.__doc__ or ""),
        Case("malformed_never_raises", tool_malformed_never_raises, tool_malformed_never_raises.__doc__ or ""),
        Case("round_trip", tool_round_trip, tool_round_trip.__doc__ or ""),
    ]


# --------------------------------------------------------------------------- reasoning parsers


@attrs.define
class ReasoningParserSubject:
    factory: Any
    label: str
    samples: list[ReasoningSample]
    kind: str = "reasoning_parser"

    @classmethod
    def build(cls, target: Any, *, plugins: Any = None, samples: list[ReasoningSample] | None = None
              ) -> ReasoningParserSubject:
        factory, label = resolve_target("reasoning_parser", target, plugins)
        if samples is None:
            samples = REASONING_SAMPLES.get(_builtin_key(target, factory, plugins, REASONING_SAMPLES, "reasoning_parser"), [])
        return cls(factory, label, list(samples))


def _pair(s: Any, where: str, out: Any) -> tuple[str, str]:
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(x, str) for x in out)):
        raise fail(s, where, f"returned {out!r}; expected (reasoning: str, content: str)")
    return out


def _reason_agree(s: ReasoningParserSubject, text: str, cut: list[int], where: str) -> None:
    want = _pair(s, where, s.factory().parse(text))
    p = s.factory()
    r = c = ""
    for piece in pieces(text, cut):
        dr, dc = _pair(s, where, p.parse_streaming(piece))
        r, c = r + dr, c + dc
    dr, dc = _pair(s, where, p.flush())
    if (r + dr, c + dc) != want:
        raise fail(s, where, f"split {show(cut)} of {text!r}: streamed {(r + dr, c + dc)!r}, parse gave {want!r}")


def reasoning_samples_parse(s: ReasoningParserSubject) -> None:
    """``parse`` of each sample returns its reasoning and content."""
    if not s.samples:
        raise Skipped("no samples for this parser (pass reasoning_parser_samples / samples=)")
    for i, smp in enumerate(s.samples):
        got = _pair(s, f"samples_parse[{i}]", s.factory().parse(smp.text))
        if got != (smp.reasoning, smp.content):
            raise fail(s, f"samples_parse[{i}]", f"parse({smp.text!r}) gave {got!r}, "
                                                 f"expected {(smp.reasoning, smp.content)!r}")


def reasoning_streaming_agreement(s: ReasoningParserSubject) -> None:
    """Every split of every sample (and of plain text) streams, with ``flush``, to what ``parse`` returns."""
    for i, text in enumerate([PLAIN_TEXT, *(smp.text for smp in s.samples)]):
        for cut in splits(text, seed_for(s.label, i)):
            _reason_agree(s, text, cut, f"streaming_agreement[{i}]")


def reasoning_streaming_hypothesis(s: ReasoningParserSubject) -> None:
    """hypothesis searches the splits of each sample for a disagreement, and shrinks what it finds."""
    _search_splits(s.samples, lambda smp, cut, where: _reason_agree(s, smp.text, cut, where))


def reasoning_malformed_never_raises(s: ReasoningParserSubject) -> None:
    """Truncated, corrupted and junk texts: no exception, and streaming still agrees with ``parse``."""
    texts = [(t, [[], list(range(1, len(t)))]) for t in JUNK]
    for i, smp in enumerate(s.samples):
        texts += derived_texts(smp.text, seed_for(s.label, "malformed", i))
    for text, cuts in texts:
        try:
            for cut in cuts:
                _reason_agree(s, text, cut, f"malformed_never_raises({text!r})")
        except Exception as e:
            if isinstance(e, ConformanceError):
                raise
            raise fail(s, "malformed_never_raises", f"{text!r} raised {type(e).__name__}: {e}") from None


def reasoning_parser_cases() -> list[Case]:
    return [
        Case("samples_parse", reasoning_samples_parse, reasoning_samples_parse.__doc__ or ""),
        Case("streaming_agreement", reasoning_streaming_agreement, reasoning_streaming_agreement.__doc__ or ""),
        Case("streaming_hypothesis", reasoning_streaming_hypothesis, reasoning_streaming_hypothesis.__doc__ or ""),
        Case("malformed_never_raises", reasoning_malformed_never_raises, reasoning_malformed_never_raises.__doc__ or ""),
    ]
