"""Files and batches: OpenAI's /v1/files and /v1/batches, as SGLang serves them.

Storage lives under ``--file-storage-path`` (SGLang's default ``sglang_storage``, relative to
the server's working directory), created on the first upload:

* ``files/<file id>``: the content of each file, as uploaded or written;
* ``index.json``: metadata of every file and batch (OpenAI's File and Batch objects),
  rewritten atomically on each change, so files and finished batches survive a restart.
  A batch that was still running when the server stopped is marked ``failed`` (or
  ``cancelled`` if it was cancelling) at the next start.

A batch runs as an asyncio task on the server's loop, through the same engine and the same
chat/completions code as the HTTP endpoints (``core.server.openai.api.run_request``), at most
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

Uploads are ``multipart/form-data`` with ``file`` and ``purpose`` (only ``batch`` is
accepted). Starlette's parser needs ``python-multipart``; without it a small standard-library
parser reads the (in-memory) body instead.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
import structlog
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route

from core.errors import InvalidRequest
from core.server.openai.protocol import BatchObject, BatchRequest, FileDeleted, FileObject, ListObject, RequestCounts

log = structlog.get_logger("core.server.openai.batches")

DEFAULT_STORAGE = "sglang_storage"
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
FILE_PURPOSES = ("batch",)
BATCH_CONCURRENCY = 64
QUEUE_FULL_RETRY_S = 0.25
MAX_UPLOAD_BYTES = 512 * 1024 * 1024
_SHUTDOWN_MESSAGE = "the server shut down before the batch finished; the output file holds the requests that completed"
_RUNNING = ("validating", "in_progress", "finalizing", "cancelling")


def _now() -> int:
    return int(time.time())


class Storage:
    """Files and batches of one server, persisted under ``root``."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.files: dict[str, FileObject] = {}
        self.batches: dict[str, BatchObject] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self._load()

    @property
    def index_path(self) -> Path:
        return self.root / "index.json"

    def content_path(self, file_id: str) -> Path:
        return self.root / "files" / file_id

    def _load(self) -> None:
        try:
            raw = self.index_path.read_bytes()
        except FileNotFoundError:
            return
        try:
            data = msgspec.json.decode(raw)
            self.files = {f["id"]: msgspec.convert(f, FileObject) for f in data.get("files", [])}
            self.batches = {b["id"]: msgspec.convert(b, BatchObject) for b in data.get("batches", [])}
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError, KeyError, AttributeError) as e:
            log.warning("batches.index_unreadable", path=str(self.index_path), error=str(e))
            return
        now = _now()
        for b in self.batches.values():
            if b.status == "cancelling":
                b.status, b.cancelled_at = "cancelled", now
            elif b.status in _RUNNING:
                b.status, b.failed_at = "failed", now
                b.errors = {"object": "list", "data": [{"code": "server_restarted", "message":
                                                         "the server stopped before the batch finished", "line": None, "param": None}]}

    def save(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        data = {"files": list(self.files.values()), "batches": list(self.batches.values())}
        tmp = self.index_path.with_suffix(".json.tmp")
        tmp.write_bytes(msgspec.json.encode(data))
        os.replace(tmp, self.index_path)

    def add_file(self, content: bytes, filename: str, purpose: str) -> FileObject:
        file_id = "file-" + uuid.uuid4().hex
        path = self.content_path(file_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        obj = FileObject(id=file_id, bytes=len(content), created_at=_now(), filename=filename, purpose=purpose)
        self.files[file_id] = obj
        self.save()
        return obj

    def delete_file(self, file_id: str) -> None:
        self.files.pop(file_id, None)
        try:
            self.content_path(file_id).unlink()
        except FileNotFoundError:
            pass
        self.save()


def get_storage(request: Request) -> Storage:
    """The app's Storage, created on first use from ``args.file_storage_path``."""
    store = getattr(request.app.state, "openai_storage", None)
    if store is None:
        state = getattr(request.app.state, "core", None)
        root = getattr(getattr(state, "args", None), "file_storage_path", None) or DEFAULT_STORAGE
        store = Storage(root)
        request.app.state.openai_storage = store
    return store


# ----------------------------------------------------------------------------- helpers


def _err(status: int, message: str, param: str | None = None, code: str | None = None) -> Response:
    from core.server.openai.api import error_response

    return error_response(status, message, param=param, code=code)


def _json(obj: Any, status: int = 200) -> Response:
    from core.server.openai.protocol import encoder

    return Response(encoder.encode(obj), status_code=status, media_type="application/json")


def _not_found(kind: str, ident: str) -> Response:
    return _err(404, f"No such {kind} object: {ident}", param="id", code="not_found")


def parse_multipart(content_type: str, body: bytes) -> dict[str, tuple[bytes, str | None]]:
    """Standard-library multipart/form-data parser: field name -> (content, filename)."""
    from email.parser import BytesParser
    from email.policy import HTTP

    msg = BytesParser(policy=HTTP).parsebytes(b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body)
    if not msg.is_multipart():
        raise InvalidRequest("the upload is not valid multipart/form-data")
    out: dict[str, tuple[bytes, str | None]] = {}
    for part in msg.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not name:
            continue
        payload = part.get_payload(decode=True)
        out[str(name)] = (payload if isinstance(payload, bytes) else b"", part.get_filename())
    return out


async def _read_upload(request: Request) -> tuple[bytes, str, str]:
    ctype = request.headers.get("content-type", "")
    if not ctype.lower().startswith("multipart/form-data"):
        await request.body()  # consume it, so the connection stays usable for keep-alive clients
        raise InvalidRequest("upload the file as multipart/form-data with the fields 'file' and 'purpose'", param="file")
    import starlette.requests as sr

    if getattr(sr, "parse_options_header", None) is not None:  # python-multipart is installed
        try:
            form = await request.form(max_files=1, max_fields=16)
        except HTTPException as e:
            raise InvalidRequest(f"the upload is not valid multipart/form-data: {e.detail}", param="file") from None
        try:
            upload, purpose = form.get("file"), form.get("purpose")
            if upload is None or isinstance(upload, str):
                raise InvalidRequest("the 'file' field (a file) is required", param="file")
            content = await upload.read()
            filename = upload.filename or "upload.jsonl"
        finally:
            await form.close()
    else:
        body = await request.body()
        try:
            fields = parse_multipart(ctype, body)
        except InvalidRequest:
            raise
        except Exception as e:
            raise InvalidRequest(f"the upload is not valid multipart/form-data: {e}", param="file") from None
        if "file" not in fields:
            raise InvalidRequest("the 'file' field (a file) is required", param="file")
        content, filename = fields["file"][0], fields["file"][1] or "upload.jsonl"
        purpose = fields["purpose"][0].decode("utf-8", "replace") if "purpose" in fields else None
    if not isinstance(purpose, str) or not purpose:
        raise InvalidRequest("the 'purpose' field is required", param="purpose")
    if purpose not in FILE_PURPOSES:
        raise InvalidRequest(f"purpose {purpose!r} is not supported: this server accepts files for {', '.join(FILE_PURPOSES)}",
                             param="purpose")
    if len(content) > MAX_UPLOAD_BYTES:
        raise InvalidRequest(f"the file is larger than {MAX_UPLOAD_BYTES} bytes", param="file")
    return content, filename, purpose


# ----------------------------------------------------------------------------- files


async def create_file(request: Request) -> Response:
    try:
        content, filename, purpose = await _read_upload(request)
    except InvalidRequest as e:
        return _err(400, e.message, e.param)
    return _json(get_storage(request).add_file(content, filename, purpose))


async def list_files(request: Request) -> Response:
    store = get_storage(request)
    purpose = request.query_params.get("purpose")
    data = [f for f in reversed(store.files.values()) if purpose is None or f.purpose == purpose]
    return _json(ListObject(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None))


async def retrieve_file(request: Request) -> Response:
    file_id = request.path_params["file_id"]
    obj = get_storage(request).files.get(file_id)
    return _json(obj) if obj is not None else _not_found("File", file_id)


async def file_content(request: Request) -> Response:
    store = get_storage(request)
    file_id = request.path_params["file_id"]
    path = store.content_path(file_id)
    if file_id not in store.files or not path.is_file():
        return _not_found("File", file_id)
    return FileResponse(path, media_type="application/octet-stream", filename=store.files[file_id].filename)


async def delete_file(request: Request) -> Response:
    store = get_storage(request)
    file_id = request.path_params["file_id"]
    if file_id not in store.files:
        return _not_found("File", file_id)
    store.delete_file(file_id)
    return _json(FileDeleted(id=file_id))


# ----------------------------------------------------------------------------- batches


def _line_error(k: int, message: str, param: str | None = None, code: str = "invalid_request") -> dict:
    return {"code": code, "message": message, "param": param, "line": k + 1}


def parse_batch_input(raw: bytes, endpoint: str) -> tuple[list[dict], list[dict]]:
    """JSONL -> (request lines, OpenAI-style validation errors)."""
    lines, errors, seen = [], [], set()
    for k, text in enumerate(raw.decode("utf-8", errors="replace").splitlines()):
        if not text.strip():
            continue
        try:
            item = json.loads(text)
        except ValueError as e:
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
    from core.server.openai.api import run_request

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
        batch.model = model if isinstance(model, str) else getattr(state, "served_model_name", None)
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
                    if stopping or getattr(state, "shutting_down", False):
                        stopping = True
                        return
                    try:
                        status, body = await run_request(state, batch.endpoint, item["body"])
                    except Exception as e:  # a bug in one line must not fail the batch
                        log.exception("batches.line_failed", batch=batch_id, line=k + 1)
                        status, body = 500, {"error": {"message": f"internal error: {type(e).__name__}: {e}",
                                                       "type": "server_error", "param": None, "code": 500}}
                    if getattr(state, "shutting_down", False) and status >= 500:
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
        if batch.status != "cancelling" and getattr(state, "shutting_down", False):
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
    from core.server.openai.api import decode_body

    store = get_storage(request)
    try:
        req = decode_body(await request.body(), BatchRequest)
        if req.endpoint not in BATCH_ENDPOINTS:
            raise InvalidRequest(f"endpoint {req.endpoint!r} is not supported for batches: use one of "
                                 f"{', '.join(BATCH_ENDPOINTS)}", param="endpoint")
        if req.input_file_id not in store.files:
            raise InvalidRequest(f"No such File object: {req.input_file_id}", param="input_file_id")
    except InvalidRequest as e:
        return _err(400, e.message, e.param)
    state = getattr(request.app.state, "core", None)
    if state is None:
        return _err(503, "the server is not ready")
    now = _now()
    batch = BatchObject(id="batch_" + uuid.uuid4().hex, endpoint=req.endpoint, input_file_id=req.input_file_id,
                        completion_window=req.completion_window, created_at=now, expires_at=now + 24 * 3600,
                        metadata=req.metadata)
    store.batches[batch.id] = batch
    store.save()
    store.tasks[batch.id] = asyncio.create_task(run_batch(store, state, batch.id), name=f"core-batch-{batch.id}")
    return _json(batch)


async def list_batches(request: Request) -> Response:
    store = get_storage(request)
    try:
        limit = max(1, min(100, int(request.query_params.get("limit", 20))))
    except ValueError:
        return _err(400, "limit must be an integer", "limit")
    after = request.query_params.get("after")
    data = list(reversed(store.batches.values()))
    if after is not None:
        ids = [b.id for b in data]
        data = data[ids.index(after) + 1:] if after in ids else []
    page = data[:limit]
    return _json(ListObject(data=page, first_id=page[0].id if page else None, last_id=page[-1].id if page else None,
                            has_more=len(data) > limit))


async def retrieve_batch(request: Request) -> Response:
    batch_id = request.path_params["batch_id"]
    batch = get_storage(request).batches.get(batch_id)
    return _json(batch) if batch is not None else _not_found("Batch", batch_id)


async def cancel_batch(request: Request) -> Response:
    await request.body()  # ignored; read so the connection stays usable
    store = get_storage(request)
    batch_id = request.path_params["batch_id"]
    batch = store.batches.get(batch_id)
    if batch is None:
        return _not_found("Batch", batch_id)
    if batch.status in ("cancelling", "cancelled"):
        return _json(batch)
    if batch.status not in ("validating", "in_progress"):
        return _err(400, f"Cannot cancel a batch with status '{batch.status}'", "batch_id")
    task = store.tasks.get(batch_id)
    batch.cancelling_at = _now()
    if task is None or task.done():
        batch.status, batch.cancelled_at = "cancelled", _now()
    else:
        batch.status = "cancelling"
        task.cancel()
    store.save()
    return _json(batch)


def batch_routes() -> list[Route]:
    return [
        Route("/v1/files", create_file, methods=["POST"]),
        Route("/v1/files", list_files, methods=["GET"]),
        Route("/v1/files/{file_id}", retrieve_file, methods=["GET"]),
        Route("/v1/files/{file_id}", delete_file, methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", file_content, methods=["GET"]),
        Route("/v1/batches", create_batch, methods=["POST"]),
        Route("/v1/batches", list_batches, methods=["GET"]),
        Route("/v1/batches/{batch_id}", retrieve_batch, methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", cancel_batch, methods=["POST"]),
    ]


async def shutdown_batches(app: Any) -> None:
    """Cancel running batches (``core.server`` may call this on shutdown; they are marked cancelled)."""
    store = getattr(app.state, "openai_storage", None)
    if store is None:
        return
    tasks = list(store.tasks.values())
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)
