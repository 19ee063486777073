"""The HTTP toolkit every endpoint shares: one error object, one way to read a body,
one JSON and one SSE response, one state getter, one disconnect watcher, the API-key check.

Errors are OpenAI-shaped everywhere: ``{"error": {"message", "type", "param", "code"}}``;
``code`` defaults to the HTTP status and ``type`` to ``invalid_request_error`` below 500
and ``server_error`` from 500, as SGLang answers. :func:`api_error` is the one mapping
from an exception to that object: the app's exception handlers, the in-band errors of
streams and the batch runner all go through it.
"""

from __future__ import annotations

import asyncio
import functools
import contextlib
import hmac
import re
from typing import Any, AsyncIterator, Callable, TypeVar

import msgspec
import structlog
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from core.errors import CoreError, InvalidRequest, Unavailable
from core.server.limits import DEFAULT_MAX_BODY_BYTES, check_json_depth
from core.server.state import ServerState, ServiceUnavailable

log = structlog.get_logger("core.server.http")

encoder = msgspec.json.Encoder()
DEFAULT_RETRY_AFTER_S = 1


# ---------------------------------------------------------------------------- the error object
class ErrorDetail(msgspec.Struct):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | int | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


class ApiError(Exception):
    """An error answered as OpenAI's error object with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str | None = None, param: str | None = None,
                 code: str | int | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")
        self.code = status if code is None else code
        self.headers = headers or {}

    def body(self) -> ErrorBody:
        return ErrorBody(ErrorDetail(self.message, self.type, self.param, self.code))

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self.body())

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's error shape (the /v1/messages routes): ``{"type": "error", "error": {type, message}}``."""
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, path: str = "") -> Response:
        """The error as a response; on Anthropic's routes (``path``) in Anthropic's shape."""
        body = self.anthropic_body() if path.startswith(ANTHROPIC_PREFIX) else self.body()
        resp = json_response(body, self.status)
        resp.headers.update(self.headers)
        if self.status == 503 and "Retry-After" not in self.headers:  # every refusal for load says when to retry
            resp.headers["Retry-After"] = str(DEFAULT_RETRY_AFTER_S)
        return resp


ANTHROPIC_PREFIX = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error"}


def api_error(exc: BaseException) -> ApiError:
    """The one mapping from an exception to the error a client sees: a bad request is a 400
    naming the field, a full queue or a shutdown a 503, anything unexpected a 500."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidRequest):
        return ApiError(400, exc.message, param=exc.param)
    if isinstance(exc, ServiceUnavailable):
        return ApiError(503, str(exc), headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, Unavailable):  # the engine stopped: a tensor-parallel rank died, no replica is left
        return ApiError(503, str(exc))
    if isinstance(exc, msgspec.ValidationError):
        return api_error(_validation_error(exc))
    if isinstance(exc, msgspec.DecodeError):
        return ApiError(400, f"the request body is not valid JSON: {exc}")
    if isinstance(exc, RecursionError):  # a structure nested past Python's limit, wherever it was walked
        return ApiError(400, "the request nests too deeply")
    if isinstance(exc, CoreError):
        return ApiError(400, str(exc))
    return ApiError(500, f"internal server error: {type(exc).__name__}: {exc}")


# ---------------------------------------------------------------------------- responses
def json_response(obj: Any, status: int = 200) -> Response:
    """Any msgspec-encodable value (Structs, dicts, lists) as JSON."""
    return Response(encoder.encode(obj), status_code=status, media_type="application/json")


SSE_DONE = b"data: [DONE]\n\n"


def sse_event(obj: Any) -> bytes:
    """One server-sent event: ``data: {json}\\n\\n``."""
    return b"data: " + encoder.encode(obj) + b"\n\n"


def sse_error(exc: BaseException) -> bytes:
    """An error reported in-band, once the stream's status line has been sent."""
    return sse_event(api_error(exc).body())


class EventStream(StreamingResponse):
    """A server-sent event stream. The body generator is closed in every case (also when the
    client went away and starlette cancelled the send loop), so its ``finally`` aborts the
    engine requests behind it."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------- request bodies
_PARAM_RE = re.compile(r"at `\$\.?([^`]*)`")
_FIELD_RE = re.compile(r"(?:required|unknown) field `([^`]+)`")


def decode_body(body: bytes, typ: Any = Any) -> Any:
    """JSON bytes -> ``typ`` (a msgspec Struct, ``dict``...); every failure is an InvalidRequest,
    nesting deeper than ``limits.MAX_JSON_DEPTH`` included."""
    if not body.strip():
        raise InvalidRequest("the request body is empty; send a JSON object")
    check_json_depth(body)
    try:
        return msgspec.json.decode(body, type=typ)
    except msgspec.ValidationError as e:
        raise _validation_error(e) from None
    except msgspec.DecodeError as e:
        raise InvalidRequest(f"the request body is not valid JSON: {e}") from None
    except UnicodeDecodeError as e:  # msgspec decodes strings lazily: bad bytes inside one surface here
        raise InvalidRequest(f"the request body is not valid UTF-8: {e.reason} at byte {e.start}") from None
    except RecursionError:
        raise InvalidRequest("the request body nests too deeply") from None


def stream_due(tokens: int, sent: int, interval: int) -> bool:
    """Whether a stream that has ``tokens`` tokens, ``sent`` of them already, sends an event now:
    SGLang's ``--stream-interval``, the first token at once, then every ``interval`` tokens."""
    return tokens - sent >= interval or (sent == 0 and tokens > 0)


@functools.cache
def log_ignored_field(event: str, field: str, path: str = "") -> None:
    """Once per event, field name (and path) and process: a request field the server ignores on
    purpose (SGLang's unknown-field rule, other servers' harmless hints), said so once, not per request."""
    log.warning(event, field=field, **({"path": path} if path else {}))


def unknown_fields(body: bytes, typ: type[msgspec.Struct]) -> list[str]:
    """Top-level keys of a JSON object ``body`` that ``typ`` does not declare (msgspec drops
    them when decoding into ``typ``); call after ``decode_body(body, typ)`` succeeded."""
    known = set(typ.__struct_encode_fields__)
    return [k for k in msgspec.json.decode(body, type=dict[str, msgspec.Raw]) if k not in known]


async def read_body_ignoring_unknown(request: Request, typ: type[msgspec.Struct], event: str) -> Any:
    """The JSON body as ``typ`` (a Struct that allows unknown fields), as :func:`read_body` reads
    it; each top-level field ``typ`` does not declare is ignored and logged once as ``event``
    (SGLang's native endpoints ignore unknown fields)."""
    check_json_content_type(request)
    raw = await read_limited(request)
    obj = decode_body(raw, typ)
    for name in unknown_fields(raw, typ):
        log_ignored_field(event, name, request.url.path)
    return obj


async def read_optional_body(request: Request, typ: type) -> Any:
    """``typ`` from the body, or its defaults for an empty one (SGLang's clients may send none)."""
    return typ() if not await request.body() else await read_body(request, typ)


async def read_body(request: Request, typ: Any = Any) -> Any:
    """The request's JSON body decoded into ``typ`` (see :func:`decode_body`), after the
    Content-Type check (:func:`check_json_content_type`) and the size limit
    (:func:`read_limited`)."""
    check_json_content_type(request)
    return decode_body(await read_limited(request), typ)


def check_json_content_type(request: Request) -> None:
    """A JSON endpoint refuses a body declared as anything but JSON with a 400, SGLang's answer
    (``application/json`` and ``application/*+json`` pass; a request without the header, or with
    an empty one, is read as JSON, as FastAPI does)."""
    value = request.headers.get("content-type")
    if value is None or not value.strip():
        return
    media = value.split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    raise ApiError(400, f"Unsupported Media Type: Only 'application/json' is allowed (the request's Content-Type is "
                        f"{value!r})", param="Content-Type")


def body_limit(request: Request) -> int:
    """``--max-request-body-bytes`` of the app serving ``request`` (``build_app`` stores it)."""
    return getattr(request.app.state, "max_body_bytes", None) or DEFAULT_MAX_BODY_BYTES


async def read_limited(request: Request) -> bytes:
    """The raw body, refused with a 413 once it passes ``body_limit``: at once when the
    Content-Length says so, else as soon as the streamed bytes do (the rest is never read)."""
    limit = body_limit(request)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit, streamed=True)
            chunks.append(chunk)
    except ClientDisconnect:  # nobody is left to answer; not a server error (no traceback in the log)
        raise ApiError(400, "the client disconnected while sending the request body") from None
    body = b"".join(chunks)
    request._body = body  # starlette's cache: a later request.body() gets the same bytes
    return body


OFF_LOOP_BODY_BYTES = 64 * 1024
_T = TypeVar("_T")


async def prepare_off_loop(request: Request, fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` (a request's validation, templating and tokenization), on a worker thread when
    the body is large: a multi-megabyte prompt then never stalls the event loop that streams
    everyone else's tokens. Small bodies stay on the loop (a thread hop costs more than them)."""
    if len(getattr(request, "_body", b"") or b"") > OFF_LOOP_BODY_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def _too_large(size: int, limit: int, streamed: bool = False) -> ApiError:
    what = f"over {limit}" if streamed else str(size)
    return ApiError(413, f"the request body is {what} bytes; the limit is {limit} bytes (--max-request-body-bytes)")


def convert_body(obj: Any, typ: Any) -> Any:
    """An already-parsed JSON value (a batch line's body) -> ``typ``."""
    try:
        return msgspec.convert(obj, typ)
    except msgspec.ValidationError as e:
        raise _validation_error(e) from None


def _validation_error(e: msgspec.ValidationError) -> InvalidRequest:
    text = str(e)
    m = _PARAM_RE.search(text) or _FIELD_RE.search(text)
    if "Expected `object`" in text and (m is None or not m.group(1)):
        return InvalidRequest("the request body must be a JSON object")
    if text.startswith("Object missing required field") and m is not None:
        return InvalidRequest(f"'{m.group(1)}' is a required property", param=m.group(1))
    param = m.group(1).split("[")[0].split(".")[0] if m and m.group(1) else None
    return InvalidRequest(f"invalid request: {text}", param=param or None)


# ---------------------------------------------------------------------------- state, disconnects
def state_of(request: Request) -> ServerState:
    """The server's state (``app.state.core``); a 503 before the server has one."""
    state = getattr(request.app.state, "core", None)
    if state is None:
        raise ApiError(503, "the server is not ready")
    return state


async def watch_disconnect(request: Request, on_disconnect: Callable[[], None]) -> None:
    """Wait for the client to go away (after the body was read), then call ``on_disconnect``."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


@contextlib.asynccontextmanager
async def abort_on_disconnect(request: Request, abort: Callable[[], None]) -> AsyncIterator[None]:
    """Around a non-streaming generation: ``abort`` runs if the client disconnects meanwhile."""
    watcher = asyncio.create_task(watch_disconnect(request, abort))
    try:
        yield
    finally:
        watcher.cancel()


# ---------------------------------------------------------------------------- auth
# SGLang's ADMIN_OPTIONAL endpoints that core serves: with --admin-api-key they take that key only
ADMIN_PATHS = frozenset({
    "/flush_cache", "/freeze_gc", "/clear_hicache_storage_backend", "/hicache/storage-backend/clear",
    "/abort_request", "/start_profile", "/stop_profile", "/update_weights_from_disk", "/update_weight_version",
    "/load_lora_adapter", "/unload_lora_adapter", "/pause_generation", "/continue_generation", "/get_weights_by_name",
    "/configure_logging", "/update_weights_from_tensor", "/update_weights_from_distributed", "/init_weights_update_group",
    "/destroy_weights_update_group", "/begin_weight_update", "/end_weight_update", "/release_memory_occupation",
    "/resume_memory_occupation",
})


def route_path(scope: dict) -> str:
    """The path the routes match: ``path`` less the ``root_path`` prefix (``--fastapi-root-path``),
    as starlette's router strips it."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root):] or "/"
    return path


class ApiKeyMiddleware:
    """SGLang's keys: ``--api-key`` on every endpoint but the admin ones (``ADMIN_PATHS``), which
    take ``--admin-api-key`` when it is set (and then only it), else ``--api-key``; with only an
    admin key the other endpoints are open. Health, readiness and metrics (``/health*``,
    ``/ready*``, ``/metrics*``) are always open, for Kubernetes probes and Prometheus. A key is
    sent as ``Authorization: Bearer <key>`` (or ``x-api-key: <key>``, the anthropic client's
    header); a missing or wrong one is a 401. Constant-time compare."""

    OPEN_PREFIXES = ("/health", "/ready", "/metrics")

    def __init__(self, app: Any, api_key: str | None = None, admin_api_key: str | None = None) -> None:
        self.app = app
        self._key = api_key.encode() if api_key else None
        self._admin = admin_api_key.encode() if admin_api_key else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS":
            path = route_path(scope)
            admin = path in ADMIN_PATHS and self._admin is not None
            want = self._admin if admin else self._key
            if want is not None and not path.startswith(self.OPEN_PREFIXES) and not _has_key(scope, want):
                which = "the admin API key (--admin-api-key)" if admin else "the API key"
                resp = ApiError(401, f"Invalid or missing API key: {path} needs {which}; send 'Authorization: "
                                     "Bearer <key>' (or 'x-api-key: <key>').",
                                code="invalid_api_key").response(path)
                resp.headers["WWW-Authenticate"] = "Bearer"
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _has_key(scope: dict, key: bytes) -> bool:
    auth, x_key = b"", None
    for name, value in scope["headers"]:
        if name == b"authorization":
            auth = value
        elif name == b"x-api-key":
            x_key = value.strip()
    scheme, _, token = auth.strip().partition(b" ")
    bearer = hmac.compare_digest(token.strip(), key) and scheme.lower() == b"bearer"
    return bearer or (x_key is not None and hmac.compare_digest(x_key, key))


class RootPathMiddleware:
    """``--fastapi-root-path``, as SGLang's uvicorn applies it: ``root_path`` set and the request's
    ``path`` (and ``raw_path``) prefixed with it, so the routes match the path the proxy forwarded
    (the prefix stripped) while URLs built from the request carry the prefix."""

    def __init__(self, app: Any, root_path: str) -> None:
        self.app, self.root = app, root_path.rstrip("/")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket") and self.root:
            raw = scope.get("raw_path") or scope["path"].encode()
            scope = {**scope, "root_path": self.root, "path": self.root + scope["path"],
                     "raw_path": self.root.encode() + raw}
        await self.app(scope, receive, send)
