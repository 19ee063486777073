"""Embedding and classification endpoints (``--is-embedding``): OpenAI's /v1/embeddings
and SGLang's native /encode and /classify. All run :meth:`AsyncEngine.encode` (one
prefill-only forward, pooled as the model's files say)."""

from __future__ import annotations

import base64
import struct
import uuid
from typing import Any

import msgspec
import structlog
from starlette.requests import Request
from starlette.responses import Response

from core.errors import InvalidRequest
from core.server.http import ApiError, json_response, read_body_ignoring_unknown, state_of

log = structlog.get_logger("core.server.embeddings")


class EmbeddingRequest(msgspec.Struct):
    """OpenAI's embeddings request with SGLang's extensions (its ``EmbeddingRequest``)."""

    input: Any = None
    model: str | None = None
    encoding_format: str | None = "float"
    dimensions: int | None = None
    user: str | None = None  # for the caller's own tracking: nothing to do with it here
    # SGLang's extensions, features this server lacks: refused when set
    rid: Any = None
    priority: int | None = None
    lora_path: Any = None
    embed_override_token_id: int | None = None
    embed_overrides: Any = None


class EmbeddingReqInput(msgspec.Struct):
    """SGLang's EmbeddingReqInput (/encode, /classify). ``text``, ``input_ids`` and ``rid`` are
    served and ``log_metrics`` needs nothing (no per-request metrics are kept for these); the
    fields after ``log_metrics`` belong to features this server lacks and are refused when set."""

    text: Any = None
    input_ids: Any = None
    rid: str | list[str] | None = None
    log_metrics: bool = True
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    embed_override_token_id: int | None = None
    embed_overrides: Any = None
    sampling_params: Any = None
    modalities: Any = None
    is_cross_encoder_request: bool = False
    lora_path: Any = None
    lora_id: Any = None
    positional_embed_overrides: Any = None
    routing_key: str | None = None
    http_worker_ipc: str | None = None
    background: bool = False
    priority: int | None = None
    dimensions: int | None = None
    return_pooled_hidden_states: bool = False


_OPENAI_UNSUPPORTED = EmbeddingRequest.__struct_fields__[EmbeddingRequest.__struct_fields__.index("rid"):]
_NATIVE_UNSUPPORTED = EmbeddingReqInput.__struct_fields__[EmbeddingReqInput.__struct_fields__.index("input_embeds"):]


async def _read_request(request: Request, typ: type[msgspec.Struct], unsupported: tuple[str, ...]) -> Any:
    """The body as ``typ``: a field of a feature this server lacks (``unsupported``) is a 400 when
    set (not its default); unknown top-level fields are ignored and logged, as /generate does."""
    obj = await read_body_ignoring_unknown(request, typ, "embeddings.unknown_field_ignored")
    defaults = typ()
    for name in unsupported:
        value, default = getattr(obj, name), getattr(defaults, name)
        if type(value) is not type(default) or value != default:
            raise InvalidRequest(f"{name} is not supported by this server", param=name)
    return obj


def input_ids_of(state: Any, inp: Any, param: str = "input") -> tuple[list[list[int]], bool]:
    """(token id lists, was it a batch) from a string, list of strings, token ids or list of token id lists;
    a text that cannot fit the context is refused before it is tokenized (``ServerState.tokenize``)."""
    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(inp, str):
        items, batch = [inp], False
    elif is_ids(inp):
        items, batch = [inp], False
    elif isinstance(inp, list) and inp and all(isinstance(x, str) or is_ids(x) for x in inp):
        items, batch = inp, True
    else:
        raise InvalidRequest(f"{param} must be a string, a list of strings, a list of token ids or a list of token id lists",
                             param=param)
    try:
        ctx = state.context_len
        ids = [state.tokenize(x, None, param, ctx) if isinstance(x, str) else state.engine.tokenize(None, x)
               for x in items]
    except InvalidRequest as e:
        raise InvalidRequest(e.message, param=param) from None
    return ids, batch


async def openai_embeddings(request: Request) -> Response:
    """OpenAI's /v1/embeddings."""
    state = state_of(request)
    engine = state.engine
    obj = await _read_request(request, EmbeddingRequest, _OPENAI_UNSUPPORTED)
    if not engine.args.is_embedding:
        raise ApiError(400, f"The served model '{state.served_model_name}' is a generative model, not an embedding model; "
                            "/v1/embeddings needs a server started with --is-embedding", param="model",
                       code="model_not_supported")
    if obj.input is None:
        raise InvalidRequest("'input' is required", param="input")
    if obj.dimensions is not None:  # no Matryoshka truncation support for any model yet
        raise InvalidRequest("dimensions is not supported by the served model", param="dimensions")
    fmt = obj.encoding_format or "float"
    if fmt not in ("float", "base64"):
        raise InvalidRequest("encoding_format must be 'float' or 'base64'", param="encoding_format")
    ids, _ = input_ids_of(state, obj.input)
    ids = [state.fit_prompt(i, engine.model_config.context_len) for i in ids]
    embs = await engine.encode(ids)
    data = [{"object": "embedding", "index": i,
             "embedding": e if fmt == "float" else base64.b64encode(struct.pack(f"<{len(e)}f", *e)).decode()}
            for i, e in enumerate(embs)]
    n = sum(map(len, ids))
    return json_response({"object": "list", "data": data, "model": state.served_model_name,
                          "usage": {"prompt_tokens": n, "total_tokens": n}})


async def _native(request: Request, classify: bool) -> Response:
    state = state_of(request)
    engine = state.engine
    obj = await _read_request(request, EmbeddingReqInput, _NATIVE_UNSUPPORTED)
    if not engine.args.is_embedding:
        raise InvalidRequest("this endpoint needs a server started with --is-embedding")
    if classify and not engine.is_classifier:
        raise InvalidRequest("the served model has no classification head")
    key = "input_ids" if obj.input_ids is not None else "text"
    ids, batch = input_ids_of(state, getattr(obj, key), key)
    rids = _rids(obj.rid, len(ids), batch)
    ids = [state.fit_prompt(i, engine.model_config.context_len) for i in ids]
    embs = await engine.encode(ids)
    outs = [{"embedding": e, "meta_info": {"id": rid, "prompt_tokens": len(i), "finish_reason": {"type": "length", "length": 0}}}
            for e, i, rid in zip(embs, ids, rids)]
    return json_response(outs if batch else outs[0])


def _rids(rid: str | list[str] | None, n: int, batch: bool) -> list[str]:
    """Each prompt's id (SGLang's ``meta_info.id``): the request's ``rid``, one per prompt of a batch."""
    if rid is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if isinstance(rid, str) and not batch:
        return [rid]
    if isinstance(rid, list) and batch and len(rid) == n:
        return rid
    raise InvalidRequest("rid must be a string for one prompt, or a list with one per prompt of a batch", param="rid")


async def encode(request: Request) -> Response:
    """SGLang's /encode: the pooled embedding of each prompt."""
    return await _native(request, classify=False)


async def classify(request: Request) -> Response:
    """SGLang's /classify: ``embedding`` holds the per-label scores (one for a reward model)."""
    return await _native(request, classify=True)
