"""Batches: OpenAI's /v1/batches, as SGLang serves them (files in ``core.server.openai.files``).

A batch runs as an asyncio task on the server's loop, through the same engine and the same
chat/completions code as the HTTP endpoints (``core.server.openai.routes.run_request``), at most
``BATCH_CONCURRENCY`` lines at a time so the engine batches them; a line refused because
``--max-queued-requests`` is full waits and retries. When the server shuts down, the batch
stops, writes what completed and becomes ``failed`` (code ``server_shutdown``). Statuses: ``validating``
(the JSONL is parsed: each line needs ``custom_id`` (unique), ``body`` (an object), and, when
given, ``method`` POST and ``url`` equal to the batch's endpoint; any bad line fails the whole
batch with ``errors``) -> ``in_progress`` -> ``finalizing`` -> ``completed``; or ``failed``;
or ``cancelling`` -> ``cancelled`` (lines already answered are still written out).

Output: ``output_file_id`` holds one line per successful request,
``{"id", "custom_id", "response": {"status_code": 200, "request_id", "body"}, "error": null}``,
in input order; ``error_file_id`` (only when some failed) holds the failed ones with their
4xx/5xx ``status_code`` and OpenAI error body. ``request_counts`` counts them.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import msgspec
import structlog
from starlette.requests import Request
from starlette.responses import Response

from core.errors import InvalidRequest
from core.server.http import ApiError, api_error, json_response, read_body, state_of
from core.server.limits import check_json_depth
from core.server.openai.files import Storage, get_storage, not_found
from core.server.openai.protocol import BatchObject, BatchRequest, ListObject, RequestCounts
from core.server.openai.routes import run_request

log = structlog.get_logger("core.server.openai.batches")

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
BATCH_CONCURRENCY = 64
QUEUE_FULL_RETRY_S = 0.25
_SHUTDOWN_MESSAGE = "the server shut down before the batch finished; the output file holds the requests that completed"


def _now() -> int:
    return int(time.time())


def _line_error(k: int, message: str, param: str | None = None, code: str = "invalid_request") -> dict:
    return {"code": code, "message": message, "param": param, "line": k + 1}


def parse_batch_input(raw: bytes, endpoint: str) -> tuple[list[dict], list[dict]]:
    """JSONL -> (request lines, OpenAI-style validation errors)."""
    lines, errors, seen = [], [], set()
    for k, text in enumerate(raw.decode("utf-8", errors="replace").splitlines()):
        if not text.strip():
            continue
        try:
            check_json_depth(text.encode())  # as for a request body: deep nesting is refused, never a crash
            item = json.loads(text)
        except InvalidRequest as e:
            errors.append(_line_error(k, f"line {k + 1}: {e.message}"))
            continue
        except (ValueError, RecursionError) as e:
            errors.append(_line_error(k, f"line {k + 1} is not valid JSON: {e}"))
            continue
        if not isinstance(item, dict):
            errors.append(_line_error(k, f"line {k + 1} must be a JSON object"))
            continue
        cid = item.get("custom_id")
        if not isinstance(cid, str) or not cid:
            errors.append(_line_error(k, f"line {k + 1} needs a string 'custom_id'", "custom_id"))
            continue
        if cid in seen:
            errors.append(_line_error(k, f"line {k + 1}: custom_id {cid!r} is not unique", "custom_id", "duplicate_custom_id"))
            continue
        seen.add(cid)
        method = item.get("method", "POST")
        if not isinstance(method, str) or method.upper() != "POST":
            errors.append(_line_error(k, f"line {k + 1}: method must be POST", "method"))
            continue
        url = item.get("url", endpoint)
        if url != endpoint:
            errors.append(_line_error(k, f"line {k + 1}: url {url!r} does not match the batch endpoint {endpoint!r}", "url",
                                      "mismatched_url"))
            continue
        if not isinstance(item.get("body"), dict):
            errors.append(_line_error(k, f"line {k + 1} needs an object 'body'", "body"))
            continue
        lines.append(item)
    if not lines and not errors:
        errors.append({"code": "empty_file", "message": "the input file has no requests", "param": None, "line": None})
    return lines, errors


def _result_line(item: dict, status: int, body: dict) -> dict:
    request_id = body.get("id") if status == 200 else None
    return {"id": "batch_req_" + uuid.uuid4().hex, "custom_id": item.get("custom_id"),
            "response": {"status_code": status, "request_id": request_id or "req_" + uuid.uuid4().hex, "body": body},
            "error": None}


def _write_results(store: Storage, batch: BatchObject, lines: list[dict], results: list) -> None:
    ok, bad = [], []
    for item, res in zip(lines, results):
        if res is None:
            continue
        status, body = res
        (ok if status == 200 else bad).append(_result_line(item, status, body))

    def write(rows: list[dict], suffix: str) -> str:
        data = b"".join(msgspec.json.encode(r) + b"\n" for r in rows)
        return store.add_file(data, f"{batch.id}_{suffix}.jsonl", "batch_output").id

    batch.output_file_id = write(ok, "output")
    if bad:
        batch.error_file_id = write(bad, "error")


async def run_batch(store: Storage, state: Any, batch_id: str) -> None:
    batch = store.batches[batch_id]
    lines: list[dict] = []
    results: list = []
    try:
        path = store.content_path(batch.input_file_id)
        if batch.input_file_id not in store.files or not path.is_file():
            raise _BatchFailed("input_file_not_found", f"input file {batch.input_file_id} no longer exists")
        raw = await asyncio.to_thread(path.read_bytes)
        lines, errors = parse_batch_input(raw, batch.endpoint)
        if errors:
            batch.status, batch.failed_at = "failed", _now()
            batch.errors = {"object": "list", "data": errors}
            return
        model = lines[0]["body"].get("model")
        batch.model = model if isinstance(model, str) else state.served_model_name
        batch.status, batch.in_progress_at = "in_progress", _now()
        batch.request_counts = RequestCounts(total=len(lines))
        store.save()
        results = [None] * len(lines)
        usage = {"input_tokens": 0, "output_tokens": 0, "cached": 0}
        sem = asyncio.Semaphore(BATCH_CONCURRENCY)

        stopping = False

        async def one(k: int, item: dict) -> None:
            nonlocal stopping
            async with sem:
                while True:
                    if stopping or state.shutting_down:
                        stopping = True
                        return
                    try:
                        status, body = await run_request(state, batch.endpoint, item["body"])
                    except Exception as e:  # a bug in one line must not fail the batch
                        log.exception("batches.line_failed", batch=batch_id, line=k + 1)
                        err = api_error(e)
                        status, body = err.status, err.to_dict()
                    if state.shutting_down and status >= 500:
                        stopping = True  # aborted by the shutdown: not the request's fault
                        return
                    if status != 503:
                        break
                    await asyncio.sleep(QUEUE_FULL_RETRY_S)  # --max-queued-requests is full: wait for room
            results[k] = (status, body)
            if status == 200:
                batch.request_counts.completed += 1
                u = body.get("usage") or {}
                usage["input_tokens"] += u.get("prompt_tokens", 0)
                usage["output_tokens"] += u.get("completion_tokens", 0)
                usage["cached"] += (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            else:
                batch.request_counts.failed += 1

        await asyncio.gather(*(one(k, item) for k, item in enumerate(lines)))
        if stopping:
            _write_results(store, batch, lines, results)
            raise _BatchFailed("server_shutdown", _SHUTDOWN_MESSAGE)
        batch.status, batch.finalizing_at = "finalizing", _now()
        batch.usage = {"input_tokens": usage["input_tokens"], "output_tokens": usage["output_tokens"],
                       "total_tokens": usage["input_tokens"] + usage["output_tokens"],
                       "input_tokens_details": {"cached_tokens": usage["cached"]},
                       "output_tokens_details": {"reasoning_tokens": 0}}
        _write_results(store, batch, lines, results)
        batch.status, batch.completed_at = "completed", _now()
    except asyncio.CancelledError:
        try:
            _write_results(store, batch, lines, results)
        except Exception:
            log.exception("batches.write_failed", batch=batch_id)
        if batch.status != "cancelling" and state.shutting_down:
            batch.status, batch.failed_at = "failed", _now()
            batch.errors = {"object": "list", "data": [{"code": "server_shutdown", "message": _SHUTDOWN_MESSAGE,
                                                        "param": None, "line": None}]}
        else:
            batch.status, batch.cancelled_at = "cancelled", _now()
    except _BatchFailed as e:
        batch.status, batch.failed_at = "failed", _now()
        batch.errors = {"object": "list", "data": [{"code": e.code, "message": str(e), "param": None, "line": None}]}
    except Exception as e:
        log.exception("batches.failed", batch=batch_id)
        batch.status, batch.failed_at = "failed", _now()
        batch.errors = {"object": "list", "data": [{"code": "internal_error", "message": f"{type(e).__name__}: {e}",
                                                    "param": None, "line": None}]}
    finally:
        store.tasks.pop(batch_id, None)
        try:
            store.save()
        except OSError:
            log.exception("batches.save_failed", batch=batch_id)


class _BatchFailed(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


async def create_batch(request: Request) -> Response:
    store = get_storage(request)
    req = await read_body(request, BatchRequest)
    if req.endpoint not in BATCH_ENDPOINTS:
        raise InvalidRequest(f"endpoint {req.endpoint!r} is not supported for batches: use one of "
                             f"{', '.join(BATCH_ENDPOINTS)}", param="endpoint")
    if req.input_file_id not in store.files:
        raise InvalidRequest(f"No such File object: {req.input_file_id}", param="input_file_id")
    state = state_of(request)
    now = _now()
    batch = BatchObject(id="batch_" + uuid.uuid4().hex, endpoint=req.endpoint, input_file_id=req.input_file_id,
                        completion_window=req.completion_window, created_at=now, expires_at=now + 24 * 3600,
                        metadata=req.metadata)
    store.batches[batch.id] = batch
    store.save()
    store.tasks[batch.id] = asyncio.create_task(run_batch(store, state, batch.id), name=f"core-batch-{batch.id}")
    return json_response(batch)


async def list_batches(request: Request) -> Response:
    store = get_storage(request)
    try:
        limit = max(1, min(100, int(request.query_params.get("limit", 20))))
    except ValueError:
        raise InvalidRequest("limit must be an integer", param="limit") from None
    after = request.query_params.get("after")
    data = list(reversed(store.batches.values()))
    if after is not None:
        ids = [b.id for b in data]
        data = data[ids.index(after) + 1:] if after in ids else []
    page = data[:limit]
    return json_response(ListObject(data=page, first_id=page[0].id if page else None,
                                    last_id=page[-1].id if page else None, has_more=len(data) > limit))


async def retrieve_batch(request: Request) -> Response:
    batch_id = request.path_params["batch_id"]
    batch = get_storage(request).batches.get(batch_id)
    if batch is None:
        raise not_found("Batch", batch_id)
    return json_response(batch)


async def cancel_batch(request: Request) -> Response:
    await request.body()  # ignored; read so the connection stays usable
    store = get_storage(request)
    batch_id = request.path_params["batch_id"]
    batch = store.batches.get(batch_id)
    if batch is None:
        raise not_found("Batch", batch_id)
    if batch.status in ("cancelling", "cancelled"):
        return json_response(batch)
    if batch.status not in ("validating", "in_progress"):
        raise ApiError(400, f"Cannot cancel a batch with status '{batch.status}'", param="batch_id")
    task = store.tasks.get(batch_id)
    batch.cancelling_at = _now()
    if task is None or task.done():
        batch.status, batch.cancelled_at = "cancelled", _now()
    else:
        batch.status = "cancelling"
        task.cancel()
    store.save()
    return json_response(batch)


async def shutdown_batches(app: Any) -> None:
    """Stop the running batches at shutdown (``core.server.launch`` calls this once the server has
    stopped serving): each writes what completed and becomes ``failed`` (``server_shutdown``)."""
    store = getattr(app.state, "openai_storage", None)
    if store is None:
        return
    tasks = list(store.tasks.values())
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)
