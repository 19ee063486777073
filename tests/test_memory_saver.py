"""``--enable-memory-saver`` (SGLang's release / resume of memory occupation, ``core.engine.memory_saver``):
the released memory is gone (the storages hold nothing), a request sent meanwhile waits and then
answers exactly as before, weights that come back without a CPU backup hold requests until the
trainer's update lands, and the refusals name their reason."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from safetensors.torch import load_file

from core.errors import CoreError
from tests.conftest import make_engine

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [30, 31, 32]]
GREEDY = {"max_new_tokens": 10, "temperature": 0}


def outputs(eng) -> list[list[int]]:
    return [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def released_bytes(eng) -> tuple[int, int]:
    """(bytes the parameters' storages hold, bytes the KV buffers' hold)."""
    model, kv = eng.engine.model, eng.engine.kv_cache
    return (sum(p.untyped_storage().nbytes() for p in model.parameters()),
            sum(t.untyped_storage().nbytes() for t in (*kv.k, *kv.v)))


def submit(eng):
    """A generate sent now on the engine's loop, as a concurrent future."""
    return asyncio.run_coroutine_threadsafe(eng.engine.generate(input_ids=PROMPTS, sampling_params=GREEDY), eng._loop)


@pytest.mark.parametrize("dtype,flags", [("float32", {"enable_memory_saver": True, "enable_weights_cpu_backup": True}),
                                         ("bfloat16", {"enable_weights_cpu_backup": True})])  # (either enables it, as SGLang)
def test_release_and_resume_with_a_cpu_backup(tiny_llama, dtype, flags):
    eng = make_engine(tiny_llama()[0], dtype=dtype, skip_tokenizer_init=True, **flags)
    try:
        want = outputs(eng)
        full = released_bytes(eng)
        eng.release_memory_occupation()
        assert released_bytes(eng) == (0, 0)
        pending = submit(eng)
        time.sleep(0.3)
        assert not pending.done(), "a request waits while the memory is released"
        eng.resume_memory_occupation(["weights"])
        time.sleep(0.2)
        assert not pending.done(), "and while the KV cache still is"
        eng.resume_memory_occupation(["kv_cache", "cuda_graph"])
        assert [o["output_ids"] for o in pending.result(timeout=60)] == want
        assert released_bytes(eng) == full
        assert outputs(eng) == want
    finally:
        eng.shutdown()


def test_weights_without_a_backup_wait_for_the_trainer(tiny_llama):
    path = tiny_llama()[0]
    eng = make_engine(path, skip_tokenizer_init=True, enable_memory_saver=True)
    try:
        want = outputs(eng)
        eng.release_memory_occupation(["kv_cache"])
        eng.resume_memory_occupation()  # (every tag: the weights were never released, nothing waits)
        assert outputs(eng) == want
        eng.release_memory_occupation(["weights", "kv_cache"])
        tensors = list(load_file(str(path / "model.safetensors")).items())
        ok, message = eng.update_weights_from_tensor(tensors)
        assert not ok and "resume_memory_occupation with tag 'weights' first" in message
        eng.resume_memory_occupation()
        pending = submit(eng)
        time.sleep(0.3)
        assert not pending.done(), "weights back without their values: requests wait for an update"
        ok, message = eng.update_weights_from_tensor(tensors)
        assert ok, message
        assert [o["output_ids"] for o in pending.result(timeout=60)] == want
    finally:
        eng.shutdown()


def test_refusals(tiny_llama):
    path = tiny_llama()[0]
    plain = make_engine(path, skip_tokenizer_init=True)
    try:
        with pytest.raises(CoreError, match="only with --enable-memory-saver"):
            plain.release_memory_occupation()
    finally:
        plain.shutdown()
    long_ctx = tiny_llama(max_position_embeddings=2048)[0]  # (room for a request long enough to be running)
    eng = make_engine(long_ctx, skip_tokenizer_init=True, enable_memory_saver=True, max_total_tokens=4096)
    try:
        with pytest.raises(CoreError, match="unknown memory tag 'vram'"):
            eng.release_memory_occupation(["vram"])
        pending = asyncio.run_coroutine_threadsafe(eng.engine.generate(
            input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 1500, "ignore_eos": True}), eng._loop)
        deadline = time.monotonic() + 60
        while not eng.engine.scheduler.running and not pending.done() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert eng.engine.scheduler.running, pending.result(timeout=0) if pending.done() else "never ran"
        asyncio.run_coroutine_threadsafe(eng.engine.pause_generation("in_place"), eng._loop).result(timeout=30)
        with pytest.raises(CoreError, match="paused in place"):
            eng.release_memory_occupation()
        assert released_bytes(eng)[1] > 0, "nothing was freed"
        asyncio.run_coroutine_threadsafe(eng.engine.continue_generation(), eng._loop).result(timeout=30)
        assert len(pending.result(timeout=120)["output_ids"]) == 1500
    finally:
        eng.shutdown()


def test_http_endpoints_and_tensor_parallel_ranks(tiny_llama):
    """SGLang's endpoints (an empty body: every tag), and a second tensor-parallel rank doing the same."""
    from core.server.app import create_app
    from core.server.args import ServerArgs
    from core.server.state import build_state

    eng = make_engine(tiny_llama()[0], skip_tokenizer_init=True, enable_memory_saver=True,
                      enable_weights_cpu_backup=True, tp_size=2)
    try:
        want = outputs(eng)
        state = build_state(eng.engine, ServerArgs())
        state.ready = True

        async def go() -> list:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://t",
                                         timeout=120) as c:
                out = [await c.post("/release_memory_occupation")]
                out.append(released_bytes(eng))
                out.append(await c.post("/resume_memory_occupation", json={"tags": ["weights", "kv_cache", "cuda_graph"]}))
                out.append(await c.post("/release_memory_occupation", json={"tags": ["gpu"]}))
                return out

        released, during, resumed, bad = asyncio.run_coroutine_threadsafe(go(), eng._loop).result(timeout=120)
        assert released.status_code == 200 and released.json()["success"] is True
        assert during == (0, 0)
        assert resumed.status_code == 200 and resumed.json()["success"] is True
        assert bad.status_code == 400 and "unknown memory tag 'gpu'" in bad.json()["message"]
        assert outputs(eng) == want
    finally:
        eng.shutdown()
