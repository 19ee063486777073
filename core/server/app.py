"""The starlette app: the one route table (SGLang's native API, the OpenAI-compatible API,
embeddings, files and batches), the API-key middleware and the exception handlers.

Every handler raises instead of building error responses; the handlers here turn any
exception into the OpenAI-shaped error object through ``core.server.http.api_error``.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import msgspec
import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from core.errors import CoreError
from core.server import anthropic, embeddings, lora, native, profile, request_log, tokenize, weights
from core.server.http import ApiError, ApiKeyMiddleware, RootPathMiddleware, api_error, route_path
from core.server.openai import batches, files, rerank, responses, routes, score
from core.server.state import ServerState

log = structlog.get_logger("core.server.app")

ROUTES = [
    # SGLang native
    Route("/generate", native.generate, methods=["POST", "PUT"]),
    Route("/encode", embeddings.encode, methods=["POST", "PUT"]),
    Route("/classify", embeddings.classify, methods=["POST", "PUT"]),
    Route("/health", native.health, methods=["GET", "POST"]),
    Route("/ready", native.ping, methods=["GET"]),
    Route("/configure_logging", request_log.configure, methods=["GET", "POST"]),
    Route("/health_generate", native.health_generate, methods=["GET", "POST"]),
    Route("/ping", native.ping, methods=["GET"]),  # SageMaker's health check (SGLang's, under --api-key)
    Route("/get_model_info", native.get_model_info, methods=["GET"]),
    Route("/model_info", native.get_model_info, methods=["GET"]),
    Route("/get_server_info", native.get_server_info, methods=["GET"]),
    Route("/server_info", native.get_server_info, methods=["GET"]),
    Route("/v1/loads", native.loads, methods=["GET"]),
    Route("/get_load", native.get_load, methods=["GET"]),
    Route("/flush_cache", native.flush_cache, methods=["GET", "POST"]),
    Route("/freeze_gc", native.freeze_gc, methods=["GET", "POST"]),
    Route("/clear_hicache_storage_backend", native.clear_hicache_storage_backend, methods=["GET", "POST"]),
    Route("/hicache/storage-backend/clear", native.clear_hicache_storage_backend, methods=["POST"]),
    Route("/abort_request", native.abort_request, methods=["POST"]),
    Route("/start_profile", profile.start_profile, methods=["GET", "POST"]),
    Route("/stop_profile", profile.stop_profile, methods=["GET", "POST"]),
    Route("/get_weights_by_name", native.get_weights_by_name, methods=["GET", "POST"]),
    Route("/pause_generation", native.pause_generation, methods=["POST"]),
    Route("/continue_generation", native.continue_generation, methods=["POST"]),
    Route("/update_weights_from_disk", native.update_weights_from_disk, methods=["POST"]),
    Route("/update_weight_version", native.update_weight_version, methods=["POST"]),
    Route("/update_weights_from_tensor", weights.update_weights_from_tensor, methods=["POST"]),
    Route("/update_weights_from_distributed", weights.update_weights_from_distributed, methods=["POST"]),
    Route("/init_weights_update_group", weights.init_weights_update_group, methods=["POST"]),
    Route("/destroy_weights_update_group", weights.destroy_weights_update_group, methods=["POST"]),
    Route("/begin_weight_update", weights.begin_weight_update, methods=["POST"]),
    Route("/end_weight_update", weights.end_weight_update, methods=["POST"]),
    Route("/release_memory_occupation", weights.release_memory_occupation, methods=["GET", "POST"]),
    Route("/resume_memory_occupation", weights.resume_memory_occupation, methods=["GET", "POST"]),
    Route("/load_lora_adapter", lora.load_lora_adapter, methods=["POST"]),
    Route("/unload_lora_adapter", lora.unload_lora_adapter, methods=["POST"]),
    Route("/metrics", native.metrics_endpoint, methods=["GET"]),  # 404 without --enable-metrics
    Route("/tokenize", tokenize.tokenize, methods=["POST"]),
    Route("/v1/tokenize", tokenize.tokenize, methods=["POST"]),
    Route("/detokenize", tokenize.detokenize, methods=["POST"]),
    Route("/v1/detokenize", tokenize.detokenize, methods=["POST"]),
    Route("/tokenizer_info", tokenize.tokenizer_info, methods=["GET"]),  # vLLM's
    Route("/parse_function_call", routes.parse_function_call, methods=["POST"]),
    Route("/separate_reasoning", routes.separate_reasoning, methods=["POST"]),
    # OpenAI-compatible
    Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
    Route("/invocations", routes.chat_completions, methods=["POST"]),  # SageMaker's inference route: chat
    Route("/v1/score", score.score, methods=["POST"]),
    Route("/v1/rerank", rerank.rerank, methods=["POST", "PUT"]),
    Route("/v1/completions", routes.completions, methods=["POST"]),
    Route("/v1/models", routes.list_models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", routes.retrieve_model, methods=["GET"]),
    Route("/v1/responses", responses.create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", responses.retrieve_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", responses.delete_response, methods=["DELETE"]),
    Route("/v1/responses/{response_id}/input_items", responses.list_input_items, methods=["GET"]),
    Route("/v1/responses/{response_id}/cancel", responses.cancel_response, methods=["POST"]),
    Route("/v1/messages", anthropic.messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", anthropic.count_tokens, methods=["POST"]),
    Route("/v1/embeddings", embeddings.openai_embeddings, methods=["POST"]),
    Route("/v1/files", files.create_file, methods=["POST"]),
    Route("/v1/files", files.list_files, methods=["GET"]),
    Route("/v1/files/{file_id}", files.retrieve_file, methods=["GET"]),
    Route("/v1/files/{file_id}", files.delete_file, methods=["DELETE"]),
    Route("/v1/files/{file_id}/content", files.file_content, methods=["GET"]),
    Route("/v1/batches", batches.create_batch, methods=["POST"]),
    Route("/v1/batches", batches.list_batches, methods=["GET"]),
    Route("/v1/batches/{batch_id}", batches.retrieve_batch, methods=["GET"]),
    Route("/v1/batches/{batch_id}/cancel", batches.cancel_batch, methods=["POST"]),
]


# ---------------------------------------------------------------------------- exception handlers
async def _error(request: Request, exc: Exception) -> Response:
    err = api_error(exc)
    if not isinstance(exc, (ApiError, CoreError, msgspec.MsgspecError)):  # a bug, not a refusal
        # the traceback is logged by hypercorn (starlette re-raises after this response is sent)
        log.error("server.internal_error", method=request.method, path=request.url.path,
                  error=f"{type(exc).__name__}: {exc}")
    elif err.status >= 500:  # a refusal of the server's own (queue full, draining, failed): said in the log too
        log.warning("server.request_refused", method=request.method, path=request.url.path, status=err.status,
                    reason=err.message)
    return err.response(route_path(request.scope))


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        msg = f"no route {request.method} {request.url.path}"
    elif exc.status_code == 405:
        msg = f"method {request.method} is not allowed on {request.url.path}"
    else:
        msg = str(exc.detail)
    resp = ApiError(exc.status_code, msg).response(route_path(request.scope))
    for k, v in (exc.headers or {}).items():
        resp.headers[k] = v
    return resp


# Expected errors by class (starlette answers them in place); ``Exception`` is the last resort
# (starlette answers, then re-raises so the server logs the traceback).
EXCEPTION_HANDLERS: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
    HTTPException: _http_exception,
    ApiError: _error,
    CoreError: _error,  # InvalidRequest (400), ServiceUnavailable (503), others (400)
    msgspec.ValidationError: _error,
    msgspec.DecodeError: _error,
    Exception: _error,
}


def build_app(state: Any = None, api_key: str | None = None, admin_api_key: str | None = None,
              root_path: str = "") -> Starlette:
    """The app over ``state`` (stored as ``app.state.core``), with the key checks when a key is
    given and the ASGI ``root_path`` (``--fastapi-root-path``) when ``root_path``."""
    middleware = [Middleware(RootPathMiddleware, root_path=root_path)] if root_path.rstrip("/") else []
    if api_key or admin_api_key:
        middleware.append(Middleware(ApiKeyMiddleware, api_key=api_key, admin_api_key=admin_api_key))
    app = Starlette(routes=ROUTES, middleware=middleware, exception_handlers=EXCEPTION_HANDLERS)
    app.state.core = state
    app.state.max_body_bytes = getattr(getattr(state, "args", None), "max_request_body_bytes", None)
    return app


def create_app(state: ServerState) -> Starlette:
    """The server's app: ``build_app`` plus the request log (``--log-requests``) and the per-request
    time stats and metrics files (``core.server.request_log``)."""
    request_log.attach(state)
    state.engine.finish_listeners.append(native.request_logger(state))  # (logs while --log-requests is on)
    args = state.args
    return build_app(state, args.api_key, args.admin_api_key, args.fastapi_root_path)
