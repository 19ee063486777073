"""The HTTP server: SGLang's native API (+ the OpenAI-compatible routes) on starlette + hypercorn.

One asyncio event loop runs hypercorn and the engine's scheduler; the forward runs
on the engine's worker thread. ``run_server`` builds the engine (synchronously, before
serving), serves until SIGINT/SIGTERM, then stops accepting connections, lets running
requests finish for ``--graceful-shutdown-timeout`` seconds, aborts the rest and
exits 0.

Errors are OpenAI-shaped everywhere: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import signal
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

import attrs
import msgspec
import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from core.engine import AsyncEngine
from core.errors import CoreError, InvalidRequest
from core.server.metrics import Metrics, engine_load
from core.engine.request import Req
from core.engine.sampling_params import SamplingParams

log = structlog.get_logger("core.server.app")

VERSION = "0.1.0"
HEALTH_GENERATE_TIMEOUT_S = 20.0
LOG_TRUNCATE = 2048


# ---------------------------------------------------------------------------- state and errors
@attrs.define
class ServerState:
    """Everything a handler needs; stored as ``app.state.core``."""

    engine: AsyncEngine
    args: argparse.Namespace  # all serve flags
    metrics: Metrics
    served_model_name: str
    ready: bool = False
    shutting_down: bool = False
    model_path: str | None = None  # what /get_model_info reports (changes with /update_weights_from_disk)
    weight_version: str = "default"
    started_at: float = attrs.field(factory=time.time)

    # -- helpers shared with the OpenAI routes ---------------------------------------
    def check_admission(self, num_reqs: int) -> None:
        """Raise ServiceUnavailable when shutting down or when ``num_reqs`` more would
        overflow ``--max-queued-requests``. Call right before ``engine.submit``."""
        if self.shutting_down:
            raise ServiceUnavailable("the server is shutting down")
        limit = getattr(self.args, "max_queued_requests", None)
        if limit is not None and len(self.engine.scheduler.waiting) + num_reqs > limit:
            raise ServiceUnavailable(
                f"the request queue is full ({len(self.engine.scheduler.waiting)} waiting, --max-queued-requests {limit}); "
                "retry later")

    def submit(self, reqs: list[Req]) -> None:
        """Admission check, then submit to the engine (and log inputs with --log-requests)."""
        self.check_admission(len(reqs))
        self.engine.submit(reqs)

    def prepare_prompt(self, ids: list[int]) -> list[int]:
        """Apply ``--allow-auto-truncate``: keep the first context_len - 1 tokens of an over-long prompt."""
        ctx = self.engine.model_config.context_len
        if getattr(self.args, "allow_auto_truncate", False) and len(ids) >= ctx:
            return ids[: ctx - 1]
        return ids


class ServiceUnavailable(CoreError):
    """HTTP 503: queue full or shutting down."""


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: int | str | None = None) -> JSONResponse:
    """OpenAI's error shape; ``code`` defaults to the HTTP status (as SGLang does)."""
    return JSONResponse({"error": {"message": message, "type": type_, "param": param,
                                   "code": status if code is None else code}}, status_code=status)


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


def sse(obj: Any) -> bytes:
    """One server-sent event: ``data: {json}\\n\\n``."""
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def state_of(request: Request) -> ServerState:
    return request.app.state.core


async def read_json(request: Request, type_: Any = Any) -> Any:
    """Decode the body as JSON (optionally into a msgspec type); errors become HTTP 400."""
    body = await request.body()
    if not body.strip():
        raise InvalidRequest("the request body is empty; send a JSON object")
    return msgspec.json.decode(body, type=type_)


def _msgspec_param(e: msgspec.ValidationError) -> str | None:
    msg = str(e)
    if "at `$." in msg:
        path = msg.rsplit("at `$.", 1)[1].rstrip("`")
        return path.split("[")[0].split(".")[0] or None
    if msg.startswith(("Object contains unknown field `", "Object missing required field `")):
        return msg.split("`")[1]
    return None


async def watch_disconnect(request: Request, on_disconnect: Callable[[], None]) -> None:
    """Wait for the client to go away (after the body was read), then call ``on_disconnect``.
    Run as a task next to a non-streaming generation and cancel it when done."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


# ---------------------------------------------------------------------------- exception handlers
async def _invalid_request(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, InvalidRequest)
    return error_response(400, exc.message, param=exc.param)


async def _validation_error(request: Request, exc: Exception) -> Response:
    return error_response(400, f"invalid request: {exc}", param=_msgspec_param(exc))  # type: ignore[arg-type]


async def _decode_error(request: Request, exc: Exception) -> Response:
    return error_response(400, f"malformed JSON body: {exc}")


async def _unavailable(request: Request, exc: Exception) -> Response:
    return error_response(503, str(exc), type_="server_error", code=503)


async def _core_error(request: Request, exc: Exception) -> Response:
    return error_response(400, str(exc))


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        msg = f"no route {request.method} {request.url.path}"
    elif exc.status_code == 405:
        msg = f"method {request.method} is not allowed on {request.url.path}"
    else:
        msg = str(exc.detail)
    resp = error_response(exc.status_code, msg, type_="invalid_request_error" if exc.status_code < 500 else "server_error")
    return _with_headers(resp, exc.headers)


def _with_headers(resp: Response, headers: Any) -> Response:
    for k, v in (headers or {}).items():
        resp.headers[k] = v
    return resp


async def _internal_error(request: Request, exc: Exception) -> Response:
    # the traceback is logged by hypercorn (starlette re-raises after this response is sent)
    log.error("server.internal_error", method=request.method, path=request.url.path, error=f"{type(exc).__name__}: {exc}")
    return error_response(500, f"internal server error: {type(exc).__name__}: {exc}", type_="server_error")


EXCEPTION_HANDLERS: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
    InvalidRequest: _invalid_request,
    msgspec.ValidationError: _validation_error,
    msgspec.DecodeError: _decode_error,
    ServiceUnavailable: _unavailable,
    CoreError: _core_error,
    HTTPException: _http_exception,
    Exception: _internal_error,
}


# ---------------------------------------------------------------------------- auth
class ApiKeyMiddleware:
    """``Authorization: Bearer <key>`` on every endpoint except /health; constant-time compare."""

    OPEN_PATHS = frozenset({"/health"})

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"] not in self.OPEN_PATHS:
            auth = b""
            for name, value in scope["headers"]:
                if name == b"authorization":
                    auth = value
            scheme, _, token = auth.strip().partition(b" ")
            ok = hmac.compare_digest(token.strip(), self._key) and scheme.lower() == b"bearer"
            if not ok:
                resp = error_response(401, "Invalid or missing API key; send 'Authorization: Bearer <key>'.",
                                      code="invalid_api_key")
                resp.headers["WWW-Authenticate"] = "Bearer"
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ---------------------------------------------------------------------------- /generate
class GenerateReqInput(msgspec.Struct, forbid_unknown_fields=True):
    """SGLang's GenerateReqInput (the fields this engine serves)."""

    text: str | list[str] | None = None
    input_ids: list[int | list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    log_metrics: bool = True
    # SGLang fields for features core does not have: accepted only when unset.
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    input_embeds: Any = None
    lora_path: Any = None
    lora_id: Any = None
    custom_logit_processor: Any = None
    session_params: Any = None
    return_hidden_states: Any = None
    token_ids_logprob: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    data_parallel_rank: Any = None
    priority: Any = None
    modalities: Any = None


_UNSUPPORTED_GENERATE_FIELDS = (
    "image_data", "video_data", "audio_data", "input_embeds", "lora_path", "lora_id", "custom_logit_processor",
    "session_params", "return_hidden_states", "token_ids_logprob", "bootstrap_host", "bootstrap_port", "bootstrap_room",
    "data_parallel_rank", "modalities",
)


def _per_item(value: Any, n: int, name: str, default: Any) -> list:
    if value is None:
        return [default] * n
    if isinstance(value, list):
        if len(value) != n:
            raise InvalidRequest(f"{name} has {len(value)} entries but there are {n} prompts", param=name)
        return [default if v is None else v for v in value]
    return [value] * n


def _sampling_params(d: dict | None) -> tuple[SamplingParams, int | None]:
    """SamplingParams from a request dict (None values mean 'default'), plus a per-request stream_interval."""
    d = {k: v for k, v in (d or {}).items() if v is not None}
    interval = d.pop("stream_interval", None)
    if interval is not None and (not isinstance(interval, int) or isinstance(interval, bool) or interval < 1):
        raise InvalidRequest("stream_interval must be an integer >= 1", param="stream_interval")
    return SamplingParams.from_dict(d), interval


def build_generate_requests(state: ServerState, obj: GenerateReqInput) -> tuple[list[Req], bool, int | None]:
    """Validate a /generate body and build its engine requests (nothing is submitted)."""
    engine = state.engine
    for name in _UNSUPPORTED_GENERATE_FIELDS:
        v = getattr(obj, name)
        if v not in (None, False, [], {}):
            raise InvalidRequest(f"{name} is not supported by this server", param=name)
    if obj.text is not None and obj.input_ids is not None:
        raise InvalidRequest("send either text or input_ids, not both", param="text")
    if obj.text is None and obj.input_ids is None:
        raise InvalidRequest("either text or input_ids is required", param="text")
    if obj.text is not None:
        batch = isinstance(obj.text, list)
        prompts: list = obj.text if batch else [obj.text]
        if batch and not prompts:
            raise InvalidRequest("text is an empty list", param="text")
        for p in prompts:
            if p == "":
                raise InvalidRequest("text is empty", param="text")
        is_ids = False
    else:
        ids = obj.input_ids
        batch = bool(ids) and isinstance(ids[0], list)
        if batch and not all(isinstance(x, list) for x in ids):
            raise InvalidRequest("input_ids must be a list of ints or a list of lists of ints", param="input_ids")
        if not batch and not all(isinstance(x, int) for x in ids):
            raise InvalidRequest("input_ids must be a list of ints or a list of lists of ints", param="input_ids")
        prompts = ids if batch else [ids]
        if not prompts or any(len(p) == 0 for p in prompts):
            raise InvalidRequest("input_ids is empty", param="input_ids")
        is_ids = True
    n = len(prompts)
    sps = _per_item(obj.sampling_params, n, "sampling_params", {})
    if obj.rid is not None and isinstance(obj.rid, list) and not batch:
        raise InvalidRequest("rid is a list but there is a single prompt", param="rid")
    rids = _per_item(obj.rid, n, "rid", None) if isinstance(obj.rid, list) else (
        [obj.rid] if not batch else [None if obj.rid is None else f"{obj.rid}-{i}" for i in range(n)])
    lps = _per_item(obj.return_logprob, n, "return_logprob", False)
    starts = _per_item(obj.logprob_start_len, n, "logprob_start_len", -1)
    tops = _per_item(obj.top_logprobs_num, n, "top_logprobs_num", 0)
    prios = _per_item(obj.priority, n, "priority", None)
    in_flight = {r.rid for r in (*engine.scheduler.waiting, *engine.scheduler.running)}
    reqs: list[Req] = []
    interval = None
    for i, p in enumerate(prompts):
        params, iv = _sampling_params(sps[i])
        interval = iv if iv is not None else interval
        token_ids = engine.tokenize(None if is_ids else p, p if is_ids else None)
        token_ids = state.prepare_prompt(token_ids)
        rid = rids[i]
        if rid is not None and (rid in in_flight or any(r.rid == rid for r in reqs)):
            raise InvalidRequest(f"a request with rid {rid!r} is already running", param="rid")
        reqs += engine.make_requests(token_ids, params, rid or uuid.uuid4().hex, bool(lps[i]), starts[i], tops[i],
                                     priority=prios[i])
    return reqs, batch, interval


def _fmt_token_lps(items: list, texts: dict[int, str] | None) -> list:
    out = []
    for lp, tid in items:
        out.append([lp, tid, texts.get(tid)] if texts is not None else [lp, tid])
    return out


def _fmt_top_lps(items: list, texts: dict[int, str] | None) -> list:
    # engine order is (token_id, logprob); SGLang's is (logprob, token_id[, text])
    return [[([lp, tid, texts.get(tid)] if texts is not None else [lp, tid]) for tid, lp in (pos or [])] for pos in items]


def output_of(state: ServerState, req: Req, with_text: bool, index: int | None = None) -> dict:
    """SGLang's /generate output: text, output_ids, meta_info (logprobs as [logprob, token_id(, text)])."""
    meta = req.meta_info()
    if req.return_logprob:
        texts = None
        if with_text:
            tok = state.engine.tokenizer
            ids: set[int] = set()
            for key in ("output_token_logprobs", "input_token_logprobs"):
                ids.update(t for _, t in meta.get(key, []))
            for key in ("output_top_logprobs", "input_top_logprobs"):
                for pos in meta.get(key, []):
                    ids.update(t for t, _ in (pos or []))
            order = sorted(ids)
            texts = dict(zip(order, [tok.decode([t]) for t in order])) if tok is not None else {t: None for t in order}
        for key in ("output_token_logprobs", "input_token_logprobs"):
            if key in meta:
                meta[key] = _fmt_token_lps(meta[key], texts)
        for key in ("output_top_logprobs", "input_top_logprobs"):
            if key in meta:
                meta[key] = _fmt_top_lps(meta[key], texts)
    out = {"text": req.text, "output_ids": list(req.output_ids), "meta_info": meta}
    if index is not None:
        out["index"] = index
    return out


async def _stream_reqs(engine: AsyncEngine, reqs: list[Req]) -> AsyncIterator[tuple[int, Req]]:
    """(index, request) after each of its steps until all finish; closing this aborts unfinished ones."""
    async for i, _ in engine.stream_many(reqs):
        yield i, reqs[i]


def _log_received(state: ServerState, reqs: list[Req], body: Any) -> None:
    args = state.args
    if not getattr(args, "log_requests", False):
        return
    level = getattr(args, "log_requests_level", 2)
    fields: dict[str, Any] = {"rids": [r.rid for r in reqs], "prompt_tokens": [len(r.prompt_ids) for r in reqs]}
    if level >= 1:
        fields["sampling_params"] = getattr(body, "sampling_params", None)
    if level >= 2:
        text = getattr(body, "text", None)
        if text is None:
            text = getattr(body, "input_ids", None)
        fields["input"] = _clip(text, level)
    log.info("request.received", **fields)


def _clip(v: Any, level: int) -> Any:
    if level >= 3 or v is None:
        return v
    s = v if isinstance(v, str) else json.dumps(v)
    return s if len(s) <= LOG_TRUNCATE else s[:LOG_TRUNCATE] + f"...(+{len(s) - LOG_TRUNCATE} chars)"


async def generate(request: Request) -> Response:
    state = state_of(request)
    obj = await read_json(request, GenerateReqInput)
    reqs, batch, req_interval = build_generate_requests(state, obj)
    await state.engine.prepare_grammars(reqs)  # constrained requests: compile off the loop (400 if invalid)
    state.submit(reqs)
    _log_received(state, reqs, obj)
    engine = state.engine
    with_text = obj.return_text_in_logprobs
    multi = len(reqs) > 1

    if obj.stream:
        interval = req_interval or max(1, getattr(state.args, "stream_interval", 1))

        async def body() -> AsyncIterator[bytes]:
            sent = [0] * len(reqs)
            final_sent = [False] * len(reqs)
            updates = _stream_reqs(engine, reqs)
            try:
                async for i, r in updates:
                    n = len(r.output_ids)
                    if final_sent[i] or (not r.finished and n - sent[i] < interval):
                        continue
                    sent[i], final_sent[i] = n, r.finished
                    yield sse(output_of(state, r, with_text, i if multi else None))
                # a request can finish between two updates the consumer saw: always end with its final state
                for i, r in enumerate(reqs):
                    if r.finished and not final_sent[i]:
                        final_sent[i] = True
                        yield sse(output_of(state, r, with_text, i if multi else None))
            except Exception as e:  # mid-stream: the status line is gone, report in-band
                log.error("server.stream_failed", error=f"{type(e).__name__}: {e}", exc_info=e)
                yield sse({"error": {"message": f"internal server error: {type(e).__name__}: {e}",
                                     "type": "server_error", "param": None, "code": 500}})
            finally:
                await updates.aclose()  # aborts whatever has not finished (client gone, cancelled)
            yield SSE_DONE

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def abort_all() -> None:
        for r in reqs:
            if not r.finished:
                engine.abort(r.rid)

    watcher = asyncio.create_task(watch_disconnect(request, abort_all))
    try:
        await asyncio.gather(*(engine.drain(r) for r in reqs))
    finally:
        watcher.cancel()
        abort_all()
    outs = [output_of(state, r, with_text) for r in reqs]
    return json_response(outs if batch or multi else outs[0])


# ---------------------------------------------------------------------------- other native endpoints
async def health(request: Request) -> Response:
    state = state_of(request)
    if state.ready and not state.shutting_down:
        return Response(status_code=200)
    return Response(status_code=503)


async def health_generate(request: Request) -> Response:
    state = state_of(request)
    if not state.ready or state.shutting_down:
        return Response(status_code=503)
    ok = await run_internal_generate(state, "HEALTH_CHECK_", max_new_tokens=1, timeout=HEALTH_GENERATE_TIMEOUT_S)
    return Response(status_code=200 if ok else 503)


async def run_internal_generate(state: ServerState, prefix: str, max_new_tokens: int, timeout: float) -> bool:
    """A tiny greedy generate that bypasses the queue limit and the metrics; True if it produced a token."""
    engine = state.engine
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    if engine.tokenizer is not None:
        ids = engine.tokenize("The capital of France is", None)
    else:
        ids = [0, 1, 2, 3]
    reqs = engine.make_requests(ids[: max(1, engine.model_config.context_len - max_new_tokens - 1)], params,
                                rid=f"{prefix}{uuid.uuid4().hex}")
    engine.submit(reqs)
    try:
        await asyncio.wait_for(asyncio.gather(*(engine.drain(r) for r in reqs)), timeout)
    except asyncio.TimeoutError:
        return False
    finally:
        for r in reqs:
            if not r.finished:
                engine.abort(r.rid)
    return all(r.output_ids and (r.finish_reason or {}).get("type") != "abort" for r in reqs)


async def get_model_info(request: Request) -> Response:
    state = state_of(request)
    mc = state.engine.model_config
    return json_response({
        "model_path": state.model_path,
        "tokenizer_path": getattr(state.args, "tokenizer_path", None),
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": state.weight_version,
        "served_model_name": state.served_model_name,
        "architecture": mc.architecture,
        "context_length": mc.context_len,
        "vocab_size": state.engine.vocab_size,
        "dtype": str(mc.dtype).removeprefix("torch."),
    })


def public_args(args: argparse.Namespace) -> dict[str, Any]:
    """The serve flags, JSON-able, with the API key redacted."""
    out: dict[str, Any] = {}
    for k, v in vars(args).items():
        if k.startswith("_") or k == "func" or callable(v):
            continue
        if k == "api_key" and v is not None:
            v = "<redacted>"
        try:
            msgspec.json.encode(v)
        except (TypeError, msgspec.EncodeError):
            v = str(v)
        out[k] = v
    return out


async def get_server_info(request: Request) -> Response:
    state = state_of(request)
    engine = state.engine
    load = engine_load(engine)
    gen_tp = 0.0
    if state.metrics.enabled:
        state.metrics.refresh(state.ready)
        gen_tp = state.metrics.gen_throughput.labels(state.metrics.model_name)._value.get()
    return json_response({
        **public_args(state.args),
        "served_model_name": state.served_model_name,
        "model_path": state.model_path,
        "max_total_num_tokens": engine.max_total_tokens,
        "max_req_input_len": engine.model_config.context_len - 1,
        "context_length": engine.model_config.context_len,
        "max_running_requests": engine.scheduler.max_running,
        "internal_states": [{
            "last_gen_throughput": gen_tp,
            "num_running_reqs": load["num_running_reqs"],
            "num_waiting_reqs": load["num_waiting_reqs"],
            "token_usage": load["token_usage"],
        }],
        "version": VERSION,
        "uptime_s": round(time.time() - state.started_at, 3),
    })


async def loads(request: Request) -> Response:
    state = state_of(request)
    load = {"dp_rank": 0, **engine_load(state.engine)}
    return json_response({"timestamp": time.time(), "version": VERSION, "loads": [load],
                          "aggregate": {k: v for k, v in load.items() if k != "dp_rank"}})


async def flush_cache(request: Request) -> Response:
    state = state_of(request)
    if state.engine.scheduler.has_work:
        return PlainTextResponse("Cache not flushed: there are running or waiting requests; retry when the server is idle.\n",
                                 status_code=400)
    if not state.engine.flush_cache():  # a request arrived in between
        return PlainTextResponse("Cache not flushed: there are running or waiting requests; retry when the server is idle.\n",
                                 status_code=400)
    return PlainTextResponse("Cache flushed.\n")


class AbortReq(msgspec.Struct, forbid_unknown_fields=True):
    rid: str = ""
    abort_all: bool = False
    finished_reason: Any = None
    abort_message: Any = None


async def abort_request(request: Request) -> Response:
    state = state_of(request)
    obj = await read_json(request, AbortReq)
    engine = state.engine
    if obj.abort_all:
        for r in [*engine.scheduler.waiting, *engine.scheduler.running]:
            engine.abort(r.rid)
    elif obj.rid:
        engine.abort(obj.rid)
    else:
        raise InvalidRequest("rid is required unless abort_all is true", param="rid")
    return Response(status_code=200)


class UpdateWeightFromDiskReqInput(msgspec.Struct, forbid_unknown_fields=True):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True


async def update_weights_from_disk(request: Request) -> Response:
    state = state_of(request)
    obj = await read_json(request, UpdateWeightFromDiskReqInput)
    if obj.load_format not in (None, "auto", "safetensors", "pt", "gguf"):
        raise InvalidRequest(f"load_format {obj.load_format!r} is not supported", param="load_format")
    engine = state.engine
    if obj.abort_all_requests:
        for r in [*engine.scheduler.waiting, *engine.scheduler.running]:
            engine.abort(r.rid)
    success, message = await engine.update_weights_from_disk(obj.model_path)
    if success:
        state.model_path = obj.model_path
        if obj.weight_version is not None:
            state.weight_version = obj.weight_version
            message += f" Weight version updated to {obj.weight_version}."
    return json_response({"success": success, "message": message, "num_paused_requests": 0},
                         status=200 if success else 400)


async def metrics_endpoint(request: Request) -> Response:
    state = state_of(request)
    from core.server.metrics import CONTENT_TYPE

    return Response(state.metrics.render(state.ready), media_type=CONTENT_TYPE)


# ---------------------------------------------------------------------------- app
def native_routes(state: ServerState) -> list[Route]:
    from core.server.embeddings import embedding_routes

    routes = [
        Route("/generate", generate, methods=["POST", "PUT"]),
        *embedding_routes(),
        Route("/health", health, methods=["GET", "POST"]),
        Route("/health_generate", health_generate, methods=["GET", "POST"]),
        Route("/get_model_info", get_model_info, methods=["GET"]),
        Route("/model_info", get_model_info, methods=["GET"]),
        Route("/get_server_info", get_server_info, methods=["GET"]),
        Route("/server_info", get_server_info, methods=["GET"]),
        Route("/v1/loads", loads, methods=["GET"]),
        Route("/get_load", loads, methods=["GET"]),
        Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/update_weights_from_disk", update_weights_from_disk, methods=["POST"]),
    ]
    if state.metrics.enabled:
        routes.append(Route("/metrics", metrics_endpoint, methods=["GET"]))
    return routes


def _request_logger(state: ServerState) -> Callable[[Req], None]:
    level = getattr(state.args, "log_requests_level", 2)

    def on_finish(req: Req) -> None:
        if req.rid.startswith(("HEALTH_CHECK_", "WARMUP_")):
            return
        try:
            fields: dict[str, Any] = {"rid": req.rid, "completion_tokens": len(req.output_ids),
                                      "finish_reason": req.finish_reason}
            if level >= 2:
                fields["output"] = _clip(req.text if req.detokenizer is not None else list(req.output_ids), level)
            log.info("request.output", **fields)
        except Exception:
            pass

    return on_finish


def create_app(state: ServerState) -> Starlette:
    """The starlette app: native routes, OpenAI routes (when core.server.openai.api exists), auth, errors."""
    routes: list = native_routes(state)
    try:
        from core.server.openai.api import openai_routes
    except ImportError as e:
        if getattr(e, "name", None) not in ("core.server.openai.api",):
            raise
    else:
        routes += openai_routes()
    middleware = []
    if getattr(state.args, "api_key", None):
        middleware.append(Middleware(ApiKeyMiddleware, api_key=state.args.api_key))
    app = Starlette(routes=routes, middleware=middleware, exception_handlers=EXCEPTION_HANDLERS)
    app.state.core = state
    if getattr(state.args, "log_requests", False):
        state.engine.finish_listeners.append(_request_logger(state))
    return app


def build_state(engine: AsyncEngine, args: argparse.Namespace) -> ServerState:
    for kind, dest in (("tool_parser", "tool_call_parser"), ("reasoning_parser", "reasoning_parser")):
        if getattr(args, dest, None):
            engine.plugins.get(kind, getattr(args, dest))  # an unknown name stops start-up, listing the registered ones
    name = engine.model_config.served_name
    metrics = Metrics(name, enabled=bool(getattr(args, "enable_metrics", False)))
    metrics.attach(engine)
    return ServerState(engine=engine, args=args, metrics=metrics, served_model_name=name,
                       model_path=getattr(args, "model_path", None) or engine.model_config.source)


# ---------------------------------------------------------------------------- running
def run_server(ns: argparse.Namespace) -> int:
    """``core serve``: build the engine, serve until a signal, shut down cleanly; returns the exit status."""
    return asyncio.run(_serve(ns))


def _bind(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _check_bind(host: str, port: int) -> None:
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise CoreError(f"cannot resolve --host {host}: {e}") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            raise CoreError(f"cannot listen on {_bind(host, port)}: {e.strerror or e}") from None


async def _serve(ns: argparse.Namespace) -> int:
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    from core.server.args import engine_args_from_namespace

    loop = asyncio.get_running_loop()
    _check_bind(ns.host, ns.port)  # fail before the model loads
    engine = AsyncEngine(engine_args_from_namespace(ns, getattr(ns, "_plugin_dests", ())),
                         plugins=getattr(ns, "_plugin_manager", None))
    state = build_state(engine, ns)
    app = create_app(state)

    grace = float(getattr(ns, "graceful_shutdown_timeout", 5.0))
    config = Config()
    config.bind = [_bind(ns.host, ns.port)]
    config.accesslog = None
    config.loglevel = "WARNING" if ns.log_level in ("warning", "error", "critical") else ns.log_level.upper()
    config.graceful_timeout = grace + 5.0
    config.keep_alive_timeout = 75.0

    stop = asyncio.Event()
    force = asyncio.Event()
    exit_code = 0

    def on_signal(signame: str) -> None:
        if stop.is_set():
            log.warning("server.force_shutdown", signal=signame)
            force.set()
        else:
            log.info("server.shutting_down", signal=signame, grace_s=grace)
            stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig.name)

    async def warmup() -> None:
        nonlocal exit_code
        try:
            if not getattr(ns, "skip_server_warmup", False):
                t0 = time.perf_counter()
                if not await run_internal_generate(state, "WARMUP_", max_new_tokens=4, timeout=600):
                    raise RuntimeError("the warm-up generate produced no tokens")
                log.info("server.warmup_done", seconds=round(time.perf_counter() - t0, 3))
            state.ready = True
            log.info("server.ready", url=f"http://{_bind(ns.host, ns.port)}", model=state.served_model_name)
        except Exception as e:
            log.error("server.warmup_failed", error=f"{type(e).__name__}: {e}")
            exit_code = 1
            stop.set()

    async def drain() -> None:
        """After the signal: let running requests finish for `grace` seconds, then abort the rest."""
        await stop.wait()
        state.shutting_down = True
        state.ready = False
        deadline = loop.time() + grace
        while engine.scheduler.has_work and loop.time() < deadline and not force.is_set():
            await asyncio.sleep(0.05)
        pending = [r.rid for r in (*engine.scheduler.waiting, *engine.scheduler.running)]
        if pending:
            log.info("server.aborting_requests", count=len(pending))
        for rid in pending:
            engine.abort(rid)

    warm_task = asyncio.create_task(warmup())
    drain_task = asyncio.create_task(drain())
    try:
        await serve(app, config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]
    except OSError as e:
        raise CoreError(f"cannot listen on {_bind(ns.host, ns.port)}: {e}") from None
    finally:
        stop.set()
        warm_task.cancel()
        try:
            await asyncio.wait_for(drain_task, grace + 1.0)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            pass
        await engine.shutdown()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    log.info("server.stopped", exit_code=exit_code)
    return exit_code
