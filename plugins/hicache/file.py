"""``--hicache-storage-backend file``: HiCache's storage tier as one file per KV page (SGLang's HiCacheFile).

The folder is ``$SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR``, else SGLang's default ``/tmp/hicache``
(``HiCacheStorageConfig.path``, when given, comes first). A page is ``<folder>/<key>.bin``: a
16-byte header (magic, payload length, CRC-32 of the payload) and the payload. A write goes to a
temporary file renamed over the page (atomic: a reader never sees half a page); a page whose header,
length or checksum does not match reads as missing and is removed, so the engine recomputes it and
writes it again. No error reaches the engine: an unwritable or full folder makes ``set`` return
False (the storage tier logs that once and goes on with the tiers above)."""

from __future__ import annotations

import os
import re
import struct
import threading
import zlib

import structlog

from core import hookimpl
from core.interfaces import HiCacheStorageConfig

CORE_PLUGIN_API = "1"
ENV_DIR = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
DEFAULT_DIR = "/tmp/hicache"  # SGLang's HiCacheFile default
HEADER = struct.Struct("<4sQI")  # magic, payload bytes, crc32
MAGIC = b"CKV1"
KEY = re.compile(r"[0-9A-Za-z._-]{1,200}")

log = structlog.get_logger("core_plugins.hicache.file")


class FileStorage:
    def __init__(self, config: HiCacheStorageConfig) -> None:
        self.folder = config.path or os.environ.get(ENV_DIR) or DEFAULT_DIR
        self.namespace = config.namespace
        try:
            os.makedirs(self.folder, exist_ok=True)
        except OSError as e:  # the tier degrades: every set returns False
            log.warning("hicache.file.folder_unusable", folder=self.folder, error=str(e))

    def _path(self, key: str) -> str | None:
        return os.path.join(self.folder, key + ".bin") if KEY.fullmatch(key) else None

    def get(self, key: str) -> bytes | None:
        if (path := self._path(key)) is None:
            return None
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            return None
        if len(data) >= HEADER.size:
            magic, n, crc = HEADER.unpack_from(data)
            payload = memoryview(data)[HEADER.size:]
            if magic == MAGIC and n == len(payload) and zlib.crc32(payload) == crc:
                return bytes(payload)
        log.warning("hicache.file.corrupt_page", path=path, bytes=len(data))
        try:
            os.unlink(path)
        except OSError:
            pass
        return None

    def set(self, key: str, value: bytes) -> bool:
        if (path := self._path(key)) is None:
            return False
        tmp = os.path.join(self.folder, f".{key}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(HEADER.pack(MAGIC, len(value), zlib.crc32(value)))
                f.write(value)
            os.replace(tmp, path)
            return True
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False

    def exists(self, key: str) -> bool:
        return (path := self._path(key)) is not None and os.path.exists(path)

    def clear(self) -> None:
        try:
            names = os.listdir(self.folder)
        except OSError:
            return
        for name in names:
            if name.startswith(self.namespace + "_") and name.endswith(".bin"):  # keys are <namespace>_<hash>
                try:
                    os.unlink(os.path.join(self.folder, name))
                except OSError:
                    pass


@hookimpl
def register_hicache_storage_backends(register) -> None:
    register("file", "core_plugins.hicache.file:FileStorage")
