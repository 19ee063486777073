"""/tokenize and /detokenize (also under /v1/), as SGLang and vLLM serve them.

A client counts a prompt's tokens before paying to submit it, so /tokenize takes any length
the body limit lets through (a prompt longer than the context is counted, not refused), and
tokenizes in a worker thread: a multi-megabyte text never stalls the event loop that streams
the running requests. ``messages`` go through the chat template as /v1/chat/completions
renders them, so the count is the prompt a chat request would send.

Request and response fields (SGLang's, plus vLLM's ``messages`` form and ``return_token_strs``):

* ``POST /tokenize`` ``{"prompt": str | [str], "add_special_tokens": true}`` or
  ``{"messages": [...], "add_generation_prompt": true, "tools": ..., "chat_template_kwargs": ...}``
  -> ``{"tokens": [int] | [[int]], "count": int | [int], "max_model_len": int}``
  (``max_model_len`` is the served context length; ``token_strs`` with ``return_token_strs``).
* ``POST /detokenize`` ``{"tokens": [int] | [[int]], "skip_special_tokens": true}``
  -> ``{"text": str | [str], "prompt": str | [str]}`` (SGLang's key and vLLM's, the same text).
  Ids outside the model's vocabulary are a 400.
* ``GET /tokenizer_info`` (vLLM's, served without its ``--enable-tokenizer-info-endpoint``): the
  tokenizer's config (``init_kwargs`` less file paths), ``tokenizer_class``, the special tokens
  and the chat template chat requests are rendered with. lm-eval's ``tokenizer_backend=remote``
  reads ``eos_token``, ``bos_token``, ``pad_token`` and ``chat_template`` from it, and then
  counts and decodes through /tokenize and /detokenize.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from core.errors import CoreError, InvalidRequest
from core.server.http import ApiError, convert_body, json_response, read_body, state_of
from core.server.openai.chat import load_chat_template, render_chat
from core.server.openai.job import apply_reasoning_effort
from core.server.openai.protocol import ChatCompletionRequest


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template has them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # "none": the template gets no tools, as chat renders it
    reasoning_effort: str | None = None  # into the template kwargs, as chat's
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int | list[int]]  # msgspec takes one list type in a union: mixed lists are refused below
    skip_special_tokens: bool = True


def _tokenizer(state: Any) -> Any:
    tok = state.engine.tokenizer
    if tok is None:
        raise InvalidRequest("the tokenizer is disabled (--skip-tokenizer-init)")
    return tok


def _token_ids(state: Any, r: TokenizeRequest) -> list[list[int]] | list[int]:
    tok = _tokenizer(state)
    if (r.prompt is None) == (r.messages is None):
        raise InvalidRequest("give exactly one of prompt and messages", param="prompt")
    if r.messages is not None:
        if not r.messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        chat = convert_body({"messages": r.messages, "tools": r.tools, "tool_choice": r.tool_choice,
                             "reasoning_effort": r.reasoning_effort, "chat_template_kwargs": r.chat_template_kwargs,
                             "continue_final_message": r.continue_final_message}, ChatCompletionRequest)
        apply_reasoning_effort(chat, state.args.default_chat_template_kwargs)  # (the chat prompt's count: same inputs)
        return render_chat(state, chat, add_generation_prompt=r.add_generation_prompt, fit=False,
                           add_special_tokens=bool(r.add_special_tokens))
    special = r.add_special_tokens is not False
    if isinstance(r.prompt, str):
        return tok.encode(r.prompt, add_special_tokens=special)
    if not r.prompt:
        raise InvalidRequest("prompt must not be an empty list", param="prompt")
    return [tok.encode(p, add_special_tokens=special) for p in r.prompt]


async def tokenize(request: Request) -> Response:
    state = state_of(request)
    r = await read_body(request, TokenizeRequest)
    ids = await asyncio.to_thread(_token_ids, state, r)
    batch = bool(ids) and isinstance(ids[0], list)
    out: dict[str, Any] = {"tokens": ids, "count": [len(x) for x in ids] if batch else len(ids),
                           "max_model_len": state.context_len}
    if r.return_token_strs:
        tok = state.engine.tokenizer
        out["token_strs"] = [tok.convert_ids_to_tokens(x) for x in ids] if batch else tok.convert_ids_to_tokens(ids)
    return json_response(out)


async def detokenize(request: Request) -> Response:
    state = state_of(request)
    r = await read_body(request, DetokenizeRequest)
    tok = _tokenizer(state)
    batch = bool(r.tokens) and isinstance(r.tokens[0], list)
    if any(isinstance(t, list) != batch for t in r.tokens):
        raise InvalidRequest("tokens must be a list of token ids or a list of token id lists", param="tokens")
    lists: list[list[int]] = r.tokens if batch else [r.tokens]  # type: ignore[assignment, list-item]
    vocab = state.engine.vocab_size
    for ids in lists:
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
    texts = await asyncio.to_thread(
        lambda: [tok.decode(ids, skip_special_tokens=r.skip_special_tokens) for ids in lists])
    text = texts if batch else texts[0]
    return json_response({"text": text, "prompt": text})


_PATH_KWARGS = ("vocab_file", "merges_file", "tokenizer_file")  # files on the server, as vLLM leaves out
_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _plain(value: Any) -> Any:
    """A tokenizer config value as JSON: an ``AddedToken`` as its text, what JSON cannot hold as null."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return value if value is None or isinstance(value, (str, int, bool)) else None


async def tokenizer_info(request: Request) -> Response:
    """vLLM's ``GET /tokenizer_info`` (see the module docstring)."""
    state = state_of(request)
    tok = _tokenizer(state)
    info = {k: v for k, v in _plain(dict(getattr(tok, "init_kwargs", None) or {})).items() if k not in _PATH_KWARGS}
    info.update({name: _plain(getattr(tok, name, None)) for name in _SPECIAL_TOKENS})  # the live values win
    info["tokenizer_class"] = type(tok).__name__
    template = getattr(tok, "chat_template", None)
    if state.args.chat_template:  # --chat-template overrides the tokenizer's, as in chat requests
        try:
            template = load_chat_template(state.args.chat_template)
        except CoreError as e:
            raise ApiError(500, str(e)) from None
    if template:
        info["chat_template"] = template
    # the standard library's encoder: config ints such as model_max_length (1e30) pass 64 bits
    return Response(json.dumps(info), media_type="application/json")
