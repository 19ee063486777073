"""Request fields and engine arguments are honoured or refused, never accepted and ignored
(issue 41): /update_weights_from_disk flushes the prefix cache by default (SGLang's
``flush_cache``) and atomically with the swap; /encode, /classify and /v1/embeddings follow
/generate's field policy; /get_model_info tells an embedding server apart; and
``Engine(enable_lora=True)`` is refused."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from tests.conftest import build_tiny_llama, hf_greedy

PROMPT = [5 + (i * 7) % 90 for i in range(40)]  # long enough to leave whole pages in the prefix cache


def _args(path: Path, **kwargs: Any):
    from core.engine.config import engine_args_from_kwargs

    return engine_args_from_kwargs(dict(model_path=str(path), dtype="float32", max_total_tokens=1024, cpu_threads=1,
                                        device="cpu", grammar_backend="none", **kwargs))


async def _serve(path: Path, **kwargs: Any):
    """(engine, ASGI client) over the tiny model at ``path``."""
    from core.engine import AsyncEngine
    from core.server.app import create_app
    from core.server.args import ServerArgs
    from core.server.state import build_state

    engine = AsyncEngine(_args(path, **kwargs))
    state = build_state(engine, ServerArgs())
    state.ready = True
    return engine, httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://t")


async def _gen(c: httpx.AsyncClient, n: int = 4) -> tuple[list[int], int]:
    r = await c.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                                                                  "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"], r.json()["meta_info"]["cached_tokens"]


async def _until(cond: Callable[[], Any], timeout: float = 10.0) -> None:
    """Poll ``cond`` (bounded: a broken engine fails the assertions that follow, it does not hang)."""
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        await asyncio.sleep(0.001)


@pytest.fixture(scope="module")
def two_models(tmp_path_factory) -> tuple[Path, Any, Path, Any]:
    a, b = tmp_path_factory.mktemp("weights-a"), tmp_path_factory.mktemp("weights-b")
    return a, build_tiny_llama(a, seed=0), b, build_tiny_llama(b, seed=1)


def test_update_weights_flushes_the_prefix_cache_unless_told_not_to(two_models) -> None:
    path_a, hf_a, path_b, hf_b = two_models

    async def main() -> None:
        engine, c = await _serve(path_a)
        try:
            assert (await _gen(c))[0] == hf_greedy(hf_a, PROMPT, 4)
            assert (await _gen(c))[1] > 0  # the prompt is cached
            # flush_cache false: the cache is kept (the caller vouches for its prefixes)
            r = await c.post("/update_weights_from_disk", json={"model_path": str(path_b), "flush_cache": False})
            assert r.status_code == 200 and r.json()["success"] is True, r.text
            assert (await _gen(c))[1] > 0
            # the default flushes it: nothing computed under the old weights is reused
            r = await c.post("/update_weights_from_disk", json={"model_path": str(path_b)})
            assert r.status_code == 200 and r.json()["success"] is True, r.text
            out, cached = await _gen(c)
            assert cached == 0 and out == hf_greedy(hf_b, PROMPT, 4)
        finally:
            await c.aclose()
            await engine.shutdown()

    asyncio.run(main())


def test_update_is_atomic_with_in_flight_and_new_requests(two_models) -> None:
    """A request running when the update starts finishes under the old weights; one sent while
    it is under way waits for it and sees neither the old weights nor their cached prefixes."""
    path_a, hf_a, path_b, hf_b = two_models

    async def main() -> None:
        engine, c = await _serve(path_a)
        try:
            await _gen(c)  # PROMPT is cached under the old weights
            running = asyncio.create_task(_gen(c, 24))
            await _until(engine.num_running)
            update = asyncio.create_task(c.post("/update_weights_from_disk", json={"model_path": str(path_b),
                                                                                    "torch_empty_cache": True,
                                                                                    "recapture_cuda_graph": True}))
            await _until(lambda: engine._held is not None)  # the update is waiting for the running request
            after = asyncio.create_task(_gen(c))
            old_out, _ = await running
            assert old_out == hf_greedy(hf_a, PROMPT, 24)
            assert (await update).status_code == 200
            new_out, cached = await after
            assert cached == 0 and new_out == hf_greedy(hf_b, PROMPT, 4)
        finally:
            await c.aclose()
            await engine.shutdown()

    asyncio.run(main())


def test_update_refuses_fields_of_missing_features(two_models) -> None:
    path_a, _, _, _ = two_models

    async def main() -> None:
        engine, c = await _serve(path_a)
        try:
            for field, value in (("is_async", True), ("token_step", 3)):
                r = await c.post("/update_weights_from_disk", json={"model_path": str(path_a), field: value})
                assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
            info = (await c.get("/get_model_info")).json()
            assert info["is_generation"] is True
            # load_format names the format to read: a safetensors folder read as .bin / GGUF fails, old weights kept
            for fmt, why in (("pt", "no *.bin or *.pt weights"), ("gguf", "needs a .gguf model")):
                r = await c.post("/update_weights_from_disk", json={"model_path": str(path_a), "load_format": fmt})
                assert r.status_code == 400 and not r.json()["success"] and why in r.json()["message"], (fmt, r.text)
            r = await c.post("/update_weights_from_disk", json={"model_path": str(path_a), "load_format": "safetensors"})
            assert r.status_code == 200 and r.json()["success"], r.text
        finally:
            await c.aclose()
            await engine.shutdown()

    asyncio.run(main())


def test_unsupported_engine_args_are_refused_by_type_and_value() -> None:
    from core.engine.config import engine_args_from_kwargs
    from core.errors import CoreError

    for kw in ({"pp_size": 2}, {"pp_size": True}, {"enable_dp_attention": 1}, {"speculative_algorithm": "DFLASH"},
               {"max_lora_chunk_size": 32}):
        with pytest.raises(CoreError, match=next(iter(kw))):
            engine_args_from_kwargs({"model_path": "/m", **kw})
    args = engine_args_from_kwargs({"model_path": "/m", "enable_lora": False, "pp_size": 1, "lora_paths": None,
                                    "disaggregation_mode": "null"})
    assert args.model_path == "/m"
    # any other SGLang server argument is named as one, not as an unknown argument
    with pytest.raises(CoreError, match="SGLang option.*not supported by this engine yet: enable_lmcache"):
        engine_args_from_kwargs({"model_path": "/m", "enable_lmcache": True})
    with pytest.raises(CoreError, match="unknown engine argument.*: enable_lmcach$"):
        engine_args_from_kwargs({"model_path": "/m", "enable_lmcach": True})


def test_embedding_endpoints_honour_refuse_or_log_every_field(two_models) -> None:
    """SGLang's policy, as on /generate: fields served are honoured, fields of features this server
    lacks are a 400 when set, unknown top-level fields are ignored and logged once per name."""
    from structlog.testing import capture_logs

    path_a, _, _, _ = two_models

    async def main() -> None:
        engine, c = await _serve(path_a, is_embedding=True)
        try:
            assert (await c.get("/get_model_info")).json()["is_generation"] is False
            ref = (await c.post("/encode", json={"input_ids": PROMPT})).json()["embedding"]
            with capture_logs() as logs:
                for _ in range(2):
                    r = await c.post("/encode", json={"input_ids": PROMPT, "rid": "r1", "log_metrics": False,
                                                      "no_such_field": 1})
                    assert r.status_code == 200, r.text
                    assert r.json()["embedding"] == ref and r.json()["meta_info"]["id"] == "r1"
                r = await c.post("/v1/embeddings", json={"input": PROMPT, "model": "m", "user": "u", "no_such_field": 1})
                assert r.status_code == 200 and r.json()["data"][0]["embedding"] == ref, r.text
            ignored = [(e["path"], e["field"]) for e in logs if e["event"] == "embeddings.unknown_field_ignored"]
            assert ignored == [("/encode", "no_such_field"), ("/v1/embeddings", "no_such_field")]
            for path, field, value in (("/encode", "dimensions", 8), ("/encode", "image_data", "x"),
                                       ("/encode", "is_cross_encoder_request", True), ("/encode", "priority", 1),
                                       ("/classify", "lora_path", "x"), ("/v1/embeddings", "dimensions", 8),
                                       ("/v1/embeddings", "priority", 1), ("/v1/embeddings", "lora_path", "x")):
                key = "input" if path == "/v1/embeddings" else "input_ids"
                r = await c.post(path, json={key: PROMPT, field: value})
                assert r.status_code == 400 and r.json()["error"]["param"] == field, (path, field, r.text)
        finally:
            await c.aclose()
            await engine.shutdown()

    asyncio.run(main())


def test_update_flushes_every_data_parallel_replica(two_models) -> None:
    import core

    path_a, _, path_b, hf_b = two_models
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    with core.Engine(model_path=str(path_a), dtype="float32", max_total_tokens=1024, cpu_threads=1, device="cpu",
                     log_level="warning", dp_size=2) as eng:
        for _ in range(2):  # round robin: the prompt is cached on both replicas
            eng.generate(input_ids=PROMPT, sampling_params=params)
        ok, msg = eng._call(eng.engine.update_weights_from_disk(str(path_b), flush_cache=False))
        assert ok, msg
        for _ in range(2):  # kept on both
            assert eng.generate(input_ids=PROMPT, sampling_params=params)["meta_info"]["cached_tokens"] > 0
        ok, msg = eng._call(eng.engine.update_weights_from_disk(str(path_b)))
        assert ok, msg
        for _ in range(2):
            out = eng.generate(input_ids=PROMPT, sampling_params=params)
            assert out["meta_info"]["cached_tokens"] == 0 and out["output_ids"] == hf_greedy(hf_b, PROMPT, 4)
