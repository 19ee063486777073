"""OpenAI-compatible HTTP API: chat completions, completions, models, embeddings, files, batches.

``core.server`` mounts these with ``routes += openai_routes()`` and puts its ``ServerState``
at ``request.app.state.core`` (``engine``, ``args``, ``metrics``, ``served_model_name``).

Policies (SGLang's behaviour unless noted):

* Model names: any ``model`` value is accepted, as SGLang does; responses echo the
  requested name (the served name when the request has none). ``GET /v1/models/{id}``
  answers 404 for any id but the served name.
* Unknown request fields are ignored (see ``core.server.openai.protocol``); known but unsupported ones
  (``logit_bias``, structured output, ``suffix``, ``best_of`` != ``n``, forced
  ``tool_choice``) are a 400. Tool calls are not parsed out of the output yet: ``tools``
  and assistant ``tool_calls`` / ``tool`` messages reach the chat template, the reply is text.
* ``n`` is 1..128 (``MAX_N``); a completions request holds at most 4096 sequences in all.
* ``temperature`` is 0..2 (OpenAI's range), ``top_logprobs`` / completions ``logprobs`` 0..20.
* ``max_tokens`` (chat: ``max_completion_tokens`` wins over ``max_tokens``): an omitted or
  null value means "until the context (or the KV pool) is full", except completions,
  where an omitted ``max_tokens`` is OpenAI's 16 and an explicit null means unlimited.
* Context: a prompt of >= context-length tokens, or prompt + max_tokens over the context
  length, is a 400 naming both numbers. With ``--allow-auto-truncate`` the prompt keeps
  its *tail* (the start, e.g. the system prompt, is dropped): it keeps
  ``context - max(1, min(max_tokens or 1, context // 2))`` tokens, and ``max_tokens`` is
  cut to what still fits.
* Content parts: ``text`` parts of a message are joined with "\\n"; any other part type
  (``image_url``, ``input_audio``, ``file``...) is a 400, the models are text-only.
  Role ``developer`` is given to the template as ``system``.
* ``finish_reason`` is ``stop`` (EOS, stop token or stop string; SGLang's ``matched_stop``
  names it) or ``length``. A request the engine aborts (forward failure, shutdown) is a
  500 (503 on shutdown) for non-streaming requests and a ``data: {"error": ...}`` event
  followed by ``data: [DONE]`` in a stream; the OpenAI client raises on both. A client
  that disconnects from a stream aborts its engine requests.
* Logprobs cover every generated token, the EOS token included (as ``completion_tokens``
  counts it). Completions ``echo`` with ``logprobs`` also scores the prompt (the first
  prompt token has ``null`` logprob). ``text_offset`` counts characters of the decoded
  token bytes, so it is exact for byte-level BPE vocabularies.
* Usage counts each prompt once (not once per ``n``); ``prompt_tokens_details.cached_tokens``
  is reported with ``--enable-cache-report``. With ``stream_options.include_usage`` every
  chunk has ``"usage": null`` and a last chunk with empty ``choices`` carries the usage.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import os
import re
import time
import uuid
import weakref
from typing import Any, AsyncIterator

import attrs
import msgspec
import structlog
from msgspec import UNSET
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from core.errors import CoreError, InvalidRequest
from core.server.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorDetail,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
    encoder,
)
from core.server.openai.tools import ChoicePost, function_call_routes, native_tool_parser, tool_constraint, tool_mode
from core.engine.sampling_params import SamplingParams

log = structlog.get_logger("core.server.openai.api")

MAX_N = 128
MAX_SEQUENCES = 4096
MAX_TOP_LOGPROBS = 20
MAX_TEMPERATURE = 2.0
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
ALLOWED_ROLES = ("system", "user", "assistant", "tool", "developer")
_STARTED = int(time.time())


# ----------------------------------------------------------------------------- errors


class ApiError(Exception):
    """An error answered as OpenAI's ``{"error": {...}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> ErrorResponse:
        # code defaults to the HTTP status, as core.server (and SGLang) do
        return ErrorResponse(ErrorDetail(self.message, self.type, self.param, self.status if self.code is None else self.code))

    def response(self) -> Response:
        return _json(self.body(), self.status)


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | int | None = None) -> Response:
    """OpenAI's error JSON; the same shape as ``core.server.error_response``."""
    return ApiError(status, message, type_, param, code).response()


def _json(obj: Any, status: int = 200) -> Response:
    return Response(encoder.encode(obj), status_code=status, media_type="application/json")


_PARAM_RE = re.compile(r"at `\$\.?([^`]*)`")
_MISSING_RE = re.compile(r"required field `([^`]+)`")


def decode_body(body: bytes, typ: type) -> Any:
    """JSON bytes -> request Struct; malformed JSON and type errors become InvalidRequest."""
    if not body.strip():
        raise InvalidRequest("the request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(body, type=typ)
    except msgspec.ValidationError as e:
        raise _validation_error(e) from None
    except msgspec.DecodeError as e:
        raise InvalidRequest(f"the request body is not valid JSON: {e}") from None


def convert_body(obj: Any, typ: type) -> Any:
    """An already-parsed JSON value (a batch line's body) -> request Struct."""
    try:
        return msgspec.convert(obj, typ)
    except msgspec.ValidationError as e:
        raise _validation_error(e) from None


def _validation_error(e: msgspec.ValidationError) -> InvalidRequest:
    text = str(e)
    m = _PARAM_RE.search(text) or _MISSING_RE.search(text)
    if "Expected `object`" in text and (m is None or not m.group(1)):
        return InvalidRequest("the request body must be a JSON object")
    if text.startswith("Object missing required field"):
        return InvalidRequest(f"'{m.group(1)}' is a required property", param=m.group(1) if m else None)
    return InvalidRequest(f"invalid request: {text}", param=m.group(1) if m and m.group(1) else None)


# ----------------------------------------------------------------------------- token text for logprobs


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte <-> printable-character table used by byte-level BPE vocabularies."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}
_HEX_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _is_byte_level(tokenizer: Any) -> bool:
    try:
        spec = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder")
    except Exception:
        return False
    return "ByteLevel" in json.dumps(spec)


class _Vocab:
    """token id -> (display string, UTF-8 bytes), cached, for logprob entries."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.byte_level = tokenizer is not None and _is_byte_level(tokenizer)
        self.cache: dict[int, tuple[str, bytes]] = {}

    def get(self, tid: int) -> tuple[str, bytes]:
        hit = self.cache.get(tid)
        if hit is not None:
            return hit
        if self.tok is None:
            res = (f"token_id:{tid}", b"")
        else:
            piece = self.tok.convert_ids_to_tokens(tid)
            raw: bytes | None = None
            if isinstance(piece, str) and piece:
                if self.byte_level and all(c in _BYTE_DECODER for c in piece):
                    raw = bytes(_BYTE_DECODER[c] for c in piece)
                elif (m := _HEX_BYTE.match(piece)) is not None:
                    raw = bytes([int(m.group(1), 16)])
            if raw is None:
                text = self.tok.decode([tid], skip_special_tokens=False, clean_up_tokenization_spaces=False)
                res = (text, text.encode("utf-8"))
            else:
                res = (raw.decode("utf-8", errors="replace"), raw)
        self.cache[tid] = res
        return res


_VOCABS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _vocab(engine: Any) -> _Vocab:
    v = _VOCABS.get(engine)
    if v is None:
        v = _VOCABS[engine] = _Vocab(engine.tokenizer)
    return v


class _Offsets:
    """Character offsets of tokens in the decoded text (completions' ``text_offset``)."""

    def __init__(self) -> None:
        self.pos = 0
        self.dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, raw: bytes) -> int:
        at = self.pos
        self.pos += len(self.dec.decode(raw))
        return at


# ----------------------------------------------------------------------------- chat templates

_TEMPLATE_FILES: dict[str, str] = {}
_RESERVED_TEMPLATE_KWARGS = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                             "continue_final_message", "tokenize", "return_dict", "return_tensors", "padding", "truncation"}


def load_chat_template(value: str) -> str:
    """The Jinja template named by ``--chat-template``: a file path (read once), or the template
    itself when the value is not a file and contains Jinja markup. SGLang's built-in template
    names and .json conversation templates are not supported."""
    hit = _TEMPLATE_FILES.get(value)
    if hit is None:
        path = os.path.expanduser(value)
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    hit = f.read()
            except OSError as e:
                raise CoreError(f"--chat-template {value!r}: cannot read it: {e}") from None
        elif "{%" in value or "{{" in value:
            hit = value
        else:
            raise CoreError(f"--chat-template {value!r} is neither a Jinja template file nor a template string")
        _TEMPLATE_FILES[value] = hit
    return hit


def _content_text(content: list, i: int) -> str:
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):  # a bare string part: lenient
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise InvalidRequest(f"messages[{i}].content[{j}] must be an object", param=f"messages[{i}].content[{j}]")
        kind = part.get("type")
        if kind == "text" or (kind is None and "text" in part):
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequest(f"messages[{i}].content[{j}].text must be a string", param=f"messages[{i}].content[{j}].text")
            texts.append(text)
        else:
            raise InvalidRequest(
                f"messages[{i}].content[{j}] has type {kind!r}, but this model is text-only: only 'text' content parts "
                f"are supported", param=f"messages[{i}].content[{j}].type")
    return "\n".join(texts)


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validate chat messages and turn them into what HF chat templates expect."""
    if not messages:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if not isinstance(role, str):
            raise InvalidRequest(f"messages[{i}] is missing the 'role' field", param=f"messages[{i}].role")
        if role not in ALLOWED_ROLES:
            raise InvalidRequest(f"Invalid role {role!r} in messages[{i}]: expected one of {', '.join(ALLOWED_ROLES)}",
                                 param=f"messages[{i}].role")
        msg = dict(m)
        if role == "developer":
            msg["role"] = "system"
        content = m.get("content")
        if isinstance(content, list):
            msg["content"] = _content_text(content, i)
        elif content is None:
            if role != "assistant":
                raise InvalidRequest(f"messages[{i}] (role {role!r}) is missing 'content'", param=f"messages[{i}].content")
            msg["content"] = ""  # an assistant turn that only calls tools
        elif not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string or a list of content parts",
                                 param=f"messages[{i}].content")
        tool_calls = m.get("tool_calls")
        if tool_calls is not None:
            if not isinstance(tool_calls, list):
                raise InvalidRequest(f"messages[{i}].tool_calls must be a list", param=f"messages[{i}].tool_calls")
            msg["tool_calls"] = [_template_tool_call(tc) for tc in tool_calls]
        out.append(msg)
    return out


def _template_tool_call(tc: Any) -> Any:
    """HF templates expect function.arguments as a mapping; OpenAI sends a JSON string."""
    if not isinstance(tc, dict) or not isinstance(tc.get("function"), dict):
        return tc
    fn = dict(tc["function"])
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            fn["arguments"] = parsed
    return {**tc, "function": fn}


def render_chat(state: Any, r: ChatCompletionRequest) -> list[int]:
    """Apply the chat template (``--chat-template`` overrides the tokenizer's) and tokenize."""
    engine = state.engine
    tok = engine.tokenizer
    if tok is None:
        raise InvalidRequest("chat completions need the tokenizer, but the server runs with --skip-tokenizer-init")
    messages = normalize_messages(r.messages)
    kwargs = {k: v for k, v in (r.chat_template_kwargs or {}).items() if k not in _RESERVED_TEMPLATE_KWARGS}
    path = getattr(state.args, "chat_template", None)
    if path:
        try:
            kwargs["chat_template"] = load_chat_template(path)
        except CoreError as e:
            raise ApiError(500, str(e), "server_error") from None
    elif not getattr(tok, "chat_template", None):
        raise InvalidRequest("the model has no chat template; start the server with --chat-template FILE or use /v1/completions")
    cont = bool(r.continue_final_message) and messages[-1]["role"] == "assistant"
    try:
        text = tok.apply_chat_template(messages, tools=None if r.tool_choice == "none" else r.tools, documents=r.documents, add_generation_prompt=not cont,
                                       continue_final_message=cont, tokenize=False, **kwargs)
    except Exception as e:  # jinja2 TemplateError (raise_exception in templates), TypeError on odd messages
        raise InvalidRequest(f"the chat template could not render these messages: {e}", param="messages") from None
    if not isinstance(text, str):
        raise ApiError(500, "the chat template did not produce a string", "server_error")
    return tok.encode(text, add_special_tokens=False)


# ----------------------------------------------------------------------------- request -> engine


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequest(message, param=param)


def _common_checks(r: Any) -> int:
    """Validation shared by chat and completions; returns n."""
    n = 1 if r.n is None else r.n
    _check(1 <= n <= MAX_N, f"n must be between 1 and {MAX_N}, got {n}", "n")
    if r.temperature is not None:
        _check(0 <= r.temperature <= MAX_TEMPERATURE, f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {r.temperature}",
               "temperature")
    _check(not r.logit_bias, "logit_bias is not supported by this server", "logit_bias")
    _constraint(r)  # validates response_format / regex / json_schema / ebnf (at most one)
    if r.min_tokens is not None:
        _check(r.min_tokens >= 0, f"min_tokens must be >= 0, got {r.min_tokens}", "min_tokens")
    return n


def _constraint(r: Any) -> dict[str, str]:
    """Structured output of a request as SamplingParams fields: response_format (json_schema,
    json_object, structural_tag) or SGLang's extra_body regex / json_schema / ebnf; at most one."""
    out: dict[str, str] = {}
    for name in ("regex", "json_schema", "ebnf"):
        if getattr(r, name) is not None:
            out[name] = getattr(r, name)
    rf = r.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_schema":
            js = rf.get("json_schema")
            schema = js.get("schema", js.get("schema_")) if isinstance(js, dict) else None
            _check(isinstance(schema, (dict, bool)), "response_format json_schema needs json_schema.schema (an object)",
                   "response_format")
            out["json_schema"] = json.dumps(schema)
        elif kind == "json_object":
            out["json_schema"] = '{"type": "object"}'
        elif kind == "structural_tag":
            out["structural_tag"] = json.dumps(rf)
        else:
            _check(kind in (None, "text"), f"response_format type {kind!r} is not supported; use text, json_object, "
                   "json_schema or structural_tag", "response_format")
    if len(out) > 1:
        raise InvalidRequest(f"only one constraint per request is allowed, got {', '.join(out)}", param=list(out)[1])
    return out


def _sampling_params(r: Any, max_new: int, n: int) -> SamplingParams:
    stop = [r.stop] if isinstance(r.stop, str) else list(r.stop or [])
    min_tokens = min(r.min_tokens or 0, max_new)
    return SamplingParams(
        max_new_tokens=max_new,
        min_new_tokens=min_tokens,
        temperature=1.0 if r.temperature is None else r.temperature,
        top_p=1.0 if r.top_p is None else r.top_p,
        top_k=-1 if r.top_k in (None, 0) else r.top_k,
        min_p=0.0 if r.min_p is None else r.min_p,
        frequency_penalty=0.0 if r.frequency_penalty is None else r.frequency_penalty,
        presence_penalty=0.0 if r.presence_penalty is None else r.presence_penalty,
        repetition_penalty=1.0 if r.repetition_penalty is None else r.repetition_penalty,
        stop=[s for s in stop if s],  # OpenAI clients sometimes send "" entries
        stop_token_ids=list(r.stop_token_ids or []),
        ignore_eos=bool(r.ignore_eos),
        skip_special_tokens=r.skip_special_tokens is not False,
        spaces_between_special_tokens=r.spaces_between_special_tokens is not False,
        no_stop_trim=bool(r.no_stop_trim),
        n=n,
        seed=r.seed,
        **_constraint(r),
    )


def _fit_context(state: Any, ids: list[int], max_tokens: int | None, param: str) -> tuple[list[int], int]:
    """Check (or, with --allow-auto-truncate, cut) the prompt against the context; returns (ids, max_new_tokens)."""
    engine = state.engine
    ctx = engine.model_config.context_len
    auto = bool(getattr(state.args, "allow_auto_truncate", False))
    if max_tokens is not None:
        _check(max_tokens >= 0, f"max_tokens must be >= 0, got {max_tokens}", "max_tokens")
    if not ids:
        raise InvalidRequest("the prompt is empty", param=param)
    if len(ids) >= ctx:
        if not auto:
            raise InvalidRequest(f"This model's maximum context length is {ctx} tokens. However, your prompt has {len(ids)} "
                                 f"tokens. Please reduce the length of the prompt.", param=param)
        keep = ctx - max(1, min(max_tokens or 1, ctx // 2))
        ids = ids[-keep:]
    room = ctx - len(ids)
    if max_tokens is None:
        # unlimited: until the context is full, bounded by what one request may hold in the KV pool
        return ids, max(0, min(room, engine.max_total_tokens - len(ids)))
    if max_tokens > room:
        if not auto:
            raise InvalidRequest(f"This model's maximum context length is {ctx} tokens. However, you requested "
                                 f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the completion). "
                                 f"Please reduce the length of the prompt or max_tokens.", param="max_tokens")
        return ids, room
    return ids, max_tokens


def _engine_error(e: InvalidRequest) -> InvalidRequest:
    names = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "input_ids": "prompt", "text": "prompt"}
    if e.param in names:
        msg = e.message
        for old, new in names.items():
            msg = msg.replace(old, new)
        return InvalidRequest(msg, param=names[e.param])
    return e


class _Job:
    """One API request turned into engine requests: choice i is sequence i % n of prompt i // n."""

    def __init__(self, state: Any, kind: str, r: Any, rid: str | None) -> None:
        self.state, self.kind, self.r = state, kind, r
        self.engine = state.engine
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        self.id = rid or r.rid or prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = r.model or state.served_model_name
        self.stream = bool(r.stream)
        opts = r.stream_options
        self.include_usage = bool(self.stream and opts is not None and opts.include_usage)
        self.cache_report = bool(getattr(state.args, "enable_cache_report", False))
        self.n = 1
        self.reqs: list[Any] = []
        self.echo_texts: list[str] | None = None
        self.logprobs = False
        self.top = 0
        self.tool_mode, self.tool_name = "none", None
        self.native_tools = False  # required / named constrained to the tool parser's own format

    def post(self) -> ChoicePost:
        """A fresh per-choice reasoning / tool-call post-processor (core.server.openai.tools)."""
        return ChoicePost(self.state, self.r, self.tool_mode, self.tool_name, native=self.native_tools)

    # ---- building
    def add_prompt(self, ids: list[int], params: SamplingParams, p: int, start_len: int = -1) -> None:
        rid = self.id if p < 0 else f"{self.id}-{p}"
        try:
            self.reqs += self.engine.make_requests(ids, params, rid, self.logprobs, start_len, self.top,
                                                   priority=getattr(self.r, "priority", None))
        except InvalidRequest as e:
            raise _engine_error(e) from None

    async def prepare(self) -> None:
        """Compile the grammars of constrained requests off the loop (an invalid one is a 400)."""
        try:
            await self.engine.prepare_grammars(self.reqs)
        except InvalidRequest as e:
            raise _engine_error(e) from None

    def submit(self) -> None:
        """Through ServerState.submit when there is one (admission control: queue limit, shutdown -> 503)."""
        submit = getattr(self.state, "submit", None)
        try:
            if callable(submit):
                submit(self.reqs)
            else:
                self.engine.submit(self.reqs)
        except InvalidRequest:
            raise
        except CoreError as e:
            raise ApiError(503, str(e), "server_error") from None
        if getattr(self.state.args, "log_requests", False):
            log.info("request.received", rids=[r.rid for r in self.reqs], endpoint=self.kind,
                     prompt_tokens=[len(r.prompt_ids) for r in self.reqs[:: self.n]])

    # ---- results
    def _usage(self, outs: list[dict | None]) -> UsageInfo:
        prompt = completion = cached = 0
        for i, out in enumerate(outs):
            if out is None:
                continue
            meta = out["meta_info"]
            completion += meta["completion_tokens"]
            if i % self.n == 0:
                prompt += meta["prompt_tokens"]
                cached += meta.get("cached_tokens", 0) or 0
        usage = UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
        if self.cache_report:
            usage.prompt_tokens_details = PromptTokensDetails(cached_tokens=cached)
        return usage

    async def final_outputs(self) -> list[dict]:
        async def last(req: Any) -> dict:
            out = None
            async for out in self.engine.stream(req):
                pass
            return out

        try:
            outs = await asyncio.gather(*(last(r) for r in self.reqs))
        finally:
            self.abort()
        for out in outs:
            _raise_if_aborted(out)
        return outs

    def abort(self) -> None:
        for req in self.reqs:
            if not req.finished:
                self.engine.abort(req.rid)

    async def merged(self) -> AsyncIterator[tuple[int, dict]]:
        """(choice index, cumulative output) as each sequence advances; an aborted
        sequence raises ApiError."""
        async for i, out in self.engine.stream_many(self.reqs):
            _raise_if_aborted(out)
            yield i, out

    def _interval(self) -> int:
        v = getattr(self.state.args, "stream_interval", 1)
        return v if isinstance(v, int) and v > 1 else 1

    # ---- logprobs
    def chat_logprobs(self, meta: dict, start: int) -> ChoiceLogprobs:
        vocab = _vocab(self.engine)
        toks = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs") or []
        content = []
        for k in range(start, len(toks)):
            lp, tid = toks[k]
            s, raw = vocab.get(tid)
            alts = []
            if self.top and k < len(tops):
                for atid, alp in (tops[k] or [])[: self.top]:
                    a, araw = vocab.get(atid)
                    alts.append(TopLogprob(a, alp, list(araw)))
            content.append(ChatTokenLogprob(s, lp, list(raw), alts))
        return ChoiceLogprobs(content=content)

    def completion_logprobs(self, pairs: list, tops: list | None, offsets: _Offsets, into: CompletionLogprobs) -> None:
        vocab = _vocab(self.engine)
        for k, (lp, tid) in enumerate(pairs):
            s, raw = vocab.get(tid)
            into.tokens.append(s)
            into.token_logprobs.append(lp)
            into.text_offset.append(offsets.add(raw))
            entry = tops[k] if tops is not None and k < len(tops) else None
            if lp is None:  # the first prompt token has no logprob
                into.top_logprobs.append(None)
            else:
                d: dict[str, float | None] = {}
                for atid, alp in (entry or [])[: self.top]:
                    d.setdefault(vocab.get(atid)[0], alp)
                into.top_logprobs.append(d)


def _finish(out: dict) -> tuple[str | None, Any]:
    fr = out["meta_info"]["finish_reason"]
    if not fr:
        return None, None
    return fr.get("type"), fr.get("matched")


def _raise_if_aborted(out: dict | None) -> None:
    if out is None:
        raise ApiError(500, "the request ended without output", "server_error")
    fr = out["meta_info"]["finish_reason"]
    if fr and fr.get("type") == "abort":
        msg = fr.get("message") or "request aborted"
        status = 503 if "shut down" in msg else 500
        raise ApiError(status, f"the request was aborted: {msg}", "server_error")


# ----------------------------------------------------------------------------- chat


def prepare_chat(state: Any, r: ChatCompletionRequest, rid: str | None = None) -> _Job:
    n = _common_checks(r)
    job = _Job(state, "chat", r, rid)
    job.n = n
    job.logprobs = bool(r.logprobs)
    top = r.top_logprobs or 0
    _check(0 <= top <= MAX_TOP_LOGPROBS, f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top}", "top_logprobs")
    _check(job.logprobs or top == 0, "logprobs must be true when top_logprobs is set", "top_logprobs")
    job.top = top
    job.tool_mode, job.tool_name = tool_mode(r)
    max_tokens = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
    if max_tokens is not None and max_tokens < 0:
        name = "max_completion_tokens" if r.max_completion_tokens is not None else "max_tokens"
        raise InvalidRequest(f"{name} must be >= 0, got {max_tokens}", param=name)
    ids = render_chat(state, r)
    ids, max_new = _fit_context(state, ids, max_tokens, "messages")
    params = _sampling_params(r, max_new, n)
    native = native_tool_parser(state) if job.tool_mode in ("required", "named") else None
    if (spec := tool_constraint(r, job.tool_mode, job.tool_name, native)) is not None:  # required / named: constrained call
        _check(not _constraint(r), "tool_choice 'required' or a named function cannot be combined with another "
               "constraint (response_format, regex, json_schema, ebnf)", "tool_choice")
        job.native_tools = spec[0] == "structural_tag"
        params = attrs.evolve(params, **{spec[0]: spec[1]})
    job.add_prompt(ids, params, -1)
    return job


async def chat_response(job: _Job) -> ChatCompletionResponse:
    outs = await job.final_outputs()
    choices = []
    for i, out in enumerate(outs):
        reason, matched = _finish(out)
        lp = job.chat_logprobs(out["meta_info"], 0) if job.logprobs else None
        reasoning, content, calls, reason = job.post().full(out["text"], reason)
        msg = ChatMessage(role="assistant", content=content, reasoning_content=reasoning if reasoning is not None else UNSET,
                          tool_calls=calls if calls else UNSET)
        choices.append(ChatChoice(index=i, message=msg, logprobs=lp, finish_reason=reason, matched_stop=matched))
    return ChatCompletionResponse(id=job.id, created=job.created, model=job.model, choices=choices, usage=job._usage(outs))


def _sse(obj: Any) -> bytes:
    return b"data: " + encoder.encode(obj) + b"\n\n"


_DONE = b"data: [DONE]\n\n"


def _sse_error(e: ApiError) -> bytes:
    return _sse(e.body())


async def _guarded(job: _Job, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The end every OpenAI stream shares: ``[DONE]`` after the events, errors reported
    in-band (the status line is already sent), engine requests aborted on close."""
    try:
        async for event in events:
            yield event
        yield _DONE
    except ApiError as e:  # an aborted sequence (shutdown, engine failure)
        yield _sse_error(e)
        yield _DONE
    except Exception as e:
        log.exception("openai.stream_failed", id=job.id)
        yield _sse_error(ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error"))
        yield _DONE
    finally:
        await events.aclose()
        job.abort()


async def chat_stream(job: _Job) -> AsyncIterator[bytes]:
    usage_field = None if job.include_usage else UNSET
    count = len(job.reqs)

    def chunk(choice: ChatStreamChoice | None, usage: Any = usage_field) -> bytes:
        return _sse(ChatCompletionChunk(id=job.id, created=job.created, model=job.model,
                                        choices=[] if choice is None else [choice], usage=usage))

    for i in range(count):
        yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
    sent_text = [""] * count
    sent_toks = [0] * count
    last: list[dict | None] = [None] * count
    posts = [job.post() for _ in range(count)]
    interval = job._interval()
    async for i, out in job.merged():
        last[i] = out
        reason, matched = _finish(out)
        meta = out["meta_info"]
        ntok = meta["completion_tokens"]
        if reason is None and ntok - sent_toks[i] < interval:
            continue
        delta = out["text"][len(sent_text[i]):]
        lp = job.chat_logprobs(meta, sent_toks[i]) if job.logprobs else None
        if reason is None and not delta and not (lp and lp.content):
            continue
        sent_text[i], sent_toks[i] = out["text"], ntok
        r_delta, delta, calls = posts[i].delta(delta, reason is not None)
        if reason == "stop" and posts[i].n_calls:
            reason = "tool_calls"
        if reason is None and not delta and not r_delta and not calls and not (lp and lp.content):
            continue
        dm = DeltaMessage(content=delta if delta else UNSET, reasoning_content=r_delta if r_delta else UNSET,
                          tool_calls=calls if calls else UNSET)
        yield chunk(ChatStreamChoice(index=i, delta=dm, logprobs=lp,
                                     finish_reason=reason, matched_stop=matched if reason else UNSET))
    if job.include_usage:
        yield chunk(None, job._usage(last))


# ----------------------------------------------------------------------------- completions


def _split_prompt(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, list) for p in prompt):
        for j, p in enumerate(prompt):
            _check(bool(p), f"prompt[{j}] is an empty list of token ids", "prompt")
        return list(prompt)
    raise InvalidRequest("prompt must be a string, a list of strings, a list of token ids, or a list of token-id lists",
                         param="prompt")


def prepare_completion(state: Any, r: CompletionRequest, rid: str | None = None) -> _Job:
    n = _common_checks(r)
    _check(r.suffix is None, "suffix is not supported by this server", "suffix")
    _check(r.best_of is None or r.best_of == n, "best_of is not supported by this server (unless equal to n)", "best_of")
    job = _Job(state, "completion", r, rid)
    job.n = n
    if r.logprobs is not None:
        _check(0 <= r.logprobs <= MAX_TOP_LOGPROBS, f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {r.logprobs}",
               "logprobs")
        job.logprobs, job.top = True, r.logprobs
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if r.max_tokens is UNSET else r.max_tokens
    prompts = _split_prompt(r.prompt)
    _check(len(prompts) * n <= MAX_SEQUENCES, f"a request may ask for at most {MAX_SEQUENCES} completions "
           f"(prompts x n), got {len(prompts) * n}", "prompt")
    echo = bool(r.echo)
    engine = state.engine
    texts = []
    for p, prompt in enumerate(prompts):
        try:
            ids = engine.tokenize(prompt, None) if isinstance(prompt, str) else engine.tokenize(None, prompt)
        except InvalidRequest as e:
            raise _engine_error(e) from None
        full = len(ids)
        ids, max_new = _fit_context(state, ids, max_tokens, "prompt")
        if echo:
            if isinstance(prompt, str) and len(ids) == full:
                texts.append(prompt)
            else:
                texts.append(engine.tokenizer.decode(ids, skip_special_tokens=True) if engine.tokenizer is not None else "")
        start = 0 if echo and job.logprobs else -1
        job.add_prompt(ids, _sampling_params(r, max_new, n), p if len(prompts) > 1 else -1, start)
    job.echo_texts = texts if echo else None
    return job


def _completion_lp(job: _Job, meta: dict, start: int, offsets: _Offsets, with_prompt: bool) -> CompletionLogprobs:
    lp = CompletionLogprobs()
    if with_prompt:
        job.completion_logprobs(meta.get("input_token_logprobs") or [], meta.get("input_top_logprobs"), offsets, lp)
    toks = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs")
    job.completion_logprobs(toks[start:], None if tops is None else tops[start:], offsets, lp)
    return lp


async def completion_response(job: _Job) -> CompletionResponse:
    outs = await job.final_outputs()
    choices = []
    echo = job.echo_texts is not None
    for i, out in enumerate(outs):
        reason, matched = _finish(out)
        text = out["text"]
        lp = None
        if job.logprobs:
            lp = _completion_lp(job, out["meta_info"], 0, _Offsets(), echo)
        if echo:
            text = job.echo_texts[i // job.n] + text
        choices.append(CompletionChoice(index=i, text=text, logprobs=lp, finish_reason=reason, matched_stop=matched))
    return CompletionResponse(id=job.id, created=job.created, model=job.model, choices=choices, usage=job._usage(outs))


async def completion_stream(job: _Job) -> AsyncIterator[bytes]:
    usage_field = None if job.include_usage else UNSET
    count = len(job.reqs)
    echo = job.echo_texts is not None

    def chunk(choice: CompletionChoice | None, usage: Any = usage_field) -> bytes:
        return _sse(CompletionResponse(id=job.id, created=job.created, model=job.model,
                                       choices=[] if choice is None else [choice], usage=usage))

    sent_text = [""] * count
    sent_toks = [0] * count
    started = [False] * count
    offsets = [_Offsets() for _ in range(count)]
    last: list[dict | None] = [None] * count
    interval = job._interval()
    async for i, out in job.merged():
        last[i] = out
        reason, matched = _finish(out)
        meta = out["meta_info"]
        ntok = meta["completion_tokens"]
        first = not started[i]
        if reason is None and not first and ntok - sent_toks[i] < interval:
            continue
        delta = out["text"][len(sent_text[i]):]
        lp = _completion_lp(job, meta, sent_toks[i], offsets[i], echo and first) if job.logprobs else None
        if first and echo:
            delta = job.echo_texts[i // job.n] + delta
        if reason is None and not delta and not (lp and lp.tokens):
            continue
        started[i] = True
        sent_text[i], sent_toks[i] = out["text"], ntok
        yield chunk(CompletionChoice(index=i, text=delta, logprobs=lp, finish_reason=reason,
                                     matched_stop=matched if reason else UNSET))
    if job.include_usage:
        yield chunk(None, job._usage(last))


# ----------------------------------------------------------------------------- entry points


class _SSEResponse(StreamingResponse):
    """Server-sent events. Closing the body generator in all cases (also when the client went
    away and Starlette cancelled the send loop) runs its ``finally``, which aborts the engine requests."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def _watch_disconnect(request: Request, on_disconnect: Any) -> None:
    """Abort a non-streaming request whose client went away (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


def _state(request: Request) -> Any:
    state = getattr(request.app.state, "core", None)
    if state is None:
        raise ApiError(503, "the server is not ready", "server_error")
    return state


async def run_request(state: Any, endpoint: str, body: Any, request_id: str | None = None) -> tuple[int, dict]:
    """Run one non-streaming chat/completions request given as parsed JSON (the batch runner's path).
    Returns (HTTP status, JSON-ready body); never raises for a bad request."""
    try:
        if not isinstance(body, dict):
            raise InvalidRequest("the request body must be a JSON object")
        if body.get("stream"):
            raise InvalidRequest("streaming is not supported in batch requests", param="stream")
        if endpoint == "/v1/chat/completions":
            job = prepare_chat(state, convert_body(body, ChatCompletionRequest), request_id)
            await job.prepare()
            job.submit()
            resp: Any = await chat_response(job)
        elif endpoint == "/v1/completions":
            job = prepare_completion(state, convert_body(body, CompletionRequest), request_id)
            await job.prepare()
            job.submit()
            resp = await completion_response(job)
        else:
            raise InvalidRequest(f"unsupported endpoint {endpoint!r}", param="endpoint")
        return 200, msgspec.to_builtins(resp)
    except InvalidRequest as e:
        return 400, msgspec.to_builtins(ApiError(400, e.message, param=e.param).body())
    except ApiError as e:
        return e.status, msgspec.to_builtins(e.body())


async def _generation(request: Request, kind: str) -> Response:
    try:
        state = _state(request)
        if kind == "chat":
            job = prepare_chat(state, decode_body(await request.body(), ChatCompletionRequest))
        else:
            job = prepare_completion(state, decode_body(await request.body(), CompletionRequest))
        await job.prepare()
        job.submit()
        if job.stream:
            return _SSEResponse(_guarded(job, chat_stream(job) if kind == "chat" else completion_stream(job)))
        watcher = asyncio.create_task(_watch_disconnect(request, job.abort))
        try:
            resp = await (chat_response(job) if kind == "chat" else completion_response(job))
        finally:
            watcher.cancel()
        return _json(resp)
    except InvalidRequest as e:
        return error_response(400, e.message, param=e.param)
    except ApiError as e:
        return e.response()
    except Exception as e:  # never a bare 500 page or a hang
        log.exception("openai.internal_error", path=request.url.path)
        return error_response(500, f"internal error: {type(e).__name__}: {e}", "server_error")


async def chat_completions(request: Request) -> Response:
    return await _generation(request, "chat")


async def completions(request: Request) -> Response:
    return await _generation(request, "completion")


def _model_card(state: Any) -> ModelCard:
    engine = state.engine
    mc = engine.model_config
    root = getattr(state, "model_path", None) or getattr(engine.args, "model_path", None) or str(getattr(mc, "source", "")) or None
    return ModelCard(id=state.served_model_name, created=_STARTED, root=root, max_model_len=mc.context_len)


async def list_models(request: Request) -> Response:
    try:
        return _json(ModelList(data=[_model_card(_state(request))]))
    except ApiError as e:
        return e.response()


async def retrieve_model(request: Request) -> Response:
    try:
        state = _state(request)
    except ApiError as e:
        return e.response()
    model_id = request.path_params["model_id"]
    if model_id != state.served_model_name:
        return error_response(404, f"The model '{model_id}' does not exist", param="model", code="model_not_found")
    return _json(_model_card(state))


async def embeddings(request: Request) -> Response:
    from core.server.embeddings import openai_embeddings

    return await openai_embeddings(request)


def openai_routes() -> list[Route]:
    from core.server.openai.batches import batch_routes

    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        *function_call_routes(),
        *batch_routes(),
    ]
