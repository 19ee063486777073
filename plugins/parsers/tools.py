"""Tool-call parsers, one class per model family, registered under SGLang's --tool-call-parser names.

Every parser is a scanner over the whole output so far: ``_scan(text, final)`` returns the
normal text that is already certain and the calls whose block is complete. ``parse`` is one
final scan; ``parse_streaming`` rescans the buffer and sends what is new (normal text, then
for each newly completed call its name once and its arguments as one JSON fragment), and
``flush`` does the final scan at the end of the stream. So a stream split anywhere yields the
same calls as ``parse``. A block that does not parse (malformed JSON) stays normal text;
a call to a function not in ``tools`` is dropped, as in SGLang.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from core.interfaces import ToolCall

_DEC = json.JSONDecoder()


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


class BaseToolParser:
    start = ""  # opening token of a call block
    end: str | None = None  # closing token; None: the block ends where its JSON / syntax completes
    drop: tuple[str, ...] = ()  # wrapper tokens removed from normal text

    def __init__(self) -> None:
        self.buf = ""
        self.sent_normal = 0
        self.sent_calls = 0

    # ---- per format
    def parse_block(self, inner: str) -> list[tuple[str, str]]:
        """(name, JSON arguments) of one closed block; ValueError when malformed."""
        raise NotImplementedError

    def parse_open(self, text: str, pos: int, final: bool) -> tuple[list[tuple[str, str]], int]:
        """For blocks without an end token: calls and the end position; Incomplete / ValueError."""
        raise NotImplementedError

    def find_start(self, text: str, i: int) -> tuple[int, int]:
        """(block start, body start) of the next block at or after ``i``, or (-1, -1)."""
        j = text.find(self.start, i)
        return (j, j + len(self.start)) if j >= 0 else (-1, -1)

    def hold_back(self, text: str, i: int) -> int:
        """How many trailing characters of text[i:] might begin a block (not yet normal text)."""
        return max([_partial_suffix(text[i:], t) for t in (self.start, *self.drop) if t] + [0])

    # ---- scanner
    def _scan(self, text: str, final: bool) -> tuple[str, list[tuple[str, str]]]:
        normal: list[str] = []
        calls: list[tuple[str, str]] = []
        i = 0
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
                            calls.extend(self.parse_block(text[body:]))
                        except (ValueError, TypeError, KeyError, SyntaxError):
                            normal.append(text[j:])
                    break
                nxt = k + len(self.end)
                try:
                    calls.extend(self.parse_block(text[body:k]))
                except (ValueError, TypeError, KeyError, SyntaxError):
                    normal.append(text[j:nxt])
                i = nxt
                continue
            try:
                found, nxt = self.parse_open(text, body, final)
            except Incomplete:
                if final:
                    normal.append(text[j:])
                break
            except (ValueError, TypeError, KeyError, SyntaxError):
                if not final:
                    break  # cannot tell malformed from unfinished before the end: hold it
                normal.append(text[j:])
                break
            calls.extend(found)
            i = nxt
        out = "".join(normal)
        for d in self.drop:
            out = out.replace(d, "")
        return out, calls

    def _filter(self, calls: list[tuple[str, str]], tools: list[dict] | None) -> list[tuple[str, str]]:
        names = {(t.get("function") or {}).get("name") for t in tools or [] if isinstance(t, dict)}
        return [c for c in calls if not names or c[0] in names]

    # ---- ToolParser
    def parse(self, text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCall]]:
        normal, calls = self._scan(text, True)
        calls = self._filter(calls, tools)
        return normal, [ToolCall(n, a, i) for i, (n, a) in enumerate(calls)]

    def parse_streaming(self, delta: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCall]]:
        self.buf += delta
        return self._emit(*self._scan(self.buf, False), tools)

    def flush(self, tools: list[dict] | None = None) -> tuple[str, list[ToolCall]]:
        return self._emit(*self._scan(self.buf, True), tools)

    def _emit(self, normal: str, calls: list[tuple[str, str]], tools: list[dict] | None) -> tuple[str, list[ToolCall]]:
        text = normal[self.sent_normal:]
        self.sent_normal = max(self.sent_normal, len(normal))
        calls = self._filter(calls, tools)
        out = []
        for idx in range(self.sent_calls, len(calls)):
            name, args = calls[idx]
            out.append(ToolCall(name, "", idx))
            out.append(ToolCall("", args, idx))
        self.sent_calls = max(self.sent_calls, len(calls))
        return text, out

    def structure_ebnf(self, tools: list[dict]) -> str | None:
        """An EBNF grammar (xgrammar / GBNF dialect) matching one call in this format, or None."""
        return None


def _name_args(obj: Any, args_key: tuple[str, ...] = ("arguments", "parameters")) -> tuple[str, str]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("a call needs a name")
    args = next((obj[k] for k in args_key if k in obj), {})
    return obj["name"], _args_json(args)


class Qwen25ToolParser(BaseToolParser):
    """Hermes style (Qwen2.5, Qwen3): <tool_call>{"name": ..., "arguments": {...}}</tool_call>."""

    start, end = "<tool_call>", "</tool_call>"

    def parse_block(self, inner: str) -> list[tuple[str, str]]:
        return [_name_args(json.loads(inner.strip()))]

    def structure_ebnf(self, tools: list[dict]) -> str | None:
        return None


class DeepSeekV3ToolParser(BaseToolParser):
    """<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"""

    start, end = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    drop = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
    _re = re.compile(r"^\s*(?:function)?<｜tool▁sep｜>([^\n]+)\n```(?:json)?\s*\n?(.*?)\n?```\s*$", re.S)

    def parse_block(self, inner: str) -> list[tuple[str, str]]:
        m = self._re.match(inner)
        if m is None:
            raise ValueError("not a DeepSeek-V3 call")
        return [(m.group(1).strip(), _args_json(json.loads(m.group(2))))]


class KimiK2ToolParser(BaseToolParser):
    """<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}<|tool_call_end|>..."""

    start, end = "<|tool_call_begin|>", "<|tool_call_end|>"
    drop = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
    _re = re.compile(r"^\s*(?:functions\.)?([\w.\-]+?)(?::\d+)?\s*<\|tool_call_argument_begin\|>(.*)$", re.S)

    def parse_block(self, inner: str) -> list[tuple[str, str]]:
        m = self._re.match(inner)
        if m is None:
            raise ValueError("not a Kimi-K2 call")
        return [(m.group(1), _args_json(json.loads(m.group(2))))]


def _coerce(value: str, schema: dict | None) -> Any:
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
    _param = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)

    def parse_block(self, inner: str) -> list[tuple[str, str]]:
        m = self._fn.match(inner)
        if m is None:
            raise ValueError("not a Qwen3-Coder call")
        args = {k.strip(): _coerce(v, None) for k, v in self._param.findall(m.group(2))}
        return [(m.group(1).strip(), json.dumps(args, ensure_ascii=False))]


class Glm45ToolParser(BaseToolParser):
    """<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>"""

    start, end = "<tool_call>", "</tool_call>"
    _kv = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def parse_block(self, inner: str) -> list[tuple[str, str]]:
        name = inner.strip().split("\n", 1)[0].split("<arg_key>", 1)[0].strip()
        if not name or not re.fullmatch(r"[\w.\-]+", name):
            raise ValueError("not a GLM-4.5 call")
        args = {k.strip(): _coerce(v, None) for k, v in self._kv.findall(inner)}
        return [(name, json.dumps(args, ensure_ascii=False))]


class GptOssToolParser(BaseToolParser):
    """harmony: <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>"""

    start, end = "<|channel|>commentary to=", "<|call|>"
    drop = ("<|start|>assistant",)
    _re = re.compile(r"^(?:functions\.)?([\w.\-]+)\s*(?:<\|constrain\|>\s*json)?\s*<\|message\|>(.*)$", re.S)

    def parse_block(self, inner: str) -> list[tuple[str, str]]:
        m = self._re.match(inner)
        if m is None:
            raise ValueError("not a gpt-oss call")
        return [(m.group(1), _args_json(json.loads(m.group(2))))]


def _json_objects(text: str, pos: int, final: bool, sep: str) -> tuple[list[Any], int]:
    """Consecutive JSON values separated by ``sep`` from ``pos``; Incomplete if more may come."""
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
        objs.append(obj)
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
        return [_name_args(o) for o in objs], end


class MistralToolParser(BaseToolParser):
    """[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...] (or the newer [TOOL_CALLS]NAME[ARGS]{...})."""

    start = "[TOOL_CALLS]"
    _named = re.compile(r"\s*([\w.\-]+)\[ARGS\]")

    def parse_open(self, text: str, pos: int, final: bool) -> tuple[list[tuple[str, str]], int]:
        m = self._named.match(text, pos)
        if m is not None:
            objs, end = _json_objects(text, m.end(), final, "")
            return [(m.group(1), _args_json(objs[0]))], end
        if not text[pos:].strip() or re.fullmatch(r"\s*[\w.\-]*(\[A?R?G?S?)?", text[pos:]):
            if not final:
                raise Incomplete()
        objs, end = _json_objects(text, pos, final, "")
        obj = objs[0]
        items = obj if isinstance(obj, list) else [obj]
        return [_name_args(o) for o in items], end


class PythonicToolParser(BaseToolParser):
    """Pythonic calls (Llama 4, Llama 3.2 pythonic): [get_weather(city="Paris"), get_time()]."""

    _start = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
    _partial = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?$")

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
                args = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg}
                calls.append((name, json.dumps(args, ensure_ascii=False)))
            return calls, k + 1
