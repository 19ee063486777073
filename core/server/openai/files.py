"""Files: OpenAI's /v1/files, as SGLang serves them, and the storage batches use.

Storage lives under ``--file-storage-path`` (SGLang's default ``sglang_storage``, relative to
the server's working directory), created on the first upload:

* ``files/<file id>``: the content of each file, as uploaded or written;
* ``index.json``: metadata of every file and batch (OpenAI's File and Batch objects),
  rewritten atomically on each change, so files and finished batches survive a restart.
  A batch that was still running when the server stopped is marked ``failed`` (or
  ``cancelled`` if it was cancelling) at the next start.

Uploads are ``multipart/form-data`` with ``file`` and ``purpose`` (only ``batch`` is
accepted). Starlette's parser needs ``python-multipart``; without it a small standard-library
parser reads the (in-memory) body instead.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path

import msgspec
import structlog
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, Response

from core.errors import InvalidRequest
from core.server.http import ApiError, json_response, state_of
from core.server.openai.protocol import BatchObject, FileDeleted, FileObject, ListObject

log = structlog.get_logger("core.server.openai.files")

FILE_PURPOSES = ("batch",)
MAX_UPLOAD_BYTES = 512 * 1024 * 1024
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
    """The app's Storage, created on first use under ``--file-storage-path``."""
    store = getattr(request.app.state, "openai_storage", None)
    if store is None:
        store = Storage(state_of(request).args.file_storage_path)
        request.app.state.openai_storage = store
    return store


def not_found(kind: str, ident: str) -> ApiError:
    return ApiError(404, f"No such {kind} object: {ident}", param="id", code="not_found")


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
    content, filename, purpose = await _read_upload(request)
    return json_response(get_storage(request).add_file(content, filename, purpose))


async def list_files(request: Request) -> Response:
    store = get_storage(request)
    purpose = request.query_params.get("purpose")
    data = [f for f in reversed(store.files.values()) if purpose is None or f.purpose == purpose]
    return json_response(ListObject(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None))


async def retrieve_file(request: Request) -> Response:
    file_id = request.path_params["file_id"]
    obj = get_storage(request).files.get(file_id)
    if obj is None:
        raise not_found("File", file_id)
    return json_response(obj)


async def file_content(request: Request) -> Response:
    store = get_storage(request)
    file_id = request.path_params["file_id"]
    path = store.content_path(file_id)
    if file_id not in store.files or not path.is_file():
        raise not_found("File", file_id)
    return FileResponse(path, media_type="application/octet-stream", filename=store.files[file_id].filename)


async def delete_file(request: Request) -> Response:
    store = get_storage(request)
    file_id = request.path_params["file_id"]
    if file_id not in store.files:
        raise not_found("File", file_id)
    store.delete_file(file_id)
    return json_response(FileDeleted(id=file_id))
