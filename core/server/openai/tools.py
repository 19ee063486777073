"""Tool calls and reasoning in chat completions: the tool plan of a request and the
per-choice post-processor that applies it.

* ``tool_choice``: ``none`` (tools hidden from the template, output is text), ``auto`` (the
  ``--tool-call-parser`` finds calls in the text), ``required`` and ``{"type": "function",
  "function": {"name": ...}}``: the output is constrained through the grammar backend so the
  call always parses and validates. With a ``--tool-call-parser`` whose parser describes its
  format (``structural_tag``) and the xgrammar backend, the constraint is the model's NATIVE
  call format (one or more calls; one when ``parallel_tool_calls`` is false; only the named
  function) with arguments matching each tool's schema, and that parser reads the calls back,
  streamed incrementally. Otherwise, as SGLang does, a JSON array of ``{"name", "parameters"}``
  (one item at most when ``parallel_tool_calls`` is false), read back by the ``json_array``
  tool parser (a built-in plugin), or the named function's parameter schema; this works with
  any model and streams incrementally too.
* With ``--reasoning-parser`` and ``separate_reasoning`` (default true), reasoning goes to
  ``reasoning_content`` (``delta.reasoning_content`` when streaming) and is not searched for calls.
* A call is one truth, streamed or whole: a call the output ends in (cut off by max_tokens,
  ``finish_reason: "length"``) is a call with its arguments as far as they were written, never
  also text; whitespace before, between and after calls is not content. A parser opts in with the
  optional method ``chat_view()`` (the built-in ones have it), called before it reads anything.

:func:`plan_tools` decides all of this once per request (:class:`ToolPlan`); every choice's
:class:`ChoicePost` is built from the plan.
"""

from __future__ import annotations

import functools
import json
import uuid
from typing import Any

import attrs

from core.errors import CoreError, InvalidRequest
from core.interfaces import ToolCall
from core.server.http import log_ignored_field

JSON_ARRAY_PARSER = "json_array"  # the tool parser that reads SGLang's constrained ``required`` output


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequest(message, param=param)


def _tool_names(tools: list[dict] | None) -> list[str]:
    return [(t.get("function") or {}).get("name") for t in tools or [] if isinstance(t, dict)]


def check_parameters_schema(fn: dict, i: int) -> None:
    """A function's ``parameters`` must be a valid JSON Schema (checked against the 2020-12
    metaschema, as SGLang does): a 400 naming the tool, before the template or a grammar sees it."""
    params = fn.get("parameters")
    if params is None:
        return
    from jsonschema import Draft202012Validator, SchemaError

    name = fn["name"]
    if not isinstance(params, dict):
        raise InvalidRequest(f"tool {name!r} (tools[{i}]): function.parameters must be a JSON Schema object, got "
                             f"{type(params).__name__}", param=f"tools[{i}].function.parameters")
    try:
        Draft202012Validator.check_schema(params)
    except SchemaError as e:
        where = "/".join(map(str, e.path))
        raise InvalidRequest(f"tool {name!r} (tools[{i}]): function.parameters is not a valid JSON Schema: {e.message}"
                             + (f" (at {where})" if where else ""), param=f"tools[{i}].function.parameters") from None


def check_tools(tools: Any) -> None:
    """``tools`` is a list of ``{"type": "function", "function": {"name": str, "parameters": JSON Schema}}``;
    a 400 naming the first bad one."""
    _check(isinstance(tools, list), "tools must be a list", "tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        _check(isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(fn, dict)
               and isinstance(fn.get("name"), str), f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
               f"tools[{i}]")
        check_parameters_schema(fn, i)


def tool_mode(r: Any) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "named", the named function). Validates tools / tool_choice."""
    tools, tc = r.tools, r.tool_choice
    if tools is not None:
        check_tools(tools)
    if tc is None:
        return ("auto" if tools else "none"), None
    if isinstance(tc, str):
        _check(tc in ("none", "auto", "required"), f"tool_choice must be 'none', 'auto', 'required' or a function, got {tc!r}",
               "tool_choice")
        _check(tc == "none" or bool(tools), f"tool_choice {tc!r} needs tools", "tool_choice")
        return tc, None
    name = (tc.get("function") or {}).get("name") if isinstance(tc, dict) else None
    _check(isinstance(tc, dict) and tc.get("type") == "function" and isinstance(name, str),
           "tool_choice must be {'type': 'function', 'function': {'name': ...}}", "tool_choice")
    _check(name in _tool_names(tools), f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
    return "named", name


def _params_schema(tool: dict) -> Any:
    return (tool.get("function") or {}).get("parameters") or {"type": "object", "properties": {}}


def tool_constraint(r: Any, mode: str, name: str | None, parser: Any = None) -> tuple[str, str] | None:
    """(constraint kind, spec) the output is constrained to for required / named tool_choice:
    the native call format of ``parser`` (a tool-parser class) when it describes one, else
    SGLang's JSON schema."""
    if mode in ("required", "named") and parser is not None:
        tag = parser().structural_tag(r.tools, name if mode == "named" else None,
                                      mode == "required" and r.parallel_tool_calls is not False)
        if tag is not None:
            return "structural_tag", json.dumps(tag)
    if mode == "named":
        tool = next(t for t in r.tools if t["function"]["name"] == name)
        return "json_schema", json.dumps(_params_schema(tool))
    if mode == "required":
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                                   "parameters": _params_schema(t)},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in r.tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if r.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return "json_schema", json.dumps(schema)
    return None


@attrs.frozen
class ToolPlan:
    """How one chat request's tools and reasoning are handled, decided once by :func:`plan_tools`."""

    mode: str  # none / auto / required / named (as the request asked)
    name: str | None = None  # the named function
    constraint: tuple[str, str] | None = None  # (SamplingParams field, spec) the output is constrained to
    tool_parser: Any = None  # the tool-parser class that reads calls out of the output; None: text only
    named_args: bool = False  # named tool_choice under SGLang's schema: the whole output is the arguments
    reasoning_parser: Any = None  # the reasoning-parser class; None: no reasoning_content
    triggered: bool = False  # ``constraint`` holds only the calls (strict tools under auto), not the whole output

    @property
    def hides_tools(self) -> bool:
        """The chat template gets no tools (``tool_choice: "none"`` or none given)."""
        return self.mode == "none"


def _resolve(state: Any, kind: str, name: str, why: str) -> Any:
    try:
        return state.engine.plugins.resolve(kind, name)
    except CoreError as e:
        raise InvalidRequest(f"{why}, but the {kind} {name!r} is not available: {e}", param="tool_choice") from None


@functools.cache
def unforced(parser: Any) -> Any:
    """The reasoning-parser class for an output a grammar held from its first token: reasoning only
    where the output itself opens a think block. A parser whose output starts inside one (the
    prompt opened it: deepseek-r1, qwen3-thinking) would read a constrained answer, which never
    closes a block, as reasoning."""
    if getattr(parser, "force_reasoning", False):
        return type(parser.__name__, (parser,), {"force_reasoning": False})
    return parser


def _native_parser(state: Any) -> Any:
    """The ``--tool-call-parser`` class when it can describe its own format to the grammar
    backend (it has ``structural_tag`` and the backend is xgrammar), else None."""
    tp = state.args.tool_call_parser
    if not tp or state.engine.grammar.name != "xgrammar":
        return None
    cls = state.engine.plugins.resolve("tool_parser", tp)
    return cls if callable(getattr(cls, "structural_tag", None)) else None


def plan_tools(state: Any, r: Any) -> ToolPlan:
    """Validate ``tools`` / ``tool_choice`` and decide the constraint and the parsers."""
    mode, name = tool_mode(r)
    args, plugins = state.args, state.engine.plugins
    reasoning = None
    if args.reasoning_parser and r.separate_reasoning is not False:
        reasoning = plugins.resolve("reasoning_parser", args.reasoning_parser)
    if mode in ("required", "named"):
        native = _native_parser(state)
        constraint = tool_constraint(r, mode, name, native)
        if constraint is not None and constraint[0] == "structural_tag":  # the model's own format: its parser reads it
            return ToolPlan(mode, name, constraint, tool_parser=native, reasoning_parser=reasoning)
        if mode == "named":
            return ToolPlan(mode, name, constraint, named_args=True, reasoning_parser=reasoning)
        parser = _resolve(state, "tool_parser", JSON_ARRAY_PARSER, "tool_choice 'required' is read back as a JSON array")
        return ToolPlan(mode, name, constraint, tool_parser=parser, reasoning_parser=reasoning)
    parser = constraint = None
    if mode == "auto" and args.tool_call_parser and r.tools:
        parser = plugins.resolve("tool_parser", args.tool_call_parser)
    if mode == "auto" and any(t["function"].get("strict") is True for t in r.tools):
        constraint = _strict_auto(state, r)
    return ToolPlan(mode, name, constraint, tool_parser=parser, reasoning_parser=reasoning, triggered=bool(constraint))


def _strict_auto(state: Any, r: Any) -> tuple[str, str] | None:
    """The constraint for ``strict`` tools under ``tool_choice: auto`` (OpenAI: the arguments always
    follow the schema): free text, and every call the parser's format opens is held to its tool's
    schema (xgrammar's triggered tags, as SGLang does). Where the server cannot (another grammar
    backend, a parser without such a format) the calls go unconstrained, as in SGLang, logged once."""
    native = _native_parser(state)
    tag = native().structural_tag(r.tools, None, r.parallel_tool_calls is not False) if native is not None else None
    fmt = (tag or {}).get("format") or {}
    start = getattr(native, "start", "")
    if not start or fmt.get("type") != "tags_with_separator" or not all(
            t.get("begin", "").startswith(start) for t in fmt.get("tags", [])):
        log_ignored_field("request.field_ignored", "tools[].function.strict (no call format to hold calls to)")
        return None
    triggered = {"type": "triggered_tags", "triggers": [start], "tags": fmt["tags"], "at_least_one": False,
                 "stop_after_first": fmt.get("stop_after_first", False)}
    return "structural_tag", json.dumps({"type": "structural_tag", "format": triggered})


def _call_dict(call: ToolCall, index: int, with_id: bool = True) -> dict:
    d: dict[str, Any] = {"index": index}
    if with_id:
        d["id"] = "call_" + uuid.uuid4().hex[:24]
        d["type"] = "function"
    fn: dict[str, Any] = {}
    if call.name:
        fn["name"] = call.name
    fn["arguments"] = call.arguments
    d["function"] = fn
    return d


class _NamedArgs:
    """Named tool_choice under SGLang's JSON constraint: the whole output is the call's arguments,
    streamed as they arrive (the name first)."""

    def __init__(self, name: str | None) -> None:
        self.fn, self.buf, self.started = name or "", "", False

    def parse(self, text: str, tools: Any = None) -> tuple[str, list[ToolCall]]:
        """The output is the call's arguments: a call even when they are not JSON (cut off), as
        the stream sent it (leading whitespace dropped)."""
        if not text.strip():
            return "", []
        try:
            json.loads(text)
        except ValueError:
            return "", [ToolCall(self.fn, text.lstrip(), 0)]
        return "", [ToolCall(self.fn, text.strip(), 0)]

    def parse_streaming(self, delta: str, tools: Any = None) -> tuple[str, list[ToolCall]]:
        out = []
        if not self.started:
            delta = delta.lstrip()
            if not delta:
                return "", []
            self.started = True
            out.append(ToolCall(self.fn, "", 0))
        self.buf += delta
        return "", out + [ToolCall("", delta, 0)]

    def flush(self, tools: Any = None) -> tuple[str, list[ToolCall]]:
        return "", []


class ChoicePost:
    """Turns one choice's text into (reasoning, content, tool calls), whole or streamed, as ``plan`` says."""

    def __init__(self, plan: ToolPlan, r: Any) -> None:
        self.r = r
        self.reasoning = None
        if plan.reasoning_parser is not None:
            self.reasoning = plan.reasoning_parser()
            if hasattr(self.reasoning, "configure"):  # e.g. qwen3 with enable_thinking false
                self.reasoning.configure(getattr(r, "chat_template_kwargs", None) or {})
        self.tools: Any = None
        if plan.named_args:
            self.tools = _NamedArgs(plan.name)
        elif plan.tool_parser is not None:
            self.tools = plan.tool_parser()
            chat_view = getattr(self.tools, "chat_view", None)
            if callable(chat_view):  # one truth: no whitespace around calls, announced calls stand
                chat_view()
        self.n_calls = 0

    def full(self, text: str, reason: str | None) -> tuple[str | None, str | None, list[dict] | None, str | None]:
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.parse(text)
        calls: list[ToolCall] | None = None
        if self.tools is not None:
            text, calls = self.tools.parse(text, self.r.tools)
        if calls and getattr(self.r, "parallel_tool_calls", None) is False:  # one call asked for: the first (as SGLang)
            calls = calls[:1]
        if calls:
            return reasoning, (text or None), [_call_dict(c, i) for i, c in enumerate(calls)], \
                ("tool_calls" if reason == "stop" else reason)
        return reasoning, text, None, reason

    def delta(self, delta: str, finished: bool) -> tuple[str, str, list[dict]]:
        """(reasoning delta, content delta, tool-call deltas in OpenAI's shape)."""
        reasoning = ""
        if self.reasoning is not None:
            reasoning, delta = self.reasoning.parse_streaming(delta)
            if finished:
                r2, c2 = self.reasoning.flush()
                reasoning, delta = reasoning + r2, delta + c2
        out: list[dict] = []
        if self.tools is not None:
            text, calls = self.tools.parse_streaming(delta, self.r.tools)
            if finished:
                t2, c2 = self.tools.flush(self.r.tools)
                text, calls = text + t2, calls + c2
            for c in calls:
                if c.index > 0 and getattr(self.r, "parallel_tool_calls", None) is False:
                    continue
                out.append(_call_dict(c, c.index, with_id=bool(c.name)))
                self.n_calls = max(self.n_calls, c.index + 1)
            delta = text
        return reasoning, delta, out
