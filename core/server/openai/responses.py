"""OpenAI's Responses API (``/v1/responses``) over the chat pipeline, as SGLang and vLLM serve it.

A Responses request becomes a chat request (``instructions`` the system message, ``input`` the
messages, function tools in chat's shape, ``text.format`` the ``response_format``), runs through
:func:`core.server.openai.chat.prepare_chat`, and its output comes back as Responses items:
``reasoning`` (with ``--reasoning-parser``), ``message`` (``output_text``) and ``function_call``
(with ``--tool-call-parser``, or ``tool_choice`` required / named).

* Streaming sends OpenAI's typed events (``response.created`` ... ``response.completed``, each
  with ``event:`` and a ``sequence_number``), no ``[DONE]``; a failure mid-stream is
  ``response.failed``. The openai client's ``responses.stream()`` helper accumulates them.
* ``store`` (default true) keeps the response in memory, at most :data:`MAX_STORED` (the oldest
  goes first): ``GET``/``DELETE /v1/responses/{id}``, ``GET .../input_items``, and
  ``previous_response_id`` continues its conversation (its input and output, not its
  ``instructions``, as OpenAI does). A restart forgets them.
* ``background`` (with ``store``): the answer is the response ``queued``; it runs on, ``in_progress``,
  to ``completed`` (``incomplete``, ``failed``) in the store, where ``GET`` polls it, and ``POST
  /v1/responses/{id}/cancel`` stops it (``cancelled``; a finished one is returned as it is, as
  SGLang). Streamed, a background response streams on its connection, as SGLang's.
* Refused with a 400 rather than ignored: ``conversation``, ``prompt`` templates,
  non-function tools (web search, file search...), image / file / audio input parts,
  ``truncation: auto``, and ``item_reference`` items.
* Finishing on ``max_output_tokens`` gives status ``incomplete`` with
  ``incomplete_details.reason`` ``max_output_tokens``, and so does the last output item: a tool
  call cut off mid-way is an ``incomplete`` ``function_call`` (its arguments as far as they were
  written), streamed or whole, never also a message (as chat completions does).
* With a reasoning parser, ``output_text`` logprobs cover the text's own tokens (the reasoning's
  are dropped), and whitespace-only text around tool calls is no message.
"""

from __future__ import annotations

import asyncio
import collections
import re
import uuid
from typing import Any, AsyncIterator

import msgspec
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
    prepare_off_loop,
    state_of,
)
from core.server.openai.chat import ChatJob, choice_deltas, joined_text, prepare_chat
from core.server.openai.job import REASONING_EFFORTS, effort_template_kwargs, finish_of, read_checked, reasoning_tokens
from core.server.openai.logprobs import chat_logprobs
from core.server.openai.protocol import ChatCompletionRequest

log = structlog.get_logger("core.server.openai.responses")

MAX_STORED = 1024
_TEXT_PARTS = ("input_text", "output_text", "text")
_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_INCLUDES = ("message.output_text.logprobs", "reasoning.encrypted_content")  # the latter: there is none to include
# chat-request field -> the Responses field a client sent (for error messages)
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}


class ResponsesRequest(Struct, kw_only=True):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    stream: bool | None = False
    store: bool | None = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None
    # refused when set (features this server does not have)
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    # SGLang's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    request_id: str | None = None
    priority: int | None = None


# the Responses API's fields for features this server lacks, accepted only at these values (the
# unknown-field policy of ``core.server.openai.protocol``; its ignored fields apply too). Obfuscation
# padding changes no output, so either value of include_obfuscation is taken.
_NOOP = {"max_tool_calls": (None,), "stream_options": (None, {}, {"include_obfuscation": False},
                                                       {"include_obfuscation": True})}


class Stored(Struct):
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # chat messages: the inputs so far and this response's output
    input_items: list[dict[str, Any]]


def _store(request: Request) -> collections.OrderedDict[str, Stored]:
    store = getattr(request.app.state, "responses_store", None)
    if store is None:
        store = request.app.state.responses_store = collections.OrderedDict()
    return store


def _not_found(ident: str, param: str = "response_id") -> ApiError:
    return ApiError(404, f"Response with id '{ident}' not found.", param=param, code="not_found")


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


# ----------------------------------------------------------------------------- request -> chat


def input_items(inp: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input as Responses items, each with an id (what ``input_items`` lists)."""
    if isinstance(inp, str):
        return [{"type": "message", "id": _new_id("msg_"), "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": inp}]}]
    if not inp:
        raise InvalidRequest("input must not be empty", param="input")
    items = []
    for i, item in enumerate(inp):
        if not isinstance(item, dict):
            raise InvalidRequest(f"input[{i}] must be an object", param="input")
        kind = item.get("type", "message")
        prefix = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_"}.get(kind, "item_")
        typed = {**item, "type": kind, "id": item.get("id") or _new_id(prefix)}
        if kind == "message" and isinstance(item.get("content"), str):  # as the API lists it: a list of parts
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            typed["content"] = [{"type": part, "text": item["content"]}]
        items.append(typed)
    return items


def item_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses items -> chat messages; function calls join the assistant turn before them (a
    response's output lists its text and its calls as separate items), else make one."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind, where = item["type"], f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequest(f"{where}.role must be user, assistant, system or developer, got {role!r}", param="input")
            text = joined_text(item.get("content"), f"{where}.content", _TEXT_PARTS, "input")
            out.append({"role": role, "content": text})
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments", ""), item.get("call_id")
            if not isinstance(name, str) or not isinstance(args, str) or not isinstance(call_id, str):
                raise InvalidRequest(f"{where}: a function_call needs call_id, name and arguments (strings)", param="input")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant":  # the turn's text and calls (as a response's output splits them)
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output, call_id = item.get("output"), item.get("call_id")
            if not isinstance(call_id, str):
                raise InvalidRequest(f"{where}: a function_call_output needs call_id (a string)", param="input")
            text = joined_text(output, f"{where}.output", _TEXT_PARTS, "input")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            continue  # the templates drop earlier turns' reasoning
        else:
            raise InvalidRequest(f"{where}: input items of type {kind!r} are not supported", param="input")
    return out


def _chat_tools(r: ResponsesRequest) -> tuple[list[dict] | None, Any]:
    tools = None
    if r.tools is not None:
        tools = []
        for i, t in enumerate(r.tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else t
                raise InvalidRequest(f"tools[{i}]: only function tools are supported, got {kind!r}", param="tools")
            if not isinstance(t.get("name"), str) or not t["name"]:
                raise InvalidRequest(f"tools[{i}].name is required (a non-empty string)", param="tools")
            fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
            tools.append({"type": "function", "function": fn})
    choice = r.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise InvalidRequest("tool_choice must be auto, none, required or {\"type\": \"function\", \"name\": ...}",
                                 param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise InvalidRequest(f"text.format type {kind!r} is not supported; use text, json_object or json_schema", param="text")


def chat_request(r: ResponsesRequest, history: list[dict[str, Any]], items: list[dict[str, Any]]) -> ChatCompletionRequest:
    if r.background and r.store is False:
        raise InvalidRequest("background=true requires store=true.", param="store")
    for name in ("conversation", "prompt"):
        if getattr(r, name):
            raise InvalidRequest(f"{name} is not supported by this server", param=name)
    if r.truncation not in (None, "disabled"):
        raise InvalidRequest("only truncation 'disabled' is supported", param="truncation")
    effort = (r.reasoning or {}).get("effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise InvalidRequest(f"reasoning.effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}", param="reasoning")
    if r.request_id is not None and not _ID_RE.fullmatch(r.request_id):
        raise InvalidRequest("request_id must be 1-128 letters, digits, '_', '-', '.' or ':'", param="request_id")
    messages = ([{"role": "system", "content": r.instructions}] if r.instructions else []) + history + item_messages(items)
    called = {c["id"] for m in messages for c in m.get("tool_calls") or []}
    for m in messages:
        if m["role"] == "tool" and m["tool_call_id"] not in called:
            raise InvalidRequest(f"no function call with call_id {m['tool_call_id']!r} for its function_call_output",
                                 param="input")
    tools, choice = _chat_tools(r)
    kwargs = effort_template_kwargs(effort, r.chat_template_kwargs)
    unknown = [x for x in r.include or [] if x not in _INCLUDES]
    if unknown:
        raise InvalidRequest(f"include {unknown[0]!r} is not supported; supported: {', '.join(_INCLUDES)}",
                             param="include")
    logprobs = "message.output_text.logprobs" in (r.include or []) or bool(r.top_logprobs)
    body = {"model": r.model, "messages": messages, "max_tokens": r.max_output_tokens, "temperature": r.temperature,
            "top_p": r.top_p, "tools": tools, "tool_choice": choice, "parallel_tool_calls": r.parallel_tool_calls,
            "response_format": _response_format(r.text), "logprobs": logprobs,
            "top_logprobs": (r.top_logprobs or 0) if logprobs else None, "stream": bool(r.stream), "top_k": r.top_k,
            "min_p": r.min_p, "repetition_penalty": r.repetition_penalty, "frequency_penalty": r.frequency_penalty,
            "presence_penalty": r.presence_penalty, "stop": r.stop, "seed": r.seed, "ignore_eos": r.ignore_eos,
            "user": r.user,
            "chat_template_kwargs": kwargs or None, "priority": r.priority}
    return convert_body({k: v for k, v in body.items() if v is not None}, ChatCompletionRequest)


def _responses_error(e: InvalidRequest) -> InvalidRequest:
    """A chat pipeline error in the Responses API's field names."""
    if e.param is None:
        return e
    head = e.param.split("[")[0].split(".")[0]
    if head not in _PARAMS:
        return e
    return InvalidRequest(e.message.replace(head, _PARAMS[head]), param=_PARAMS[head])


# ----------------------------------------------------------------------------- output


def _usage(job: ChatJob, out: dict, reasoning: str | None) -> dict[str, Any]:
    """The response's usage; its reasoning tokens counted in the output's tokens as chat's usage
    counts them (``job.reasoning_ids``, ``reasoning_tokens``: through the end tag)."""
    meta = out["meta_info"]
    prompt, completion = meta["prompt_tokens"], meta["completion_tokens"]
    ids = job.reasoning_ids
    thought = reasoning_tokens(out["output_ids"], *ids) if reasoning and ids else 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": meta.get("cached_tokens", 0) or 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": thought},
            "total_tokens": prompt + completion}


def _logprob_entries(job: ChatJob, meta: dict, start: int) -> list[dict[str, Any]]:
    lp = chat_logprobs(job.vocab, meta, start, job.top)
    return msgspec.to_builtins(lp.content or [])


def _content_logprobs(entries: list[dict[str, Any]], content: str) -> list[dict[str, Any]]:
    """With a reasoning parser the output's first tokens were reasoning: keep the trailing entries
    whose tokens spell ``content`` (plus a final EOS or stop token, which shows no text)."""
    want = content.strip()
    end = len(entries)
    if end and not want.endswith(entries[-1]["token"].strip() or "\0"):
        end -= 1
    acc, i = "", end
    while i > 0 and len(acc.strip()) < len(want):
        i -= 1
        acc = entries[i]["token"] + acc
    return entries[i:]


def _message_item(text: str, status: str, logprobs: list | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"type": "message", "id": _new_id("msg_"), "status": status, "role": "assistant", "content": [part]}


def _reasoning_item(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": _new_id("rs_"), "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": "completed"}


def _call_item(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    return {"type": "function_call", "id": _new_id("fc_"), "call_id": call["id"], "name": fn.get("name", ""),
            "arguments": fn.get("arguments", ""), "status": "completed"}


def _response(job: ChatJob, r: ResponsesRequest, status: str, output: list[dict], usage: dict | None,
              error: dict | None = None) -> dict[str, Any]:
    effort = (r.reasoning or {}).get("effort")
    return {
        "id": job.id, "object": "response", "created_at": job.created, "status": status, "model": job.model,
        "background": bool(r.background),
        "output": output, "usage": usage, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "metadata": r.metadata or {},
        "parallel_tool_calls": r.parallel_tool_calls is not False, "previous_response_id": r.previous_response_id,
        "reasoning": {"effort": effort, "summary": None}, "store": r.store is not False,
        "temperature": 1.0 if r.temperature is None else r.temperature, "text": r.text or {"format": {"type": "text"}},
        "tool_choice": r.tool_choice or "auto", "tools": r.tools or [],
        "top_p": 1.0 if r.top_p is None else r.top_p, "truncation": r.truncation or "disabled", "user": r.user,
    }


def _status(reason: str | None) -> str:
    return "incomplete" if reason == "length" else "completed"


def _output_messages(output: list[dict]) -> list[dict[str, Any]]:
    """This response's output as chat messages, for a later ``previous_response_id``."""
    content, calls = "", []
    for item in output:
        if item["type"] == "message":
            content += "".join(p["text"] for p in item["content"])
        elif item["type"] == "function_call":
            calls.append({"id": item["call_id"], "type": "function",
                          "function": {"name": item["name"], "arguments": item["arguments"]}})
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = calls
    return [msg]


# ----------------------------------------------------------------------------- handlers


async def create_response(request: Request) -> Response:
    state = state_of(request)
    r = await read_checked(request, ResponsesRequest, _NOOP)
    store = _store(request)
    history: list[dict[str, Any]] = []
    if r.previous_response_id is not None:
        prev = store.get(r.previous_response_id)
        if prev is None:
            raise _not_found(r.previous_response_id, "previous_response_id")
        history = prev.conversation
    items = input_items(r.input)
    try:
        job = await prepare_off_loop(request, lambda: prepare_chat(state, chat_request(r, history, items),
                                                                   r.request_id or _new_id("resp_")))
    except InvalidRequest as e:
        raise _responses_error(e) from None
    await job.start()

    def keep(response: dict[str, Any]) -> None:
        if r.store is False:
            return
        store[job.id] = Stored(response, history + item_messages(items) + _output_messages(response["output"]), items)
        while len(store) > MAX_STORED:
            store.popitem(last=False)

    if r.stream:
        return EventStream(_stream(job, r, keep))
    if r.background:  # (the store holds it as it goes: queued, in progress, then the full response)
        queued = _response(job, r, "queued", [], None)
        keep(queued)
        task = asyncio.create_task(_background(job, r, keep, store))
        tasks = _background_tasks(request)
        tasks[job.id] = job, task
        task.add_done_callback(lambda _: tasks.pop(job.id, None))
        return json_response(queued)
    async with abort_on_disconnect(request, job.abort):
        (out,) = await job.final_outputs()
    response = _full_response(job, r, out)
    keep(response)
    return json_response(response)


def _background_tasks(request: Request) -> dict[str, tuple[ChatJob, asyncio.Task]]:
    tasks = getattr(request.app.state, "responses_background", None)
    if tasks is None:
        tasks = request.app.state.responses_background = {}
    return tasks


async def _background(job: ChatJob, r: ResponsesRequest, keep: Any, store: dict[str, Stored]) -> None:
    """A background response's run: its stored status ``in_progress``, then its full response, or
    ``failed`` with the error (never over a cancel)."""
    if (entry := store.get(job.id)) is not None:
        entry.response = {**entry.response, "status": "in_progress"}
    try:
        (out,) = await job.final_outputs()
        response = _full_response(job, r, out)
    except Exception as e:  # (an engine failure: the stored response says so, the server goes on)
        log.warning("responses.background_failed", id=job.id, error=str(e))
        response = _response(job, r, "failed", [], None, {"code": "server_error", "message": str(e)})
    if (entry := store.get(job.id)) is not None and entry.response["status"] != "cancelled":
        keep(response)


async def cancel_response(request: Request) -> Response:
    """``POST /v1/responses/{id}/cancel``: a queued or running background response stops, ``cancelled``;
    any other is returned as it is (SGLang's)."""
    ident = request.path_params["response_id"]
    stored = _store(request).get(ident)
    if stored is None:
        raise _not_found(ident)
    if stored.response["status"] in ("queued", "in_progress"):
        stored.response = {**stored.response, "status": "cancelled"}
        if (running := _background_tasks(request).pop(ident, None)) is not None:
            job, task = running
            job.abort()
            task.cancel()
    return json_response(stored.response)


def _full_response(job: ChatJob, r: ResponsesRequest, out: dict[str, Any]) -> dict[str, Any]:
    """The whole response from a request's final output."""
    reason, _ = finish_of(out)
    reasoning, content, calls, reason = job.post().full(out["text"], reason)
    status = _status(reason)
    if calls and not (content or "").strip():
        content = None  # whitespace around the calls is not a message
    output = []
    if reasoning:
        output.append(_reasoning_item(reasoning))
    if content or not (calls or reasoning):  # an empty message only when there is nothing else
        lp = None
        if job.logprobs:
            lp = _logprob_entries(job, out["meta_info"], 0)
            lp = _content_logprobs(lp, content or "") if reasoning else lp
        output.append(_message_item(content or "", "completed", lp))
    output += [_call_item(c) for c in calls or []]
    output[-1]["status"] = status  # the item the output ended in, as the stream closes it
    return _response(job, r, status, output, _usage(job, out, reasoning))


class _Events:
    """Typed SSE events with a running ``sequence_number``."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + encoder.encode(data) + b"\n\n"


async def _stream(job: ChatJob, r: ResponsesRequest, keep: Any) -> AsyncIterator[bytes]:
    """The typed events of one response. Items open and close in order (each is done before the
    next is added); whitespace-only text is held until real text follows (around tool calls it
    is dropped, as the whole answer drops it); logprobs go with the output_text they spell."""
    ev = _Events()
    yield ev("response.created", response=_response(job, r, "in_progress", [], None))
    yield ev("response.in_progress", response=_response(job, r, "in_progress", [], None))
    output: list[dict[str, Any]] = []
    open_item: dict[str, Any] | None = None  # the item deltas go to
    calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its item
    reasoning_text, pending_ws = "", ""
    pending_lp: list[dict[str, Any]] = []  # logprobs of tokens whose text has not shown yet

    def close(item: dict[str, Any], status: str = "completed") -> list[bytes]:
        idx = output.index(item)
        item["status"] = status
        if item["type"] == "function_call":
            return [ev("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                       name=item["name"], arguments=item["arguments"]),
                    ev("response.output_item.done", output_index=idx, item=item)]
        part = item["content"][0]
        if item["type"] == "reasoning":
            done = ev("response.reasoning_text.done", item_id=item["id"], output_index=idx, content_index=0, text=part["text"])
        else:
            done = ev("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                      text=part["text"], logprobs=part.get("logprobs", []))
        return [done, ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0, part=part),
                ev("response.output_item.done", output_index=idx, item=item)]

    def open_(item: dict[str, Any]) -> list[bytes]:
        nonlocal open_item
        events = close(open_item) if open_item is not None else []
        output.append(item)
        open_item, idx = item, len(output) - 1
        if item["type"] == "function_call":
            return events + [ev("response.output_item.added", output_index=idx,
                                item={**item, "arguments": "", "status": "in_progress"})]
        part = item["content"][0]
        return events + [ev("response.output_item.added", output_index=idx, item={**item, "content": [], "status": "in_progress"}),
                         ev("response.content_part.added", item_id=item["id"], output_index=idx, content_index=0,
                            part={**part, "text": ""})]

    def is_open(kind: str) -> bool:
        return open_item is not None and open_item["type"] == kind

    out: dict | None = None
    reason = None
    try:
        async for out, start, r_delta, c_delta, call_deltas in choice_deltas(job):
            reason, _ = finish_of(out)
            if job.logprobs:
                pending_lp += _logprob_entries(job, out["meta_info"], start)
            if r_delta:
                if not c_delta:
                    pending_lp = []  # reasoning tokens: not output_text's (a step holding both: cut below)
                if not is_open("reasoning"):
                    for e in open_(_reasoning_item("")):
                        yield e
                open_item["content"][0]["text"] += r_delta
                reasoning_text += r_delta
                yield ev("response.reasoning_text.delta", item_id=open_item["id"], output_index=output.index(open_item),
                         content_index=0, delta=r_delta)
            elif is_open("reasoning") and not c_delta:
                pending_lp = []  # still reasoning (or its closing tag)
            if c_delta and not is_open("message") and not (pending_ws + c_delta).strip():
                pending_ws += c_delta  # whitespace: held until text follows
            elif c_delta:
                first = not is_open("message")
                if first:
                    for e in open_(_message_item("", "in_progress", [] if job.logprobs else None)):
                        yield e
                text, pending_ws = pending_ws + c_delta, ""
                part = open_item["content"][0]
                part["text"] += text
                lps, pending_lp = pending_lp, []
                if first and reasoning_text:  # the step's tokens before the text: the reasoning's, its closing tag
                    lps = _content_logprobs(lps, text)
                if job.logprobs:
                    part["logprobs"] += lps
                yield ev("response.output_text.delta", item_id=open_item["id"], output_index=output.index(open_item),
                         content_index=0, delta=text, logprobs=lps)
            for c in call_deltas:
                if c.get("id"):
                    pending_ws = ""
                    for e in open_(_call_item({**c, "function": {**c["function"], "arguments": ""}})):
                        yield e
                    calls[c["index"]] = output[-1]
                item = calls.get(c["index"])
                args = c["function"].get("arguments", "")
                if item is None or not args:
                    continue
                item["arguments"] += args
                yield ev("response.function_call_arguments.delta", item_id=item["id"], output_index=output.index(item),
                         delta=args)
        if out is None:
            raise ApiError(500, "the request ended without output")
        status = _status(reason)
        if not output:  # nothing but whitespace, or nothing: one message, as the whole answer has
            for e in open_(_message_item("", "in_progress", [] if job.logprobs else None)):
                yield e
            if pending_ws:
                open_item["content"][0]["text"] = pending_ws
                yield ev("response.output_text.delta", item_id=open_item["id"], output_index=0, content_index=0,
                         delta=pending_ws, logprobs=[])
        if pending_lp and is_open("message"):  # a last token with no text (EOS, a stop token): as the whole answer
            open_item["content"][0]["logprobs"] += pending_lp
            yield ev("response.output_text.delta", item_id=open_item["id"], output_index=output.index(open_item),
                     content_index=0, delta="", logprobs=pending_lp)
        if open_item is not None:
            for e in close(open_item, status):
                yield e
        response = _response(job, r, status, output, _usage(job, out, reasoning_text))
        keep(response)
        yield ev("response.completed" if status == "completed" else "response.incomplete", response=response)
    except Exception as e:
        if not isinstance(e, ApiError):
            log.exception("responses.stream_failed", id=job.id)
        err = api_error(e)
        yield ev("response.failed", response=_response(job, r, "failed", output, None,
                                                        {"code": "server_error", "message": err.message}))
    finally:
        job.abort()


async def retrieve_response(request: Request) -> Response:
    ident = request.path_params["response_id"]
    stored = _store(request).get(ident)
    if stored is None:
        raise _not_found(ident)
    return json_response(stored.response)


async def delete_response(request: Request) -> Response:
    ident = request.path_params["response_id"]
    if _store(request).pop(ident, None) is None:
        raise _not_found(ident)
    return json_response({"id": ident, "object": "response", "deleted": True})


async def list_input_items(request: Request) -> Response:
    ident = request.path_params["response_id"]
    stored = _store(request).get(ident)
    if stored is None:
        raise _not_found(ident)
    q = request.query_params
    order, limit, after = q.get("order", "desc"), q.get("limit", "20"), q.get("after")
    if order not in ("asc", "desc"):
        raise InvalidRequest(f"order must be asc or desc, got {order!r}", param="order")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise InvalidRequest(f"limit must be an integer from 1 to 100, got {limit!r}", param="limit")
    items = stored.input_items if order == "asc" else list(reversed(stored.input_items))
    if after is not None:
        ids = [it["id"] for it in items]
        if after not in ids:
            raise InvalidRequest(f"no input item {after!r} in response {ident!r}", param="after")
        items = items[ids.index(after) + 1:]
    data = items[: int(limit)]
    return json_response({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                          "last_id": data[-1]["id"] if data else None, "has_more": len(items) > len(data)})
