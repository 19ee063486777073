"""HiCache's storage tier (issue 46): ``--hicache-storage-backend file`` under the host tier, over a
tiny float32 Llama with a small device pool. A prefix written to storage survives an engine restart
(a new engine on the same folder serves it with the tokens of a fresh prefill, ``cached_tokens``
and the metrics showing it); another dtype or page size never reads it; a corrupt page is detected
and recomputed; an unwritable folder degrades without failing a request; /flush_cache empties
every tier, storage included; the conformance suite passes for ``file`` and catches broken backends."""

from __future__ import annotations

import os
import random
import re

import pytest

from core.engine.mem_cache.storage import page_hashes
from core.interfaces import HiCacheStorageConfig
from core.server.metrics import Metrics
from core.testing import check_plugin, hicache_storage_conformance
from tests.conftest import assert_pool_free, greedy, make_engine

ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"


@pytest.fixture
def folder(tmp_path, monkeypatch):
    d = tmp_path / "hicache"
    monkeypatch.setenv(ENV, str(d))
    return d


@pytest.fixture(scope="module")
def fresh(tiny_llama):
    path, _ = tiny_llama()
    eng = make_engine(path, max_total_tokens=1024, disable_radix_cache=True)
    yield eng
    eng.shutdown()


def _engine(path, **kw):
    opts = dict(max_total_tokens=160, enable_hierarchical_cache=True, hicache_ratio=4.0,
                hicache_storage_backend="file")
    return make_engine(path, **{**opts, **kw})


def _prompt(seed: int = 7, n: int = 100) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(5, 250) for _ in range(n)]
    return prefix, prefix + [rng.randrange(5, 250) for _ in range(5)]


def _write(path, prompt, **kw) -> list[int]:
    """Serve ``prompt`` on a fresh engine (write-through: its pages reach storage) and shut it down."""
    eng = _engine(path, **kw)
    try:
        out = eng.generate(input_ids=prompt, sampling_params=greedy(6))
        eng.engine.tree_cache.flush_writes()
        assert eng.engine.tree_cache.stats.bytes_to_storage > 0
        return out["output_ids"]
    finally:
        eng.shutdown()


def _metric(metrics: Metrics, name: str) -> float:
    m = re.search(rf'^{name}\{{[^}}]*\}} (\S+)$', metrics.render().decode(), re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_prefix_survives_a_restart_in_the_file_tier(tiny_llama, fresh, folder, page_size, policy):
    """--hicache-storage-backend file, every --hicache-storage-prefetch-policy (all read synchronously)."""
    path, _ = tiny_llama()
    prefix, a = _prompt()
    ref = fresh.generate(input_ids=a, sampling_params=greedy(6))["output_ids"]
    assert _write(path, a, page_size=page_size) == ref
    assert any(f.suffix == ".bin" for f in folder.iterdir())
    eng = _engine(path, page_size=page_size, hicache_storage_prefetch_policy=policy)  # the restart (same folder)
    try:
        metrics = Metrics("tiny")
        metrics.attach(eng.engine)
        tree = eng.engine.tree_cache
        out = eng.generate(input_ids=a, sampling_params=greedy(6))
        assert out["output_ids"] == ref  # read from storage: the tokens of a fresh prefill
        want = (len(a) - 1) // page_size * page_size  # the last prompt token is always recomputed
        assert out["meta_info"]["cached_tokens"] == want
        assert tree.stats.storage_hit_tokens == want and tree.stats.host_hit_tokens == 0
        assert tree.stats.bytes_from_storage == want // page_size * tree.host_pool.bytes_per_page
        assert _metric(metrics, "core:hicache_storage_hit_tokens_total") == want
        assert _metric(metrics, "core:hicache_storage_to_host_bytes_total") == tree.stats.bytes_from_storage
        eng.engine.scheduler.check_accounting()
        assert_pool_free(eng)
    finally:
        eng.shutdown()


def test_another_dtype_or_page_size_does_not_read_it(tiny_llama, fresh, folder):
    path, _ = tiny_llama()
    _, a = _prompt(11)
    ref = fresh.generate(input_ids=a, sampling_params=greedy(6))["output_ids"]
    _write(path, a, page_size=4)
    for kw in ({"page_size": 2}, {"page_size": 4, "dtype": "bfloat16"}):
        eng = _engine(path, **kw)
        try:
            out = eng.generate(input_ids=a, sampling_params=greedy(6))
            assert out["meta_info"]["cached_tokens"] == 0 and eng.engine.tree_cache.stats.storage_hit_tokens == 0
            if "dtype" not in kw:
                assert out["output_ids"] == ref
        finally:
            eng.shutdown()
    # the key chain: a page's key names its whole prefix
    assert page_hashes([1, 2, 3, 4], 2)[1] != page_hashes([9, 2, 3, 4], 2)[1]
    assert page_hashes([1, 2, 3, 4], 2)[1:] == page_hashes([3, 4], 2, page_hashes([1, 2], 2)[0])


def test_corrupt_page_is_detected_and_recomputed(tiny_llama, fresh, folder):
    path, _ = tiny_llama()
    _, a = _prompt(13)
    ref = fresh.generate(input_ids=a, sampling_params=greedy(6))["output_ids"]
    _write(path, a, page_size=4)
    # find the 10th page's file of the prompt's chain and flip a byte of its payload
    eng = _engine(path, page_size=4)
    try:
        storage = eng.engine.tree_cache.storage
        keys = [storage.key(h) for h in page_hashes(a, 4)]
        victim = folder / (keys[10] + ".bin")
        data = bytearray(victim.read_bytes())
        data[-7] ^= 0xFF
        victim.write_bytes(bytes(data))
        out = eng.generate(input_ids=a, sampling_params=greedy(6))
        assert out["output_ids"] == ref  # the damaged page and the rest recomputed
        assert out["meta_info"]["cached_tokens"] == 40 and storage.stats.storage_hit_tokens == 40
        eng.engine.tree_cache.flush_writes()
        assert victim.exists() and victim.read_bytes() != bytes(data)  # written again, whole
        assert_pool_free(eng)
    finally:
        eng.shutdown()


def test_unwritable_folder_degrades_without_failing_requests(tiny_llama, fresh, tmp_path, monkeypatch):
    path, _ = tiny_llama()
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"x")
    monkeypatch.setenv(ENV, str(blocker / "hicache"))  # cannot be a folder, whoever runs this
    _, a = _prompt(17)
    ref = fresh.generate(input_ids=a, sampling_params=greedy(6))["output_ids"]
    eng = _engine(path, page_size=4)
    try:
        tree = eng.engine.tree_cache
        for _ in range(2):
            assert eng.generate(input_ids=a, sampling_params=greedy(6))["output_ids"] == ref
        tree.flush_writes()
        assert tree.stats.storage_failed_writes > 0 and tree.stats.bytes_to_storage == 0
        assert tree.host_used_pages > 0  # the host tier goes on
        assert_pool_free(eng)
    finally:
        eng.shutdown()


def test_flush_empties_every_tier(tiny_llama, fresh, folder):
    path, _ = tiny_llama()
    _, a = _prompt(19)
    ref = fresh.generate(input_ids=a, sampling_params=greedy(6))["output_ids"]
    eng = _engine(path, page_size=4)
    try:
        ae, tree = eng.engine, eng.engine.tree_cache
        assert eng.generate(input_ids=a, sampling_params=greedy(6))["output_ids"] == ref
        tree.flush_writes()
        assert any(f.suffix == ".bin" for f in folder.iterdir())
        assert ae.flush_cache()
        assert tree.host_used_pages == 0 and not tree.root.children
        assert not any(f.suffix == ".bin" for f in folder.iterdir())
        out = eng.generate(input_ids=a, sampling_params=greedy(6))
        assert out["output_ids"] == ref and out["meta_info"]["cached_tokens"] == 0
        assert_pool_free(eng)
    finally:
        eng.shutdown()


# --------------------------------------------------------------------------- the conformance suite
@pytest.fixture
def hicache_storage_backend():
    return "file"


TestFileConformance = hicache_storage_conformance


_STORE: dict[str, bytes] = {}  # one "remote store" shared by every instance, as a service would be


class _Dict:
    def __init__(self, config: HiCacheStorageConfig) -> None:
        self.ns, self.d = config.namespace, _STORE

    def get(self, key):
        return self.d.get(key)

    def set(self, key, value):
        self.d[key] = value
        return True

    def exists(self, key):
        return key in self.d

    def clear(self):
        for k in [k for k in self.d if k.startswith(self.ns + "_")]:
            del self.d[k]


class _KeepsFirst(_Dict):
    def set(self, key, value):
        self.d.setdefault(key, value)
        return True


class _Raises(_Dict):
    def __init__(self, config):
        super().__init__(config)
        self.path = config.path

    def set(self, key, value):
        if not os.path.isdir(os.path.dirname(self.path)):
            raise OSError("not a folder")
        return super().set(key, value)


def test_the_suite_catches_broken_backends():
    assert all(r.ok for r in check_plugin("file", "hicache_storage_backend"))
    assert all(r.status == "passed" for r in check_plugin(_Dict, "hicache_storage_backend"))
    failed = lambda target: {r.case for r in check_plugin(target, "hicache_storage_backend") if not r.ok}  # noqa: E731
    assert failed(_KeepsFirst) == {"overwrite"}
    assert failed(_Raises) == {"failed_write"}


def test_sglangs_clear_storage_endpoints(tiny_llama, folder):
    """SGLang's GET|POST /clear_hicache_storage_backend and POST /hicache/storage-backend/clear drop
    the stored pages (200, SGLang's JSON message); a server without a storage tier answers 400."""
    import asyncio

    import httpx

    from core.engine import AsyncEngine
    from core.engine.config import engine_args_from_kwargs
    from core.server.app import create_app
    from core.server.args import ServerArgs
    from core.server.state import build_state

    path, _ = tiny_llama()

    async def go(**hicache) -> list[int]:
        args = engine_args_from_kwargs(dict(model_path=str(path), dtype="float32", max_total_tokens=160, cpu_threads=1,
                                            device="cpu", grammar_backend="none", **hicache))
        engine = AsyncEngine(args)
        state = build_state(engine, ServerArgs())
        state.ready = True
        codes = []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://t") as c:
            for k, (method, url) in enumerate((("GET", "/clear_hicache_storage_backend"),
                                               ("POST", "/clear_hicache_storage_backend"),
                                               ("POST", "/hicache/storage-backend/clear"))):
                r = await c.post("/generate", json={"input_ids": _prompt(23 + k)[1], "sampling_params": greedy(4)})
                assert r.status_code == 200, r.text
                if hicache:
                    engine.tree_cache.flush_writes()  # (on the loop: the writers need nothing from it)
                    assert any(f.suffix == ".bin" for f in folder.iterdir())
                r = await c.request(method, url)
                codes.append(r.status_code)
                if r.status_code == 200:
                    assert r.json() == "Hierarchical cache storage backend cleared."
                    assert not any(f.suffix == ".bin" for f in folder.iterdir())
                else:
                    assert "--hicache-storage-backend" in r.text
        await engine.shutdown()
        return codes

    assert asyncio.run(go(enable_hierarchical_cache=True, hicache_ratio=4.0, hicache_storage_backend="file")) == [200] * 3
    assert asyncio.run(go()) == [400] * 3


def test_a_lora_adapters_kv_never_reaches_another_adapter_through_storage(tmp_path, monkeypatch):
    """Storage outlives the process; a LoRA adapter's cache keys hold its uid, which the next process
    gives to whichever adapter loads first. Run 2's adapter ``b`` (uid 1, as ``a`` was) was served
    ``a``'s stored KV: adapters' pages now stay out of storage."""
    pytest.importorskip("peft")
    from tests.conftest import build_tiny_llama
    from tests.test_lora_engine import hf_greedy, save_adapter

    monkeypatch.setenv(ENV, str(tmp_path / "hicache"))
    base = build_tiny_llama(tmp_path / "base")
    a, b = save_adapter(base, tmp_path / "a", 1), save_adapter(base, tmp_path / "b", 2)
    rng = random.Random(7)
    p = [1] + [rng.randrange(5, 250) for _ in range(60)]
    opts = dict(max_total_tokens=160, enable_hierarchical_cache=True, hicache_ratio=4.0, hicache_storage_backend="file",
                max_lora_rank=8, lora_target_modules=["q_proj", "v_proj"])
    for name, peft_model in (("a", a), ("b", b)):  # a restart in between, on the same storage folder
        e = make_engine(tmp_path / "base", lora_paths=[f"{name}={tmp_path / name}"], **opts)
        try:
            out = e.generate(input_ids=p, sampling_params=greedy(6), lora_path=name)
            e.engine.tree_cache.flush_writes()
        finally:
            e.shutdown()
        assert out["meta_info"]["cached_tokens"] == 0
        assert out["output_ids"] == hf_greedy(peft_model, p, 6)


def test_new_weights_saved_at_the_same_path_do_not_read_the_old_kv(tmp_path, monkeypatch):
    """The namespace named the model's path, not its weights: a fine-tune saved over the old one
    read the old weights' stored KV after a restart. It now covers the weight files too."""
    from tests.conftest import build_tiny_llama

    monkeypatch.setenv(ENV, str(tmp_path / "hicache"))
    path = tmp_path / "model"
    rng = random.Random(7)
    p = [1] + [rng.randrange(5, 250) for _ in range(60)]
    opts = dict(max_total_tokens=160, enable_hierarchical_cache=True, hicache_ratio=4.0, hicache_storage_backend="file")
    outs = []
    for seed in (0, 0, 1):  # the same weights again (a hit), then other weights at the same path
        if seed != (outs and outs[-1][0]):
            build_tiny_llama(path, seed=seed)
        e = make_engine(path, **opts)
        try:
            out = e.generate(input_ids=p, sampling_params=greedy(6))
            e.engine.tree_cache.flush_writes()
        finally:
            e.shutdown()
        outs.append((seed, out["meta_info"]["cached_tokens"], out["output_ids"]))
    fresh = make_engine(path, disable_radix_cache=True)
    try:
        want = fresh.generate(input_ids=p, sampling_params=greedy(6))["output_ids"]
    finally:
        fresh.shutdown()
    assert outs[0][1] == 0 and outs[1][1] > 0  # storage serves a restart on the same weights
    assert outs[2][1] == 0 and outs[2][2] == want
