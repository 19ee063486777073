"""Tool calls and reasoning in chat completions, plus SGLang's /parse_function_call and /separate_reasoning.

* ``tool_choice``: ``none`` (tools hidden from the template, output is text), ``auto`` (the
  ``--tool-call-parser`` finds calls in the text), ``required`` and ``{"type": "function",
  "function": {"name": ...}}``: the output is constrained through the grammar backend so the
  call always parses and validates. With a ``--tool-call-parser`` whose parser describes its
  format (``structural_tag``) and the xgrammar backend, the constraint is the model's NATIVE
  call format (one or more calls; one when ``parallel_tool_calls`` is false; only the named
  function) with arguments matching each tool's schema, and the parser reads the calls back,
  streamed incrementally. Otherwise, as SGLang does, a JSON array of ``{"name", "parameters"}``
  (one item at most when ``parallel_tool_calls`` is false) or the named function's parameter
  schema; this works with any model and needs no parser, and streams incrementally too.
* With ``--reasoning-parser`` and ``separate_reasoning`` (default true), reasoning goes to
  ``reasoning_content`` (``delta.reasoning_content`` when streaming) and is not searched for calls.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from core.errors import InvalidRequest
from core.interfaces import ToolCall


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequest(message, param=param)


def _tool_names(tools: list[dict] | None) -> list[str]:
    return [(t.get("function") or {}).get("name") for t in tools or [] if isinstance(t, dict)]


def tool_mode(r: Any) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "named", the named function). Validates tools / tool_choice."""
    tools, tc = r.tools, r.tool_choice
    if tools is not None:
        _check(isinstance(tools, list), "tools must be a list", "tools")
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            _check(isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(fn, dict)
                   and isinstance(fn.get("name"), str), f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                   f"tools[{i}]")
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


def native_tool_parser(state: Any) -> Any:
    """The ``--tool-call-parser`` class when required / named tool_choice can use its native format
    (the parser has ``structural_tag`` and the grammar backend is xgrammar), else None."""
    tp = getattr(state.args, "tool_call_parser", None)
    grammar = getattr(state.engine, "grammar", None)
    if not tp or grammar is None or getattr(grammar, "name", None) != "xgrammar":
        return None
    cls = state.engine.plugins.resolve("tool_parser", tp)
    return cls if callable(getattr(cls, "structural_tag", None)) else None


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
        try:
            json.loads(text)
        except ValueError:
            return text, []
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


def _JsonArray() -> Any:
    """Required tool_choice under SGLang's JSON constraint: ``[{"name", "parameters"}, ...]``,
    read (and streamed) by the mistral parser's array scanner without its ``[TOOL_CALLS]`` prefix."""
    from core_plugins.parsers.tools import MistralToolParser

    class JsonArrayToolParser(MistralToolParser):
        def find_start(self, text: str, i: int) -> tuple[int, int]:
            s = len(text) - len(text.lstrip())
            return (s, s) if i == 0 and text[s:s + 1] == "[" else (-1, -1)

        def hold_back(self, text: str, i: int) -> int:
            return len(text) - i if i == 0 and not text.strip() else 0

    return JsonArrayToolParser()


class ChoicePost:
    """Turns one choice's text into (reasoning, content, tool calls), whole or streamed."""

    def __init__(self, state: Any, r: Any, mode: str, name: str | None, native: bool = False) -> None:
        self.r, self.mode, self.name = r, mode, name
        args = state.args
        plugins = state.engine.plugins
        rp = getattr(args, "reasoning_parser", None)
        self.reasoning = None
        if rp and r.separate_reasoning is not False:
            self.reasoning = plugins.resolve("reasoning_parser", rp)()
            if hasattr(self.reasoning, "configure"):  # e.g. qwen3 with enable_thinking false
                self.reasoning.configure(getattr(r, "chat_template_kwargs", None) or {})
        tp = getattr(args, "tool_call_parser", None)
        if native:  # required / named constrained to the parser's own format: it reads the calls back
            self.mode = "auto"
        self.tools = plugins.resolve("tool_parser", tp)() if tp and self.mode == "auto" and r.tools else None
        if self.mode in ("required", "named"):  # SGLang's JSON constraint, streamed incrementally
            self.tools = _NamedArgs(name) if self.mode == "named" else _JsonArray()
        self.n_calls = 0

    def full(self, text: str, reason: str | None) -> tuple[str | None, str | None, list[dict] | None, str | None]:
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.parse(text)
        calls: list[ToolCall] | None = None
        if self.tools is not None:
            text, calls = self.tools.parse(text, self.r.tools)
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
                out.append(_call_dict(c, c.index, with_id=bool(c.name)))
                self.n_calls = max(self.n_calls, c.index + 1)
            delta = text
        return reasoning, delta, out


# ----------------------------------------------------------------------------- native endpoints


async def parse_function_call(request: Any) -> Any:
    """SGLang's /parse_function_call: {text, tool_call_parser, tools} -> {normal_text, calls}."""
    from core.server.openai.api import _state, error_response
    from starlette.responses import JSONResponse

    try:
        body = json.loads(await request.body() or b"null")
        _check(isinstance(body, dict), "the request body must be a JSON object", "body")
        text, parser, tools = body.get("text"), body.get("tool_call_parser"), body.get("tools") or []
        _check(isinstance(text, str), "text must be a string", "text")
        state = _state(request)
        name = parser or getattr(state.args, "tool_call_parser", None)
        _check(isinstance(name, str) and name in state.engine.plugins.names("tool_parser"),
               f"unknown tool_call_parser {name!r}; registered: {', '.join(state.engine.plugins.names('tool_parser'))}",
               "tool_call_parser")
        normal, calls = state.engine.plugins.resolve("tool_parser", name)().parse(text, tools)
        return JSONResponse({"normal_text": normal, "calls": [
            {"tool_index": c.index, "name": c.name, "parameters": c.arguments} for c in calls]})
    except InvalidRequest as e:
        return error_response(400, e.message, param=e.param)
    except ValueError as e:
        return error_response(400, f"the request body is not valid JSON: {e}")


async def separate_reasoning(request: Any) -> Any:
    """SGLang's /separate_reasoning: {text, reasoning_parser} -> {text, reasoning_text}."""
    from core.server.openai.api import _state, error_response
    from starlette.responses import JSONResponse

    try:
        body = json.loads(await request.body() or b"null")
        _check(isinstance(body, dict), "the request body must be a JSON object", "body")
        text, parser = body.get("text"), body.get("reasoning_parser")
        _check(isinstance(text, str), "text must be a string", "text")
        state = _state(request)
        name = parser or getattr(state.args, "reasoning_parser", None)
        names = state.engine.plugins.names("reasoning_parser")
        _check(isinstance(name, str) and name in names, f"unknown reasoning_parser {name!r}; registered: {', '.join(names)}",
               "reasoning_parser")
        reasoning, content = state.engine.plugins.resolve("reasoning_parser", name)().parse(text)
        return JSONResponse({"text": content, "reasoning_text": reasoning})
    except InvalidRequest as e:
        return error_response(400, e.message, param=e.param)
    except ValueError as e:
        return error_response(400, f"the request body is not valid JSON: {e}")


def function_call_routes() -> list:
    from starlette.routing import Route

    return [Route("/parse_function_call", parse_function_call, methods=["POST"]),
            Route("/separate_reasoning", separate_reasoning, methods=["POST"])]
