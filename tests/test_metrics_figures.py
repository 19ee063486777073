"""Figures /metrics, /server_info and ``core bench serving`` printed wrong (each test failed before
its fix): inter-token latencies counted per verify or dropped in mixed batches, a data-parallel
cache hit rate averaged over idle replicas, zero-second gaps from a first chunk of several tokens,
and SGLang's avg_spec_accept_length missing."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from typing import Any

import httpx
import pytest

from tests.test_speculative import GREEDY, PROMPTS, OracleDrafter, tiny  # noqa: F401  (tiny: the fixture)


def _val(text: str, name: str) -> float | None:
    m = re.search(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


def _serve(tiny, requests, **engine_kw: Any):
    """Run ``requests(client, engine, state)`` against an in-process server with metrics on."""
    from core.engine import AsyncEngine
    from core.engine.config import engine_args_from_kwargs
    from core.server.app import create_app
    from core.server.args import ServerArgs
    from core.server.state import build_state

    async def go():
        kw = dict(model_path=str(tiny), dtype="float32", max_total_tokens=2048, cpu_threads=1, device="cpu",
                  grammar_backend="none", random_seed=0, **engine_kw)
        engine = AsyncEngine(engine_args_from_kwargs(kw))
        state = build_state(engine, ServerArgs(enable_metrics=True))
        state.ready = True
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://t",
                                         timeout=60) as c:
                return await requests(c, engine, state)
        finally:
            await engine.shutdown()

    return asyncio.run(go())


def test_speculative_decoding_observes_every_token(tiny):
    """A verify keeps several tokens: the ITL histogram had one observation per verify and the
    throughput window one token, so ITL read too high and gen_throughput too low."""
    async def requests(c, engine, state):
        spec = engine.scheduler.speculator
        spec.drafter.propose = lambda st, tokens, k: []
        want = (await c.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": GREEDY})).json()["output_ids"]
        spec.drafter = OracleDrafter({tuple(PROMPTS[0]): want})
        before = _val((await c.get("/metrics")).text, "sglang:inter_token_latency_seconds_count") or 0
        state.metrics._gen_window.clear()
        meta = (await c.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": GREEDY})).json()["meta_info"]
        await asyncio.sleep(0)
        window = sum(t for _, t in state.metrics._gen_window)
        after = _val((await c.get("/metrics")).text, "sglang:inter_token_latency_seconds_count")
        info = (await c.get("/server_info")).json()["internal_states"][0]
        return meta, after - before, window, info

    meta, itl, window, info = _serve(tiny, requests, speculative_algorithm="NGRAM")
    n = meta["completion_tokens"]
    assert meta["spec_verify_ct"] < n - 1  # several tokens per verify
    assert (itl, window) == (n - 1, n)
    assert info["avg_spec_accept_length"] > 1  # SGLang's bench_serving reads it here


def test_decodes_inside_mixed_batches_are_inter_token_gaps(tiny):
    async def requests(c, engine, state):
        sp = {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}
        a = c.post("/generate", json={"input_ids": [5 + j % 13 for j in range(8)], "sampling_params": sp})
        b = c.post("/generate", json={"input_ids": [6 + j % 11 for j in range(200)],
                                      "sampling_params": {**sp, "max_new_tokens": 4}})
        ra, rb = await asyncio.gather(a, b)
        return ra.json(), rb.json(), (await c.get("/metrics")).text

    ra, rb, text = _serve(tiny, requests, enable_mixed_chunk=True, chunked_prefill_size=16, disable_radix_cache=True)
    n = ra["meta_info"]["completion_tokens"] + rb["meta_info"]["completion_tokens"]
    assert _val(text, "sglang:inter_token_latency_seconds_count") == n - 2  # every token after each first


def test_a_data_parallel_hit_rate_weighs_the_replicas_by_their_prompts():
    from core.engine.data_parallel.engine import DataParallelEngine, Replica

    eng = object.__new__(DataParallelEngine)
    base = dict(num_running_reqs=0, num_waiting_reqs=0, num_total_reqs=0, num_used_tokens=0, num_free_tokens=100,
                max_total_num_tokens=100, max_running_requests=8)
    busy, idle = Replica(0, None, None), Replica(1, None, None)
    busy.load = {**base, "cache_hit_rate": 0.8, "cache_hit_tokens": 800, "cache_query_tokens": 1000}
    idle.load = {**base, "cache_hit_rate": 0.0, "cache_hit_tokens": 0, "cache_query_tokens": 0}  # no prompt yet
    eng.replicas = [busy, idle]
    assert eng.load()["cache_hit_rate"] == 0.8


def test_bench_serving_adds_no_zero_gaps_for_a_first_chunk_of_several_tokens():
    """sglang.bench_serving takes inter-token gaps from the chunks after the first only."""
    from core.bench_serving import _send, summarize

    async def body():
        for count in (3, 4, 5):
            await asyncio.sleep(0.05)
            yield ("data: " + json.dumps({"text": "x" * count, "meta_info": {"completion_tokens": count}}) + "\n\n").encode()
        yield b"data: [DONE]\n\n"

    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body(),
                                                                   headers={"content-type": "text/event-stream"}))
    ns = argparse.Namespace(backend="sglang", disable_ignore_eos=False, timeout=30.0, request_rate=float("inf"),
                            max_concurrency=None)

    async def go():
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await _send(c, ns, None, [1, 2, 3], 5)

    res = asyncio.run(go())
    assert res.success and res.output_len == 5 and len(res.itl) == 2 and 0.0 not in res.itl
    assert summarize([res], 1.0, ns)["p50_itl_ms"] > 30


@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
def test_bench_serving_timeout_bounds_each_read_not_the_stream(client, monkeypatch):
    """``--timeout`` is httpx's per-read bound under either client: a stream whose events each come
    within it, but whose whole takes longer, completes (aiohttp's total timeout failed it)."""
    web = pytest.importorskip("aiohttp.web")
    import sys

    from core.bench_serving import add_bench_command, run_benchmark

    if client == "httpx":
        monkeypatch.setitem(sys.modules, "aiohttp", None)

    async def info(request):
        return web.json_response({"vocab_size": 1000, "context_length": 4096, "served_model_name": "m"})

    async def slow(request):
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i in range(1, 5):
            await asyncio.sleep(0.6)
            await resp.write(f"data: {json.dumps({'text': 'x', 'meta_info': {'completion_tokens': i}})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def go():
        app = web.Application()
        app.router.add_get("/get_model_info", info)
        app.router.add_post("/generate", slow)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base = "http://127.0.0.1:%d" % site._server.sockets[0].getsockname()[1]
        root = argparse.ArgumentParser()
        add_bench_command(root.add_subparsers(dest="command"))
        ns = root.parse_args(["bench", "serving", "--base-url", base, "--num-prompts", "1", "--random-input-len", "4",
                              "--random-output-len", "4", "--timeout", "1.5"])
        try:
            return await run_benchmark(ns)
        finally:
            await runner.cleanup()

    result = asyncio.run(go())
    assert result["completed"] == 1 and result["total_output_tokens"] == 4, result["errors"]
