"""The OpenAI API's HTTP handlers (chat, completions, models), the batch runner's entry
(:func:`run_request`) and SGLang's parser endpoints (/parse_function_call, /separate_reasoning).
``core.server.app`` mounts them in its route table.

Policies (SGLang's behaviour unless noted):

* Model names: any ``model`` value is accepted, as SGLang does; responses echo the
  requested name (the served name when the request has none). With ``--enable-lora``,
  ``"<base>:<adapter>"`` or a loaded adapter's name runs the request under that adapter
  (SGLang's rule, in ``core.server.lora``; it wins over the ``lora_path`` extension); an adapter
  that is not loaded is a 400 naming it. ``/v1/models`` lists the served model, then each loaded
  adapter (``root`` its path, ``parent`` the served name); ``GET /v1/models/{id}`` answers 404
  for any id but those.
* Unknown request fields are a 400 naming the field, except a documented allowlist of other
  servers' harmless fields, ignored with a warning, and of features this server lacks, accepted
  when off (see ``core.server.openai.protocol``); known but unsupported ones (``suffix``,
  ``best_of`` != ``n``) are a 400. ``logit_bias`` (token id -> -100..100) is added to the logits
  after the penalties. Structured output (``response_format``, SGLang's ``regex`` /
  ``json_schema`` / ``ebnf``, vLLM's ``structured_outputs`` and ``guided_*``) goes to the grammar
  backend, at most one constraint per request.
* Tools: ``tools`` reach the chat template; with ``--tool-call-parser`` the calls are parsed out
  of the output into ``tool_calls`` (streamed incrementally); ``tool_choice`` ``required`` or a
  named function constrains the output so the call always parses; with ``--reasoning-parser``
  reasoning goes to ``reasoning_content``. See ``core.server.openai.tools``.
* ``n`` is 1..128; a completions request holds at most 4096 sequences in all.
* ``temperature`` is 0..2 (OpenAI's range), ``top_logprobs`` / completions ``logprobs`` 0..20.
* ``max_tokens`` (chat: ``max_completion_tokens`` wins over ``max_tokens``): an omitted or
  null value means "until the context (or the KV pool) is full", except completions,
  where an omitted ``max_tokens`` is OpenAI's 16 and an explicit null means unlimited.
* Context: a prompt of >= context-length tokens, or prompt + max_tokens over the context
  length, is a 400 naming both numbers. With ``--allow-auto-truncate`` the prompt keeps its
  head, the first context-length - 1 tokens, as on /generate and in SGLang, and ``max_tokens``
  is cut to what still fits.
* Content parts: ``text`` parts of a message are joined with "\\n". ``image_url`` parts (a data URI,
  base64, an http(s) URL unless the server runs offline, a local path under
  ``--allowed-local-media-path``; ``detail`` is accepted and left to the model's processor) reach a
  vision-language model served with ``--enable-multimodal``: the template gets ``{"type": "image"}``
  parts, the engine the decoded images (``core.server.multimodal``); with a text-only model they
  are a 400 saying so. Any other part type (``input_audio``, ``file``...) is a 400.
  Role ``developer`` is given to the template as ``system``.
* ``finish_reason`` is ``stop`` (EOS, stop token or stop string; SGLang's ``matched_stop``
  names it), ``length`` or ``tool_calls``. A request the engine aborts (forward failure,
  shutdown) is a 500 (503 on shutdown) for non-streaming requests and a ``data: {"error": ...}``
  event followed by ``data: [DONE]`` in a stream; the OpenAI client raises on both. A client
  that disconnects aborts its engine requests.
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
import time
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from core.errors import InvalidRequest
from core.server.http import (
    ApiError,
    EventStream,
    abort_on_disconnect,
    api_error,
    convert_body,
    json_response,
    prepare_off_loop,
    read_body,
    state_of,
)
from core.server.lora import loaded_adapters
from core.server.multimodal import has_image_parts
from core.server.openai.chat import chat_response, chat_stream, prepare_chat
from core.server.openai.completions import completion_response, completion_stream, prepare_completion
from core.server.openai.job import check_fields, read_checked
from core.server.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from core.server.openai.tools import check_tools

_STARTED = int(time.time())


def _dp_rank_header(request: Request, r: Any) -> Any:
    """SGLang's ``X-Data-Parallel-Rank`` header, over the body's ``routed_dp_rank``."""
    if (value := request.headers.get("x-data-parallel-rank")) is not None:
        try:
            r.routed_dp_rank = int(value)
        except ValueError:
            raise InvalidRequest(f"X-Data-Parallel-Rank must be an integer, got {value!r}", param="routed_dp_rank") from None
    return r


async def chat_completions(request: Request) -> Response:
    state = state_of(request)
    r = _dp_rank_header(request, await read_checked(request, ChatCompletionRequest))
    job = await (asyncio.to_thread(prepare_chat, state, r) if has_image_parts(r.messages)  # images: off the loop
                 else prepare_off_loop(request, prepare_chat, state, r))
    await job.start()
    if job.stream:
        return EventStream(job.guarded(chat_stream(job)))
    async with abort_on_disconnect(request, job.abort):
        resp = await chat_response(job)
    return json_response(resp)


async def completions(request: Request) -> Response:
    state = state_of(request)
    r = _dp_rank_header(request, await read_checked(request, CompletionRequest))
    job = await prepare_off_loop(request, prepare_completion, state, r)
    await job.start()
    if job.stream:
        return EventStream(job.guarded(completion_stream(job)))
    async with abort_on_disconnect(request, job.abort):
        resp = await completion_response(job)
    return json_response(resp)


async def run_request(state: Any, endpoint: str, body: Any, request_id: str | None = None) -> tuple[int, dict]:
    """Run one non-streaming chat/completions request given as parsed JSON (a batch line).
    Returns (HTTP status, JSON-ready body); a failure is its error object, never an exception."""
    try:
        if not isinstance(body, dict):
            raise InvalidRequest("the request body must be a JSON object")
        if body.get("stream"):
            raise InvalidRequest("streaming is not supported in batch requests", param="stream")
        if endpoint == "/v1/chat/completions":
            r: Any = convert_body(body, ChatCompletionRequest)
            check_fields(body, ChatCompletionRequest)
            job: Any = (await asyncio.to_thread(prepare_chat, state, r, request_id) if has_image_parts(r.messages)
                        else prepare_chat(state, r, request_id))
            respond: Any = chat_response
        elif endpoint == "/v1/completions":
            r = convert_body(body, CompletionRequest)
            check_fields(body, CompletionRequest)
            job = prepare_completion(state, r, request_id)
            respond = completion_response
        else:
            raise InvalidRequest(f"unsupported endpoint {endpoint!r}", param="endpoint")
        await job.start()
        return 200, msgspec.to_builtins(await respond(job))
    except Exception as e:
        err = api_error(e)
        return err.status, err.to_dict()


def _model_cards(state: Any) -> list[ModelCard]:
    """The served model, then each loaded LoRA adapter (as SGLang lists them)."""
    mc = state.engine.model_config
    root = state.model_path or str(getattr(mc, "source", "")) or None
    base = ModelCard(id=state.served_model_name, created=_STARTED, root=root, max_model_len=mc.context_len)
    return [base] + [ModelCard(id=name, created=_STARTED, root=path, parent=state.served_model_name)
                     for name, path in loaded_adapters(state.engine).items()]


async def list_models(request: Request) -> Response:
    return json_response(ModelList(data=_model_cards(state_of(request))))


async def retrieve_model(request: Request) -> Response:
    model_id = request.path_params["model_id"]
    for card in _model_cards(state_of(request)):
        if card.id == model_id:
            return json_response(card)
    raise ApiError(404, f"The model '{model_id}' does not exist", param="model", code="model_not_found")


# ----------------------------------------------------------------------------- SGLang's parser endpoints


def _parser_name(state: Any, kind: str, asked: Any, default: str | None, param: str) -> str:
    name = asked or default
    names = state.engine.plugins.names(kind)
    if not (isinstance(name, str) and name in names):
        raise InvalidRequest(f"unknown {param} {name!r}; registered: {', '.join(names)}", param=param)
    return name


async def parse_function_call(request: Request) -> Response:
    """SGLang's /parse_function_call: {text, tool_call_parser, tools} -> {normal_text, calls}."""
    body = await read_body(request, dict[str, Any])
    text, tools = body.get("text"), body.get("tools") or []
    if not isinstance(text, str):
        raise InvalidRequest("text must be a string", param="text")
    check_tools(tools)
    state = state_of(request)
    name = _parser_name(state, "tool_parser", body.get("tool_call_parser"), state.args.tool_call_parser,
                        "tool_call_parser")
    normal, calls = state.engine.plugins.resolve("tool_parser", name)().parse(text, tools)
    return json_response({"normal_text": normal, "calls": [
        {"tool_index": c.index, "name": c.name, "parameters": c.arguments} for c in calls]})


async def separate_reasoning(request: Request) -> Response:
    """SGLang's /separate_reasoning: {text, reasoning_parser} -> {text, reasoning_text}."""
    body = await read_body(request, dict[str, Any])
    text = body.get("text")
    if not isinstance(text, str):
        raise InvalidRequest("text must be a string", param="text")
    state = state_of(request)
    name = _parser_name(state, "reasoning_parser", body.get("reasoning_parser"), state.args.reasoning_parser,
                        "reasoning_parser")
    reasoning, content = state.engine.plugins.resolve("reasoning_parser", name)().parse(text)
    return json_response({"text": content, "reasoning_text": reasoning})
