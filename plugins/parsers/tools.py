"""Tool-call parsers, one class per model family, registered under SGLang's --tool-call-parser names.

Every parser is a scanner over the whole output so far: ``_scan(text, final)`` returns the
normal text that is already certain and the calls seen, each keyed by where its block starts:
complete ones, and (while streaming) the one still being written, with its name once known and
the prefix of its arguments so far. ``parse`` is one final scan; ``parse_streaming`` rescans the
buffer and sends what is new: normal text, each call's name once (as soon as it is known), then
argument fragments. JSON-argument formats stream the raw argument text as it arrives (holding
back only what could begin the closing tag) and return that raw text as the final arguments;
parameter formats (qwen3_coder, glm45, pythonic) send ``{"key": value`` per completed parameter
and the closing ``}`` with the call, building ``json.dumps`` of the final arguments. So a stream
split anywhere yields the same calls (argument fragments concatenating to the final arguments)
as ``parse``. A block that does not parse (malformed JSON) stays normal text; a call to a function
not in ``tools`` is dropped, as in SGLang. A call already announced in a stream cannot be
withdrawn if its block later turns out malformed (its fragments stop; the block text is also sent
as normal text).

``chat_view()`` switches a parser to what a chat reply needs (core's ``ChoicePost`` calls it;
``/parse_function_call`` keeps SGLang's reading): a call is one truth, streamed or whole.
Whitespace touching a call block is not normal text (a stream holds trailing whitespace until it
knows whether a call follows), and an output that ends inside calls the stream announced (cut
off by max_tokens, or stopped) keeps them as calls with their arguments so far, never as text.

``structural_tag(tools, name, parallel)`` describes the native call format as an xgrammar
structural tag (arguments constrained by each tool's parameter schema), used for
``tool_choice`` required / named. The XML parameter formats use xgrammar's ``qwen_xml`` /
``glm_xml`` JSON-schema styles (string values raw, others JSON), and their parsers read values
back by the tool's schema (a string-typed parameter stays a string even if it looks like a number).
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from core.interfaces import ToolCall

_DEC = json.JSONDecoder()
_WS = " \t\n\r"

# A scanned call: (key, name, arguments, complete). ``key`` identifies the call across rescans
# (block start, position in the block); ``arguments`` is the full JSON text when complete, else
# the prefix known so far.
Entry = tuple[tuple[int, int], str, str, bool]


class Incomplete(Exception):
    """The block may still complete with more text."""


def _partial_suffix(text: str, token: str) -> int:
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0


def _args_json(args: Any) -> str:
    if isinstance(args, str):
        json.loads(args)  # must already be JSON text
        return args
    if not isinstance(args, dict):
        raise ValueError("arguments must be an object")
    return json.dumps(args, ensure_ascii=False)


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _value_end(text: str, i: int, stops: str = ",}] \t\n\r;") -> int | None:
    """End of the JSON value starting at ``text[i]``; None while it may still grow (not a validator)."""
    n = len(text)
    if i >= n:
        return None
    c = text[i]
    if c in '"{[':
        depth, j, in_str = 0, i, False
        while j < n:
            ch = text[j]
            if in_str:
                if ch == "\\":
                    j += 2
                    continue
                if ch == '"':
                    in_str = False
                    if depth == 0:
                        return j + 1
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < n and text[j] not in stops:
        j += 1
    return j if j < n else None


def _object_members(text: str, i: int) -> tuple[list[tuple[str, int, int | None]], int | None]:
    """Members (key, value start, value end or None) of the JSON object at ``text[i]`` seen so far,
    and the object's end (None while incomplete). ValueError when it cannot be an object."""
    n = len(text)
    if text[i:i + 1] != "{":
        raise ValueError("not an object")
    members: list[tuple[str, int, int | None]] = []
    j = _skip_ws(text, i + 1)
    if j < n and text[j] == "}":
        return members, j + 1
    while True:
        if j >= n:
            return members, None
        if text[j] != '"':
            raise ValueError("expected a key")
        kend = _value_end(text, j)
        if kend is None:
            return members, None
        key = json.loads(text[j:kend])
        j = _skip_ws(text, kend)
        if j >= n:
            return members, None
        if text[j] != ":":
            raise ValueError("expected ':'")
        j = _skip_ws(text, j + 1)
        vend = _value_end(text, j)
        members.append((key, j, vend))
        if vend is None:
            return members, None
        j = _skip_ws(text, vend)
        if j >= n:
            return members, None
        if text[j] == ",":
            j = _skip_ws(text, j + 1)
            continue
        if text[j] == "}":
            return members, j + 1
        raise ValueError("expected ',' or '}'")


_ARG_KEYS = ("arguments", "parameters")


def _obj_call(text: str, i: int) -> tuple[str | None, str, int | None]:
    """A ``{"name": ..., "arguments"|"parameters": {...}}`` object at ``text[i]``: (name or None while
    unknown, arguments (raw JSON text; a prefix while incomplete), object end or None)."""
    members, end = _object_members(text, i)
    if end is not None:
        obj = json.loads(text[i:end])
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ValueError("a call needs a name")
        key = next((k for k in _ARG_KEYS if k in obj), None)
        if key is None:
            return obj["name"], "{}", end
        if isinstance(obj[key], dict):
            vs, ve = [(a, b) for k, a, b in members if k == key][-1]
            return obj["name"], text[vs:ve], end
        return obj["name"], _args_json(obj[key]), end
    name = None
    for k, vs, ve in members:
        if k == "name" and ve is not None:
            v = json.loads(text[vs:ve])
            name = v if isinstance(v, str) else None
    args = ""
    for k, vs, ve in members:
        if k in _ARG_KEYS:
            if text[vs:vs + 1] == "{":
                args = text[vs:ve if ve is not None else len(text)]
            break
    return name, args, None


def _raw_args(s: str) -> str:
    """The final arguments of a block whose arguments are JSON text ``s`` (raw, so that it extends
    what ``_args_prefix`` streamed)."""
    s = s.strip()
    obj = json.loads(s)
    return s if isinstance(obj, dict) else _args_json(obj)


def _args_prefix(s: str) -> str:
    """The streamable prefix of JSON arguments text ``s`` still being written."""
    s = s.lstrip()
    if not s.startswith("{"):
        return ""
    e = _value_end(s, 0)
    return s if e is None else s[:e]


def _kv(key: str, value: Any) -> str:
    return json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)


def _params_json(pairs: list[tuple[str, Any]], complete: bool) -> str:
    """``json.dumps`` of the object built from ``pairs``, or its prefix up to the last pair."""
    if complete:
        return json.dumps(dict(pairs), ensure_ascii=False)
    return "{" + ", ".join(_kv(k, v) for k, v in pairs)


def _tools_of(tools: list[dict] | None) -> list[tuple[str, dict]]:
    out = []
    for t in tools or []:
        fn = (t.get("function") or {}) if isinstance(t, dict) else {}
        if isinstance(fn.get("name"), str):
            out.append((fn["name"], fn.get("parameters") or {"type": "object", "properties": {}}))
    return out


def _tag(begin: str, schema: dict, end: str, style: str = "json") -> dict:
    content = {"type": "json_schema", "json_schema": schema}
    if style != "json":
        content["style"] = style  # xgrammar's XML parameter styles (qwen_xml, glm_xml)
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _structural(fmt: dict) -> dict:
    return {"type": "structural_tag", "format": fmt}


def _calls(tags: list[dict], sep: str, parallel: bool) -> dict:
    return {"type": "tags_with_separator", "tags": tags, "separator": sep, "at_least_one": True,
            "stop_after_first": not parallel}


class BaseToolParser:
    start = ""  # opening token of a call block
    end: str | None = None  # closing token; None: the block ends where its JSON / syntax completes
    drop: tuple[str, ...] = ()  # wrapper tokens removed from normal text

    def __init__(self) -> None:
        self.buf = ""
        self.sent_normal = 0
        self.streamed: dict[tuple[int, int], list] = {}  # key -> [index, arguments sent]
        self.schemas: dict[str, dict] = {}  # tool name -> parameter schema (for parameter formats)
        self.chat = False  # the chat view (see chat_view)

    # ---- per format
    def parse_block(self, inner: str) -> list[tuple[str, str]]:
        """(name, JSON arguments) of one closed block; ValueError when malformed."""
        raise NotImplementedError

    def partial_block(self, inner: str) -> list[tuple[str, str, bool]]:
        """While a block with an end token is open: (name, arguments so far, complete) of the calls
        whose name is known; arguments must be a prefix of what ``parse_block`` returns later."""
        return []

    def parse_open(self, text: str, pos: int, final: bool) -> tuple[list[tuple[str, str]], int]:
        """For blocks without an end token: calls and the end position; Incomplete / ValueError."""
        raise NotImplementedError

    def partial_open(self, text: str, pos: int) -> list[tuple[str, str, bool]]:
        """``partial_block`` for blocks without an end token (``parse_open`` said Incomplete)."""
        return []

    def find_start(self, text: str, i: int) -> tuple[int, int]:
        """(block start, body start) of the next block at or after ``i``, or (-1, -1)."""
        j = text.find(self.start, i)
        return (j, j + len(self.start)) if j >= 0 else (-1, -1)

    def hold_back(self, text: str, i: int) -> int:
        """How many trailing characters of text[i:] might begin a block (not yet normal text)."""
        return max([_partial_suffix(text[i:], t) for t in (self.start, *self.drop) if t] + [0])

    def structural_tag(self, tools: list[dict], name: str | None = None, parallel: bool = True) -> dict | None:
        """An xgrammar structural tag (``{"type": "structural_tag", "format": ...}``) matching one or
        more calls (exactly one of function ``name`` when given) in this format, arguments
        constrained by each tool's parameter schema; None when the format has no description."""
        return None

    def _tools(self, tools: list[dict], name: str | None) -> list[tuple[str, dict]]:
        return [(n, s) for n, s in _tools_of(tools) if name is None or n == name]

    # ---- scanner
    def _scan(self, text: str, final: bool) -> tuple[str, list[Entry]]:
        normal: list[str | None] = []  # normal text pieces; None where a block was read as calls
        calls: list[Entry] = []
        i = 0

        def add(j: int, found: list, complete: bool = True) -> None:
            if found:
                normal.append(None)
            for k, c in enumerate(found):
                calls.append(((j, k), c[0], c[1], c[2] if len(c) > 2 else complete))

        while True:
            j, body = self.find_start(text, i)
            if j < 0:
                tail = text[i:]
                normal.append(tail if final else tail[: len(tail) - self.hold_back(text, i)])
                break
            normal.append(text[i:j])
            if self.end is not None:
                k = text.find(self.end, body)
                if k < 0:
                    if final:
                        try:
                            add(j, self.parse_block(text[body:]))
                        except (ValueError, TypeError, KeyError, SyntaxError):
                            normal.append(text[j:])
                    else:
                        inner = text[body:]
                        try:
                            add(j, self.partial_block(inner[: len(inner) - _partial_suffix(inner, self.end)]))
                        except (ValueError, TypeError, KeyError, SyntaxError):
                            pass
                    break
                nxt = k + len(self.end)
                try:
                    add(j, self.parse_block(text[body:k]))
                except (ValueError, TypeError, KeyError, SyntaxError):
                    normal.append(text[j:nxt])
                i = nxt
                continue
            try:
                found, nxt = self.parse_open(text, body, final)
            except Incomplete:
                if final:
                    normal.append(text[j:])
                else:
                    try:
                        add(j, self.partial_open(text, body))
                    except (ValueError, TypeError, KeyError, SyntaxError):
                        pass
                break
            except (ValueError, TypeError, KeyError, SyntaxError):
                if not final:
                    try:
                        add(j, self.partial_open(text, body))
                    except (ValueError, TypeError, KeyError, SyntaxError):
                        pass
                    break  # cannot tell malformed from unfinished before the end: hold it
                normal.append(text[j:])
                break
            add(j, found)
            i = nxt
        return self._join(normal, final), calls

    def _join(self, parts: list[str | None], final: bool) -> str:
        """The normal text of a scan's pieces (None: a call block), wrapper tokens removed. In the
        chat view the whitespace touching a call goes (text on both sides of calls is a line apart,
        not glued), and while streaming trailing whitespace is held back: a call may follow it."""
        if not self.chat:
            out = "".join(p for p in parts if p is not None)
            for d in self.drop:
                out = out.replace(d, "")
            return out
        segments, cur = [], ""
        for p in parts:
            if p is None:
                segments.append(cur)
                cur = ""
            else:
                cur += p
        segments.append(cur)
        out = ""
        for k, seg in enumerate(segments):
            for d in self.drop:
                seg = seg.replace(d, "")
            if k:
                seg = seg.lstrip()
            if k < len(segments) - 1 or not final:
                seg = seg.rstrip()
            if k and out and seg:
                out += "\n"
            out += seg
        return out

    @staticmethod
    def _names(tools: list[dict] | None) -> set:
        return {(t.get("function") or {}).get("name") for t in tools or [] if isinstance(t, dict)}

    # ---- ToolParser
    def _use_tools(self, tools: list[dict] | None) -> None:
        if tools:
            self.schemas = dict(_tools_of(tools))

    def _prop(self, name: str, key: str) -> dict | None:
        """The schema of parameter ``key`` of tool ``name``, when the tools say."""
        props = (self.schemas.get(name) or {}).get("properties")
        return props.get(key) if isinstance(props, dict) and isinstance(props.get(key), dict) else None

    def parse(self, text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCall]]:
        self._use_tools(tools)
        normal, calls = self._end_scan(text)
        names = self._names(tools)
        calls = [c for c in calls if not names or c[1] in names]
        return normal, [ToolCall(n, a, i) for i, (_, n, a, _) in enumerate(calls)]

    def parse_streaming(self, delta: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCall]]:
        self._use_tools(tools)
        self.buf += delta
        return self._emit(*self._scan(self.buf, False), tools)

    def flush(self, tools: list[dict] | None = None) -> tuple[str, list[ToolCall]]:
        self._use_tools(tools)
        return self._emit(*self._end_scan(self.buf), tools)

    def chat_view(self) -> None:
        """Read as a chat reply does from now on (see the module's docstring): no whitespace
        around calls in the normal text, and announced calls stand when the output ends in them."""
        self.chat = True

    def _end_scan(self, text: str) -> tuple[str, list[Entry]]:
        """The scan of a whole output. In the chat view, when it ends inside calls a stream
        announced that the final scan does not read (their block never closed), the streaming
        view, so that those calls stand with their arguments so far."""
        final = self._scan(text, True)
        if not self.chat:
            return final
        view = self._scan(text, False)
        read = {key for key, *_ in final[1]}
        return view if any(key not in read for key, *_ in view[1]) else final

    def _emit(self, normal: str, calls: list[Entry], tools: list[dict] | None) -> tuple[str, list[ToolCall]]:
        text = normal[self.sent_normal:]
        self.sent_normal = max(self.sent_normal, len(normal))
        names = self._names(tools)
        out = []
        for key, name, args, _ in calls:
            if names and name not in names:
                continue
            st = self.streamed.get(key)
            if st is None:
                st = self.streamed[key] = [len(self.streamed), ""]
                out.append(ToolCall(name, "", st[0]))
            if len(args) > len(st[1]) and args.startswith(st[1]):
                out.append(ToolCall("", args[len(st[1]):], st[0]))
                st[1] = args
        return text, out


class Qwen25ToolParser(BaseToolParser):
    """Hermes style (Qwen2.5, Qwen3): <tool_call>{"name": ..., "arguments": {...}}</tool_call>."""

    start, end = "<tool_call>", "</tool_call>"

    def parse_block(self, inner: str) -> list[tuple[str, str]]:
        s = inner.strip()
        name, args, end = _obj_call(s, 0)
        if end != len(s) or name is None:
            raise ValueError("not one call object")
        return [(name, args)]

    def partial_block(self, inner: str) -> list[tuple[str, str, bool]]:
        j = _skip_ws(inner, 0)
        if j >= len(inner):
            return []
        name, args, end = _obj_call(inner, j)
        return [] if name is None else [(name, args, False)]

    def structural_tag(self, tools, name=None, parallel=True):
        tags = [_tag('<tool_call>\n{"name": ' + json.dumps(n) + ', "arguments": ', s, "}\n</tool_call>")
                for n, s in self._tools(tools, name)]
        return _structural(_calls(tags, "\n", parallel))


class DeepSeekV3ToolParser(BaseToolParser):
    """<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"""

    start, end = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    drop = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
    _re = re.compile(r"^\s*(?:function)?<｜tool▁sep｜>([^\n]+)\n```(?:json)?\s*\n?(.*?)\n?```\s*$", re.S)
    _head = re.compile(r"^\s*(?:function)?<｜tool▁sep｜>([^\n]+)\n```(?:json)?[ \t]*\n")

    def parse_block(self, inner: str) -> list[tuple[str, str]]:
        m = self._re.match(inner)
        if m is None:
            raise ValueError("not a DeepSeek-V3 call")
        return [(m.group(1).strip(), _raw_args(m.group(2)))]

    def partial_block(self, inner: str) -> list[tuple[str, str, bool]]:
        m = self._head.match(inner)
        return [(m.group(1).strip(), _args_prefix(inner[m.end():]), False)] if m else []

    def structural_tag(self, tools, name=None, parallel=True):
        tags = [_tag("<｜tool▁call▁begin｜>function<｜tool▁sep｜>" + n + "\n```json\n", s, "\n```<｜tool▁call▁end｜>")
                for n, s in self._tools(tools, name)]
        return _structural({"type": "sequence", "elements": [
            {"type": "const_string", "value": "<｜tool▁calls▁begin｜>"}, _calls(tags, "\n", parallel),
            {"type": "const_string", "value": "<｜tool▁calls▁end｜>"}]})


class _NameArgsToolParser(BaseToolParser):
    """A block whose whole text is matched by ``_re``: group 1 the name, group 2 the JSON arguments."""

    label = ""
    _re: re.Pattern

    def parse_block(self, inner: str) -> list[tuple[str, str]]:
        m = self._re.match(inner)
        if m is None:
            raise ValueError(f"not a {self.label} call")
        return [(m.group(1), _raw_args(m.group(2)))]

    def partial_block(self, inner: str) -> list[tuple[str, str, bool]]:
        m = self._re.match(inner)
        return [(m.group(1), _args_prefix(m.group(2)), False)] if m else []


class KimiK2ToolParser(_NameArgsToolParser):
    """<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}<|tool_call_end|>..."""

    start, end = "<|tool_call_begin|>", "<|tool_call_end|>"
    drop = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
    label = "Kimi-K2"
    _re = re.compile(r"^\s*(?:functions\.)?([\w.\-]+?)(?::\d+)?\s*<\|tool_call_argument_begin\|>(.*)$", re.S)

    def structural_tag(self, tools, name=None, parallel=True):
        tags = [_tag("<|tool_call_begin|>functions." + n + f":{k}<|tool_call_argument_begin|>", s, "<|tool_call_end|>")
                for k, (n, s) in enumerate(self._tools(tools, name))]
        return _structural({"type": "sequence", "elements": [
            {"type": "const_string", "value": "<|tool_calls_section_begin|>"}, _calls(tags, "", parallel),
            {"type": "const_string", "value": "<|tool_calls_section_end|>"}]})


def _coerce(value: str, schema: dict | None) -> Any:
    """A parameter value as written in an XML-style call: the text itself for a string-typed
    parameter (so ``"123"`` stays a string), else JSON (or a Python literal), else the text."""
    v = value.strip("\n")
    typ = (schema or {}).get("type")
    if typ == "string":
        return v
    try:
        return json.loads(v)
    except ValueError:
        try:
            return ast.literal_eval(v)
        except (ValueError, SyntaxError):
            return v


class Qwen3CoderToolParser(BaseToolParser):
    """<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>"""

    start, end = "<tool_call>", "</tool_call>"
    _fn = re.compile(r"^\s*<function=([^>\n]+)>(.*?)</function>\s*$", re.S)
    _fn_head = re.compile(r"^\s*<function=([^>\n]+)>")
    _param = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)

    def _pairs(self, name: str, body: str) -> list[tuple[str, Any]]:
        return [(k.strip(), _coerce(v, self._prop(name, k.strip()))) for k, v in self._param.findall(body)]

    def parse_block(self, inner: str) -> list[tuple[str, str]]:
        m = self._fn.match(inner)
        if m is None:
            raise ValueError("not a Qwen3-Coder call")
        name = m.group(1).strip()
        return [(name, _params_json(self._pairs(name, m.group(2)), True))]

    def partial_block(self, inner: str) -> list[tuple[str, str, bool]]:
        m = self._fn_head.match(inner)
        if m is None:
            return []
        name, body = m.group(1).strip(), inner[m.end():].split("</function>", 1)[0]
        return [(name, _params_json(self._pairs(name, body), False), False)]

    def structural_tag(self, tools, name=None, parallel=True):
        """Each parameter as ``<parameter=KEY>\\nVALUE\\n</parameter>`` (xgrammar's ``qwen_xml``
        style: string values raw, others JSON), in the schema's property order."""
        tags = [_tag("<tool_call>\n<function=" + n + ">\n", s, "\n</function>\n</tool_call>", "qwen_xml")
                for n, s in self._tools(tools, name)]
        return _structural(_calls(tags, "\n", parallel))


class Glm45ToolParser(BaseToolParser):
    """<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>"""

    start, end = "<tool_call>", "</tool_call>"
    _kv = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
    _head = re.compile(r"^\s*([\w.\-]+)[ \t]*(?:\n|<arg_key>)")

    def _pairs(self, name: str, inner: str) -> list[tuple[str, Any]]:
        return [(k.strip(), _coerce(v, self._prop(name, k.strip()))) for k, v in self._kv.findall(inner)]

    def parse_block(self, inner: str) -> list[tuple[str, str]]:
        name = inner.strip().split("\n", 1)[0].split("<arg_key>", 1)[0].strip()
        if not name or not re.fullmatch(r"[\w.\-]+", name):
            raise ValueError("not a GLM-4.5 call")
        return [(name, _params_json(self._pairs(name, inner), True))]

    def partial_block(self, inner: str) -> list[tuple[str, str, bool]]:
        m = self._head.match(inner)
        return [(m.group(1), _params_json(self._pairs(m.group(1), inner), False), False)] if m else []

    def structural_tag(self, tools, name=None, parallel=True):
        """``<tool_call>NAME`` then each parameter as ``<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>``
        (xgrammar's ``glm_xml`` style: string values raw, others JSON; newlines between allowed),
        in the schema's property order."""
        tags = [_tag("<tool_call>" + n, s, "</tool_call>", "glm_xml") for n, s in self._tools(tools, name)]
        return _structural(_calls(tags, "\n", parallel))


class GptOssToolParser(_NameArgsToolParser):
    """harmony: <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>"""

    start, end = "<|channel|>commentary to=", "<|call|>"
    drop = ("<|start|>assistant",)
    label = "gpt-oss"
    reads_special_tokens = True  # the channel markers are special tokens
    _re = re.compile(r"^(?:functions\.)?([\w.\-]+)\s*(?:<\|constrain\|>\s*json)?\s*<\|message\|>(.*)$", re.S)

    def structural_tag(self, tools, name=None, parallel=True):
        tags = [_tag("<|channel|>commentary to=functions." + n + " <|constrain|>json<|message|>", s, "<|call|>")
                for n, s in self._tools(tools, name)]
        return _structural(_calls(tags, "", parallel))


def _json_objects(text: str, pos: int, final: bool, sep: str) -> tuple[list[tuple[Any, int]], int]:
    """Consecutive JSON values (value, start) separated by ``sep`` from ``pos``; Incomplete if more may come."""
    objs = []
    n = len(text)
    while True:
        while pos < n and text[pos].isspace():
            pos += 1
        if pos >= n:
            if not objs or not final:
                raise Incomplete()
            return objs, pos
        try:
            obj, end = _DEC.raw_decode(text, pos)
        except ValueError:
            if not final:
                raise Incomplete() from None
            if objs:
                return objs, pos
            raise
        objs.append((obj, pos))
        pos = end
        k = pos
        while k < n and text[k].isspace():
            k += 1
        if sep and k < n and text[k] == sep:
            pos = k + 1
            continue
        if sep and k >= n and not final:
            raise Incomplete()  # another call may follow the separator
        return objs, pos


def _obj_calls(text: str, objs: list[tuple[Any, int]]) -> list[tuple[str, str]]:
    out = []
    for _, start in objs:
        name, args, end = _obj_call(text, start)
        if name is None or end is None:
            raise ValueError("a call needs a name")
        out.append((name, args))
    return out


def _partial_objs(text: str, j: int, sep: str, close: str = "") -> list[tuple[str, str, bool]]:
    """Calls of consecutive ``sep``-separated call objects from ``j`` while the block is open."""
    out = []
    while True:
        j = _skip_ws(text, j)
        if j >= len(text) or text[j] != "{":
            return out
        name, args, end = _obj_call(text, j)
        if name is None:
            return out
        out.append((name, args, end is not None))
        if end is None:
            return out
        j = _skip_ws(text, end)
        if text[j:j + 1] != sep:
            return out
        j += 1


class Llama3ToolParser(BaseToolParser):
    """Llama 3.1/3.2 JSON calls: <|python_tag|>{"name": ..., "parameters": {...}} (or a bare JSON
    object at the start of the output); several separated by ';'."""

    start = "<|python_tag|>"

    def find_start(self, text: str, i: int) -> tuple[int, int]:
        if i == 0:
            s = len(text) - len(text.lstrip())
            if text[s:s + 1] == "{":
                return s, s
        return super().find_start(text, i)

    def hold_back(self, text: str, i: int) -> int:
        if i == 0 and not text.strip():
            return len(text)
        return super().hold_back(text, i)

    def parse_open(self, text: str, pos: int, final: bool) -> tuple[list[tuple[str, str]], int]:
        objs, end = _json_objects(text, pos, final, ";")
        return _obj_calls(text, objs), end

    def partial_open(self, text: str, pos: int) -> list[tuple[str, str, bool]]:
        return _partial_objs(text, pos, ";")

    def structural_tag(self, tools, name=None, parallel=True):
        tags = [_tag('{"name": ' + json.dumps(n) + ', "parameters": ', s, "}") for n, s in self._tools(tools, name)]
        return _structural(_calls(tags, "; ", parallel))


class MistralToolParser(BaseToolParser):
    """[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...] (or the newer [TOOL_CALLS]NAME[ARGS]{...})."""

    start = "[TOOL_CALLS]"
    _named = re.compile(r"\s*([\w.\-]+)\[ARGS\]")

    def parse_open(self, text: str, pos: int, final: bool) -> tuple[list[tuple[str, str]], int]:
        m = self._named.match(text, pos)
        if m is not None:
            objs, end = _json_objects(text, m.end(), final, "")
            return [(m.group(1), _raw_args(text[objs[0][1]:end]))], end
        if not text[pos:].strip() or re.fullmatch(r"\s*[\w.\-]*(\[A?R?G?S?)?", text[pos:]):
            if not final:
                raise Incomplete()
        objs, end = _json_objects(text, pos, final, "")
        obj, start = objs[0]
        if not isinstance(obj, list):
            return _obj_calls(text, [(obj, start)]), end
        starts, j = [], _skip_ws(text, start + 1)  # the item objects' positions in the array
        for _ in obj:
            starts.append((None, j))
            j = _skip_ws(text, _skip_ws(text, _value_end(text, j) or j) + 1)
        return _obj_calls(text, starts), end

    def partial_open(self, text: str, pos: int) -> list[tuple[str, str, bool]]:
        m = self._named.match(text, pos)
        if m is not None:
            return [(m.group(1), _args_prefix(text[m.end():]), False)]
        j = _skip_ws(text, pos)
        if text[j:j + 1] == "[":
            return _partial_objs(text, j + 1, ",")
        return _partial_objs(text, j, "")

    def structural_tag(self, tools, name=None, parallel=True):
        tags = [_tag('{"name": ' + json.dumps(n) + ', "arguments": ', s, "}") for n, s in self._tools(tools, name)]
        return _structural({"type": "sequence", "elements": [
            {"type": "const_string", "value": "[TOOL_CALLS] ["}, _calls(tags, ", ", parallel),
            {"type": "const_string", "value": "]"}]})


def _py_value_end(text: str, i: int) -> int | None:
    """Index of the ',' or ')' ending the Python literal at ``text[i]``; None while incomplete."""
    depth, j, quote = 0, i, ""
    while j < len(text):
        ch = text[j]
        if quote:
            if ch == "\\":
                j += 2
                continue
            if ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                return j if ch == ")" else None
            depth -= 1
        elif ch == "," and depth == 0:
            return j
        j += 1
    return None


_PY_SCALARS = {"string": r'"\"" ([^"\\\\\n] | "\\\\" [^\n])* "\""', "integer": '"-"? [0-9]+',
               "number": '"-"? [0-9]+ ("." [0-9]+)? ([eE] [-+]? [0-9]+)?', "boolean": '"True" | "False"', "null": '"None"'}


def _py_lit(v: Any) -> str:
    """An EBNF string matching the Python literal of ``v`` (strings double-quoted, JSON-style)."""
    return json.dumps(json.dumps(v, ensure_ascii=False) if isinstance(v, str) else repr(v), ensure_ascii=False)


def _py_value_rule(schema: dict) -> str:
    if "enum" in schema:
        return " | ".join(_py_lit(v) for v in schema["enum"]) or '"None"'
    if "const" in schema:
        return _py_lit(schema["const"])
    typ = schema.get("type")
    if isinstance(typ, list):
        return " | ".join(f"({_py_value_rule({**schema, 'type': t})})" for t in typ)
    if typ in _PY_SCALARS:
        return _PY_SCALARS[typ]
    if typ == "array":
        item = _py_value_rule(schema.get("items") or {})
        return f'"[" ws (({item}) (ws "," ws ({item}))*)? ws "]"'
    return "pyval"


class PythonicToolParser(BaseToolParser):
    """Pythonic calls (Llama 4, Llama 3.2 pythonic): [get_weather(city="Paris"), get_time()]."""

    _start = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
    _partial = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?$")
    _call = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")
    _kw = re.compile(r"\s*([A-Za-z_]\w*)\s*=\s*")

    def find_start(self, text: str, i: int) -> tuple[int, int]:
        m = self._start.search(text, i)
        return (m.start(), m.start()) if m else (-1, -1)

    def hold_back(self, text: str, i: int) -> int:
        m = self._partial.search(text, i)
        return len(text) - m.start() if m else 0

    def parse_open(self, text: str, pos: int, final: bool) -> tuple[list[tuple[str, str]], int]:
        k = pos
        while True:
            k = text.find("]", k + 1)
            if k < 0:
                raise Incomplete()
            try:
                tree = ast.parse(text[pos:k + 1], mode="eval").body
            except SyntaxError:
                continue
            if not isinstance(tree, ast.List) or not all(isinstance(e, ast.Call) for e in tree.elts):
                raise ValueError("not a list of calls")
            calls = []
            for call in tree.elts:
                name = ast.unparse(call.func)
                pairs = [(kw.arg, ast.literal_eval(kw.value)) for kw in call.keywords if kw.arg]
                calls.append((name, _params_json(pairs, True)))
            return calls, k + 1

    def partial_open(self, text: str, pos: int) -> list[tuple[str, str, bool]]:
        out = []
        j = pos + 1
        while True:
            m = self._call.match(text, j)
            if m is None:
                return out
            name, j, pairs, closed = m.group(1), m.end(), [], False
            while True:
                j = _skip_ws(text, j)
                if text[j:j + 1] == ")":
                    closed, j = True, j + 1
                    break
                kw = self._kw.match(text, j)
                if kw is None:
                    break
                vend = _py_value_end(text, kw.end())
                if vend is None:
                    break
                try:
                    pairs.append((kw.group(1), ast.literal_eval(text[kw.end():vend].strip())))
                except (ValueError, SyntaxError):
                    break
                j = vend + 1 if text[vend] == "," else vend
            out.append((name, _params_json(pairs, closed), closed))
            j = _skip_ws(text, j)
            if not closed or text[j:j + 1] != ",":
                return out
            j += 1

    def structural_tag(self, tools, name=None, parallel=True):
        """Keyword arguments: the schema's required properties in order, each value a Python literal
        of the property's type (or enum); numeric ranges and string patterns are not enforced."""
        calls = []
        for n, s in self._tools(tools, name):
            props, req = s.get("properties") or {}, s.get("required") or []
            kws = [f'"{k}=" ({_py_value_rule(props.get(k) or {})})' for k in req if re.fullmatch(r"[A-Za-z_]\w*", k)]
            calls.append(json.dumps(n + "(") + "".join((' ", " ' if i else " ") + kw for i, kw in enumerate(kws)) + ' ")"')
        call = " | ".join(f"({c})" for c in calls)
        more = f' (", " ({call}))*' if parallel else ""
        ebnf = (f'root ::= "[" ({call}){more} "]"\n'
                'ws ::= [ \\n]*\n'
                'pyval ::= ' + _PY_SCALARS["string"] + ' | ' + _PY_SCALARS["number"] + ' | "True" | "False" | "None"'
                ' | "[" ws (pyval (ws "," ws pyval)*)? ws "]"'
                ' | "{" ws (' + _PY_SCALARS["string"] + ' ws ":" ws pyval (ws "," ws ' + _PY_SCALARS["string"] + ' ws ":" ws pyval)*)? ws "}"\n')
        return _structural({"type": "grammar", "grammar": ebnf})
