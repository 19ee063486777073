"""Embedding and classification endpoints (``--is-embedding``): OpenAI's /v1/embeddings
and SGLang's native /encode and /classify. All run :meth:`AsyncEngine.encode` (one
prefill-only forward, pooled as the model's files say)."""

from __future__ import annotations

import base64
import struct
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from core.errors import InvalidRequest
from core.server.http import ApiError, json_response, read_body, state_of


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
    obj = await read_body(request, dict[str, Any])
    if not engine.args.is_embedding:
        raise ApiError(400, f"The served model '{state.served_model_name}' is a generative model, not an embedding model; "
                            "/v1/embeddings needs a server started with --is-embedding", param="model",
                       code="model_not_supported")
    if "input" not in obj:
        raise InvalidRequest("'input' is required", param="input")
    if obj.get("dimensions") is not None:  # no Matryoshka truncation support for any model yet
        raise InvalidRequest("dimensions is not supported by the served model", param="dimensions")
    fmt = obj.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise InvalidRequest("encoding_format must be 'float' or 'base64'", param="encoding_format")
    ids, _ = input_ids_of(state, obj["input"])
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
    obj = await read_body(request, dict[str, Any])
    if not engine.args.is_embedding:
        raise InvalidRequest("this endpoint needs a server started with --is-embedding")
    if classify and not engine.is_classifier:
        raise InvalidRequest("the served model has no classification head")
    key = "input_ids" if obj.get("input_ids") is not None else "text"
    ids, batch = input_ids_of(state, obj.get(key), key)
    ids = [state.fit_prompt(i, engine.model_config.context_len) for i in ids]
    embs = await engine.encode(ids)
    outs = [{"embedding": e, "meta_info": {"prompt_tokens": len(i), "finish_reason": {"type": "length", "length": 0}}}
            for e, i in zip(embs, ids)]
    return json_response(outs if batch else outs[0])


async def encode(request: Request) -> Response:
    """SGLang's /encode: the pooled embedding of each prompt."""
    return await _native(request, classify=False)


async def classify(request: Request) -> Response:
    """SGLang's /classify: ``embedding`` holds the per-label scores (one for a reward model)."""
    return await _native(request, classify=True)
