"""The HiCache storage backend suite: what the storage tier relies on of a ``HiCacheStorage``.

Each case builds fresh backends as the engine does, ``backend(HiCacheStorageConfig(namespace,
path, page_bytes))``, in a temporary folder of its own (a backend that is not folder-based ignores
``path``: its namespace, unique per case, keeps the cases apart), with seeded random page values
and keys shaped like the engine's (``<namespace>_<hex hash>``). The cases check: a value read back
is the bytes written (``round_trip``); a key never written reads as None and does not exist
(``missing_key``); a second ``set`` replaces the value (``overwrite``); ``clear`` drops the
namespace's values and keeps another namespace's (``clear``); a write to a location that cannot be
written (``path`` under a regular file) returns False, or True with the value readable, and
never raises, nor does a read there (``failed_write``).
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from typing import Any

import attrs

from core.interfaces import HiCacheStorageConfig
from core.testing.suite import Case, fail, resolve_target, seed_for

KIND = "hicache_storage_backend"
PAGE_BYTES = 4096


@attrs.define
class StorageSubject:
    factory: Any
    label: str
    kind: str = KIND

    @classmethod
    def build(cls, target: Any, *, plugins: Any = None) -> StorageSubject:
        factory, label = resolve_target(KIND, target, plugins)
        return cls(factory, label)

    def backend(self, folder: str, namespace: str) -> Any:
        return self.factory(HiCacheStorageConfig(namespace=namespace, path=folder, page_bytes=PAGE_BYTES))


def _page(rng: random.Random) -> bytes:
    return rng.randbytes(PAGE_BYTES)


def _key(namespace: str, rng: random.Random) -> str:
    return f"{namespace}_{rng.getrandbits(128):032x}"


def _in_folder(case: str, run: Any) -> Any:
    def go(subject: StorageSubject) -> None:
        folder = tempfile.mkdtemp(prefix=f"core-hicache-{case}-")
        try:
            run(subject, folder, random.Random(seed_for(KIND, subject.label, case)),
                f"conformance-{case}-{os.getpid()}-{seed_for(folder) % 10**6}")
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return go


def _round_trip(s: StorageSubject, folder: str, rng: random.Random, ns: str) -> None:
    b = s.backend(folder, ns)
    pages = {_key(ns, rng): _page(rng) for _ in range(4)}
    for k, v in pages.items():
        if b.set(k, v) is not True:
            raise fail(s, "round_trip", f"set({k!r}) did not return True in a writable folder")
    for k, v in pages.items():
        if not b.exists(k):
            raise fail(s, "round_trip", f"exists({k!r}) is False after a successful set")
        got = b.get(k)
        if got is None or bytes(got) != v:
            raise fail(s, "round_trip", f"get({k!r}) gave {None if got is None else f'{len(got)} other bytes'}, "
                                        f"not the {len(v)} bytes written")
    again = s.backend(folder, ns)  # another instance on the same place (an engine restarted) reads them
    k, v = next(iter(pages.items()))
    if (got := again.get(k)) is None or bytes(got) != v:
        raise fail(s, "round_trip", "a new backend on the same folder and namespace does not read what was written")


def _missing_key(s: StorageSubject, folder: str, rng: random.Random, ns: str) -> None:
    b = s.backend(folder, ns)
    b.set(_key(ns, rng), _page(rng))
    k = _key(ns, rng)
    if b.exists(k) or b.get(k) is not None:
        raise fail(s, "missing_key", f"a key never written ({k!r}) exists or reads as a value")


def _overwrite(s: StorageSubject, folder: str, rng: random.Random, ns: str) -> None:
    b = s.backend(folder, ns)
    k, v1, v2 = _key(ns, rng), _page(rng), _page(rng)
    b.set(k, v1)
    if b.set(k, v2) is not True:
        raise fail(s, "overwrite", "a second set of the same key did not return True")
    if (got := b.get(k)) is None or bytes(got) != v2:
        raise fail(s, "overwrite", "after a second set, get does not give the second value")


def _clear(s: StorageSubject, folder: str, rng: random.Random, ns: str) -> None:
    b, other = s.backend(folder, ns), s.backend(folder, ns + "x")
    mine, theirs = [_key(ns, rng) for _ in range(3)], _key(ns + "x", rng)
    for k in mine:
        b.set(k, _page(rng))
    v = _page(rng)
    other.set(theirs, v)
    b.clear()
    if any(b.exists(k) or b.get(k) is not None for k in mine):
        raise fail(s, "clear", "a value of the namespace is still there after clear()")
    if (got := other.get(theirs)) is None or bytes(got) != v:
        raise fail(s, "clear", "clear() dropped a value of another namespace")
    b.set(mine[0], v)
    if (got := b.get(mine[0])) is None or bytes(got) != v:
        raise fail(s, "clear", "a value written after clear() does not read back")


def _failed_write(s: StorageSubject, folder: str, rng: random.Random, ns: str) -> None:
    blocker = os.path.join(folder, "not-a-folder")
    with open(blocker, "wb") as f:
        f.write(b"x")
    try:
        b = s.backend(os.path.join(blocker, "store"), ns)
    except Exception as e:  # noqa: BLE001
        raise fail(s, "failed_write", f"building it on an unwritable path raised {type(e).__name__}: {e} "
                                      "(it must degrade: writes return False)") from e
    k, v = _key(ns, rng), _page(rng)
    try:
        ok = b.set(k, v)
        got = b.get(k)
        b.exists(k)
    except Exception as e:  # noqa: BLE001
        raise fail(s, "failed_write", f"a write or read on an unwritable path raised {type(e).__name__}: {e} "
                                      "(set must return False, get None)") from e
    if ok is not True and ok is not False:
        raise fail(s, "failed_write", f"set returned {ok!r}, not a bool")
    if ok and (got is None or bytes(got) != v):
        raise fail(s, "failed_write", "set returned True but the value does not read back")
    if not ok and got is not None:
        raise fail(s, "failed_write", "set returned False but get gives a value")


def hicache_storage_cases() -> list[Case]:
    return [Case(name, _in_folder(name, fn), fn.__doc__ or "") for name, fn in (
        ("round_trip", _round_trip), ("missing_key", _missing_key), ("overwrite", _overwrite),
        ("clear", _clear), ("failed_write", _failed_write))]
