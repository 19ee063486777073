"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) over the chat
pipeline, as SGLang and vLLM serve it, so the ``anthropic`` client and tools built on it can
talk to a local model.

A Messages request becomes a chat request: ``system`` the system message; ``text``,
``tool_use`` and ``tool_result`` blocks the messages, tool calls and tool turns; ``tools``
(``input_schema``) the function tools; ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none``
the chat's auto / required / named / none; ``stop_sequences`` the stop strings. The output
comes back as ``thinking`` (with ``--reasoning-parser``), ``text`` and ``tool_use`` blocks, with
``stop_reason`` ``end_turn``, ``max_tokens``, ``stop_sequence`` or ``tool_use``.

* Streaming sends Anthropic's events (``message_start``, ``content_block_start`` /
  ``_delta`` / ``_stop``, ``message_delta``, ``message_stop``; an ``error`` event if the
  request fails mid-stream).
* Errors are Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``; the API key
  may come as ``x-api-key`` (the client's header) or ``Authorization: Bearer``.
* Refused with a 400 rather than ignored: image and document blocks (the models are
  text-only), server tools (web search...), ``container`` and ``mcp_servers``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

import structlog
from msgspec import Struct
from starlette.requests import Request
from starlette.responses import Response

from core.errors import InvalidRequest
from core.server.http import (
    ApiError,
    EventStream,
    abort_on_disconnect,
    api_error,
    convert_body,
    encoder,
    json_response,
    log_ignored_field,
    prepare_off_loop,
    state_of,
)
from core.server.openai.chat import ChatJob, choice_deltas, joined_text, prepare_chat, render_chat
from core.server.openai.job import common_checks, finish_of, read_checked
from core.server.openai.tools import plan_tools
from core.server.openai.protocol import ChatCompletionRequest

log = structlog.get_logger("core.server.anthropic")

# chat-request field -> the Messages field a client sent (for error messages)
_PARAMS = {"messages": "messages", "max_tokens": "max_tokens", "stop": "stop_sequences", "response_format": "output_config"}


class MessagesRequest(Struct, kw_only=True):
    model: str | None = None
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # {format: {type: json_schema, schema}, effort}
    metadata: dict[str, Any] | None = None
    container: Any = None
    mcp_servers: Any = None


# the Messages API's fields for features this server lacks: accepted only where they leave it off
_NOOP = {"context_management": (None,)}


class CountTokensRequest(Struct, kw_only=True):
    model: str | None = None
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    mcp_servers: Any = None


def anthropic_error(e: BaseException) -> tuple[int, dict[str, Any]]:
    err = api_error(e)
    return err.status, err.anthropic_body()


# ----------------------------------------------------------------------------- request -> chat


def chat_messages(system: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages-API turns -> chat messages (tool_use -> tool_calls, tool_result -> tool turns)."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": joined_text(system, "system", ("text",), "system")})
    if not messages:
        raise InvalidRequest("messages must not be empty", param="messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise InvalidRequest(f"{where}.role must be user or assistant, got {role!r}", param="messages")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise InvalidRequest(f"{where}.content must be a string or a list of content blocks", param="messages")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            at = f"{where}.content[{j}]"
            if kind == "text":
                if not isinstance(block.get("text"), str):
                    raise InvalidRequest(f"{at}: a text block needs text (a string)", param="messages")
                texts.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise InvalidRequest(f"{at}: a tool_use block needs id and name", param="messages")
                if not isinstance(block.get("input", {}), dict):
                    raise InvalidRequest(f"{at}: a tool_use block's input must be an object", param="messages")
                calls.append({"id": block["id"], "type": "function",
                              "function": {"name": block["name"], "arguments": json.dumps(block.get("input") or {})}})
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise InvalidRequest(f"{at}: a tool_result block needs tool_use_id", param="messages")
                result = block.get("content")
                text = "" if result is None else joined_text(result, f"{at}.content", ("text",), "messages")
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # the templates drop earlier turns' reasoning
            else:
                raise InvalidRequest(f"{at}: {kind!r} blocks are not supported in {role} turns (the models are "
                                     "text-only)", param="messages")
        if texts or calls:
            msg: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def _chat_tools(tools: list[dict[str, Any]] | None, choice: dict[str, Any] | None) -> tuple[list | None, Any, bool | None]:
    chat_tools = None
    if tools is not None:
        chat_tools = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str) or (t.get("type") not in (None, "custom")):
                kind = t.get("type") if isinstance(t, dict) else t
                raise InvalidRequest(f"tools[{i}]: only client tools (name, input_schema) are supported, got {kind!r}",
                                     param="tools")
            fn = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}
            if isinstance(t.get("description"), str):
                fn["description"] = t["description"]
            chat_tools.append({"type": "function", "function": fn})
    if choice is None:
        return chat_tools, None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return chat_tools, "auto", parallel
    if kind == "any":
        return chat_tools, "required", parallel
    if kind == "none":
        return chat_tools, "none", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return chat_tools, {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise InvalidRequest("tool_choice must be {type: auto | any | none} or {type: tool, name}", param="tool_choice")


def _thinking_kwargs(thinking: dict[str, Any] | None) -> dict[str, Any] | None:
    kind = (thinking or {}).get("type")
    if kind in ("enabled", "adaptive"):
        return {"enable_thinking": True, "thinking": True}
    if kind == "disabled":
        return {"enable_thinking": False, "thinking": False}
    if thinking is not None:
        raise InvalidRequest(f"thinking.type must be enabled, adaptive or disabled, got {kind!r}", param="thinking")
    return None


def _output_config(config: dict[str, Any] | None, kwargs: dict[str, Any] | None) -> tuple[Any, Any]:
    """(response_format, template kwargs) from ``output_config``: a JSON-schema format constrains
    the output; ``effort`` reaches the chat template as ``reasoning_effort``."""
    config = config or {}
    fmt, effort = config.get("format"), config.get("effort")
    response_format = None
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise InvalidRequest("output_config.format must be {type: json_schema, schema: {...}}", param="output_config")
        response_format = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    if isinstance(effort, str):
        kwargs = {"reasoning_effort": effort, **(kwargs or {})}
    return response_format, kwargs


def chat_request(r: MessagesRequest) -> ChatCompletionRequest:
    for name in ("container", "mcp_servers"):
        if getattr(r, name):
            raise InvalidRequest(f"{name} is not supported by this server", param=name)
    if r.max_tokens is None:
        raise InvalidRequest("max_tokens is required", param="max_tokens")
    if r.max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be >= 1, got {r.max_tokens}", param="max_tokens")
    budget = (r.thinking or {}).get("budget_tokens")
    if budget is not None and (not isinstance(budget, int) or not 1 <= budget < r.max_tokens):
        raise InvalidRequest(f"thinking.budget_tokens must be below max_tokens ({r.max_tokens}), got {budget!r}",
                             param="thinking")
    if r.temperature is not None and not 0 <= r.temperature <= 1:
        raise InvalidRequest(f"temperature must be between 0 and 1, got {r.temperature}", param="temperature")
    tools, choice, parallel = _chat_tools(r.tools, r.tool_choice)
    response_format, kwargs = _output_config(r.output_config, _thinking_kwargs(r.thinking))
    messages = chat_messages(r.system, r.messages)
    # a final assistant turn is a prefill the answer continues, as Anthropic's API does
    prefill = messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")
    body = {"model": r.model, "messages": messages, "max_tokens": r.max_tokens, "continue_final_message": prefill,
            "stop": r.stop_sequences, "stream": bool(r.stream), "temperature": r.temperature, "top_p": r.top_p,
            "top_k": r.top_k, "tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel,
            "response_format": response_format, "chat_template_kwargs": kwargs,
            "thinking_token_budget": budget if (r.thinking or {}).get("type") == "enabled" else None}
    return convert_body({k: v for k, v in body.items() if v is not None}, ChatCompletionRequest)


def _chat_job(state: Any, r: MessagesRequest) -> ChatJob:
    chat = chat_request(r)
    if chat.thinking_token_budget is not None and not state.args.reasoning_parser:
        # without --reasoning-parser nothing is read as reasoning, so there is nothing to count
        log_ignored_field("request.field_ignored", "thinking.budget_tokens", "/v1/messages")
        chat.thinking_token_budget = None
    return prepare_chat(state, chat, "msg_" + uuid.uuid4().hex)


def _messages_error(e: InvalidRequest) -> InvalidRequest:
    """A chat pipeline error in the Messages API's words."""
    if e.param is None:
        return e
    head = e.param.split("[")[0].split(".")[0]
    message = e.message
    for chat_words, words in (("max_completion_tokens", "max_tokens"), ("tool_choice 'required'", "tool_choice any"),
                              ("function.parameters", "input_schema"), (".function.", ".")):
        message = message.replace(chat_words, words)
    return InvalidRequest(message, param=_PARAMS.get(head, head))


# ----------------------------------------------------------------------------- output


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    try:
        args = json.loads(fn.get("arguments") or "{}")
    except ValueError:
        args = {"_raw": fn.get("arguments")}  # the model wrote arguments that are not JSON
    return {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": fn.get("name", ""),
            "input": args if isinstance(args, dict) else {"value": args}}


def _stop(reason: str | None, matched: Any, r: MessagesRequest, has_calls: bool) -> tuple[str, str | None]:
    if has_calls and reason in ("stop", "tool_calls"):
        return "tool_use", None
    if reason == "length":
        return "max_tokens", None
    if isinstance(matched, str) and matched in (r.stop_sequences or []):
        return "stop_sequence", matched
    return "end_turn", None


def _usage(out: dict) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` are those not read from the cache (the prompt is their sum
    with ``cache_read_input_tokens`` and ``cache_creation_input_tokens``)."""
    meta = out["meta_info"]
    cached = meta.get("cached_tokens", 0) or 0
    return {"input_tokens": meta["prompt_tokens"] - cached, "output_tokens": meta["completion_tokens"],
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _message(job: ChatJob, content: list, stop_reason: str | None, stop_sequence: str | None,
             usage: dict[str, int]) -> dict[str, Any]:
    return {"id": job.id, "type": "message", "role": "assistant", "model": job.model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}


# ----------------------------------------------------------------------------- handlers


async def messages(request: Request) -> Response:
    try:
        state = state_of(request)
        r = await read_checked(request, MessagesRequest, _NOOP)
        try:
            job = await prepare_off_loop(request, lambda: _chat_job(state, r))
        except InvalidRequest as e:
            raise _messages_error(e) from None
        await job.start()
        if r.stream:
            return EventStream(_stream(job, r))
        async with abort_on_disconnect(request, job.abort):
            (out,) = await job.final_outputs()
        reason, matched = finish_of(out)
        reasoning, text, calls, _ = job.post().full(out["text"], reason)
        content: list[dict[str, Any]] = [{"type": "thinking", "thinking": reasoning, "signature": ""}] if reasoning else []
        if text and (text.strip() or not calls):  # whitespace around tool calls is not a text block
            content.append({"type": "text", "text": text})
        content += [_tool_use(c) for c in calls or []]
        stop_reason, stop_sequence = _stop(reason, matched, r, bool(calls))
        return json_response(_message(job, content, stop_reason, stop_sequence, _usage(out)))
    except Exception as e:
        status, body = anthropic_error(e)
        if status >= 500 and not isinstance(e, ApiError):
            log.exception("anthropic.request_failed")
        return json_response(body, status)


async def count_tokens(request: Request) -> Response:
    try:
        state = state_of(request)
        r = await read_checked(request, CountTokensRequest, _NOOP)
        fields = {k: getattr(r, k) for k in CountTokensRequest.__struct_fields__}
        chat = chat_request(MessagesRequest(**fields, max_tokens=1 << 30))  # the same checks as /v1/messages

        def count() -> int:
            common_checks(chat, state.args.default_chat_template_kwargs)
            plan = plan_tools(state, chat)  # tools and tool_choice are checked as a request's would be
            return len(render_chat(state, chat, hide_tools=plan.hides_tools, fit=False))

        try:
            return json_response({"input_tokens": await prepare_off_loop(request, count)})
        except InvalidRequest as e:
            raise _messages_error(e) from None
    except Exception as e:
        status, body = anthropic_error(e)
        return json_response(body, status)


def _event(kind: str, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + encoder.encode({"type": kind, **fields}) + b"\n\n"


async def _stream(job: ChatJob, r: MessagesRequest) -> AsyncIterator[bytes]:
    """Anthropic's events for one message: each content block stops before the next starts;
    whitespace-only text is held until real text follows (around tool calls it is dropped, as
    the whole answer drops it)."""
    kinds: list[str] = []  # the kind of each block started so far
    open_kind: str | None = None  # the kind of the last block while it is open
    calls: dict[int, int] = {}  # tool-call index -> its block index
    pending_ws = ""
    out: dict | None = None
    reason = matched = None
    yield _event("message_start", message=_message(job, [], None, None, {
        "input_tokens": len(job.reqs[0].prompt_ids), "output_tokens": 0, "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0}))

    def start(kind: str, block: dict[str, Any]) -> list[bytes]:
        nonlocal open_kind
        events = [_event("content_block_stop", index=len(kinds) - 1)] if open_kind is not None else []
        kinds.append(kind)
        open_kind = kind
        return events + [_event("content_block_start", index=len(kinds) - 1, content_block=block)]

    try:
        async for out, _, r_delta, c_delta, call_deltas in choice_deltas(job):
            reason, matched = finish_of(out)
            if reason == "length" and open_kind == "tool_use":
                c_delta = ""  # a call cut off mid-way: the parser's leftover is that call's raw text
            if r_delta:
                if open_kind != "thinking":
                    for e in start("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                        yield e
                yield _event("content_block_delta", index=len(kinds) - 1,
                             delta={"type": "thinking_delta", "thinking": r_delta})
            if c_delta and open_kind != "text" and not (pending_ws + c_delta).strip():
                pending_ws += c_delta  # whitespace: held until text follows
            elif c_delta:
                if open_kind != "text":
                    for e in start("text", {"type": "text", "text": ""}):
                        yield e
                yield _event("content_block_delta", index=len(kinds) - 1,
                             delta={"type": "text_delta", "text": pending_ws + c_delta})
                pending_ws = ""
            for c in call_deltas:
                if c.get("id"):
                    pending_ws = ""
                    block = _tool_use({"function": {"name": c["function"].get("name", ""), "arguments": "{}"}})
                    for e in start("tool_use", {**block, "input": {}}):
                        yield e
                    calls[c["index"]] = len(kinds) - 1
                args = c["function"].get("arguments", "")
                if args and c["index"] in calls:
                    yield _event("content_block_delta", index=calls[c["index"]],
                                 delta={"type": "input_json_delta", "partial_json": args})
        if out is None:
            raise ApiError(500, "the request ended without output")
        if not kinds and pending_ws:  # nothing but whitespace: it is the answer
            for e in start("text", {"type": "text", "text": ""}):
                yield e
            yield _event("content_block_delta", index=0, delta={"type": "text_delta", "text": pending_ws})
        if open_kind is not None:
            yield _event("content_block_stop", index=len(kinds) - 1)
        stop_reason, stop_sequence = _stop(reason, matched, r, bool(calls))
        # the whole usage: what the cache held is known only once the request ran (message_start counted
        # the whole prompt as input_tokens; the SDKs take these figures over it)
        yield _event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                     usage=_usage(out))
        yield _event("message_stop")
    except Exception as e:
        if not isinstance(e, ApiError):
            log.exception("anthropic.stream_failed", id=job.id)
        _, body = anthropic_error(e)
        yield _event("error", error=body["error"])
    finally:
        job.abort()
