"""Data parallelism on CPU: the router's policies, two replicas behind the offline engine
(round robin spreads requests and gives one engine's greedy outputs, a killed replica leaves
the other serving), prefix-aware routing visible in ``cached_tokens``, and ``core serve
--dp-size 2`` over HTTP (/health per replica, aggregated /metrics, /get_server_info, /v1/loads).

Replicas are processes from the engine's fork server (the first start pays its imports)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import os
import signal
import time

import pytest

from core.errors import InvalidRequest
from tests.conftest import greedy

ENGINE = dict(dtype="float32", max_total_tokens=1024, cpu_threads=1, device="cpu", log_level="warning")
SHARED = "You are a careful assistant. Answer briefly and exactly. " * 2  # 112 chars: 7 router blocks


# --------------------------------------------------------------------------- the router


def test_round_robin_skips_a_removed_replica():
    from core.engine.data_parallel.router import Router

    r = Router(3, "round_robin")
    assert [r.pick([1], [0, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]
    r.remove(1)
    assert [r.pick([1], [0, 0, 0]) for _ in range(3)] == [2, 0, 2]


def test_shortest_queue_takes_the_least_loaded_and_rotates_ties():
    from core.engine.data_parallel.router import Router

    r = Router(2, "shortest_queue")
    assert r.pick([1], [3, 1]) == 1 and r.pick([1], [0, 2]) == 0
    assert [r.pick([1], [0, 0]) for _ in range(2)] == [1, 0]


def test_prefix_routes_shared_prefixes_together_unless_loads_diverge():
    from core.engine.data_parallel.router import BALANCE_ABS, PREFIX_BLOCK, Router

    r = Router(2, "prefix")
    shared = list(range(100, 100 + 3 * PREFIX_BLOCK))
    first = r.pick(shared + [1, 2], [0, 0])
    assert r.pick(shared + [7, 8, 9], [1, 0]) == first  # a longer shared prefix beats the shorter queue
    assert r.pick(list(range(500, 540)), [2, 0]) != first  # nothing in common: the shortest queue
    assert r.pick(shared[:PREFIX_BLOCK - 1], [2, 0]) != first  # under one block: no match
    loads = [BALANCE_ABS + 10, 0] if first == 0 else [0, BALANCE_ABS + 10]
    assert r.pick(shared + [3], loads) != first  # too unbalanced: the shortest queue wins


def test_unknown_method_is_refused():
    from core.engine.data_parallel.router import Router
    from core.errors import CoreError

    with pytest.raises(CoreError, match="--load-balance-method 'random' is not one of round_robin"):
        Router(2, "random")


# --------------------------------------------------------------------------- two replicas, offline engine


@pytest.fixture(scope="module")
def model_path(tiny_llama):
    return tiny_llama("gqa")[0]


def _routed(eng) -> list[int]:
    return [r["routed_requests"] for r in eng.engine.replica_loads()]


def test_round_robin_spreads_and_matches_one_engine(model_path):
    import core

    prompts = ["The capital of France", "abc def", "Hello there", "1, 2, 3,"]
    asked = dict(return_logprob=True, logprob_start_len=0, token_ids_logprob=[3, 17])  # (through the replicas' deltas)
    keys = ("input_token_ids_logprobs", "output_token_ids_logprobs")
    with core.Engine(model_path=str(model_path), **ENGINE) as one:
        want = one.generate(prompts, greedy(6))
        want_asked = one.generate(prompts[2], greedy(3), **asked)["meta_info"]
        assert one.generate(prompts[0], greedy(6), routed_dp_rank=0)["output_ids"] == want[0]["output_ids"]
        with pytest.raises(InvalidRequest, match=r"routed_dp_rank=1 out of range \[0, 1\)"):
            one.generate(prompts[0], greedy(1), data_parallel_rank=1)  # (SGLang's old name)
    with core.Engine(model_path=str(model_path), **ENGINE, dp_size=2) as eng:
        got = eng.generate(prompts, greedy(6))
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
        assert [o["text"] for o in got] == [o["text"] for o in want]
        assert _routed(eng) == [2, 2]
        pinned = eng.generate(prompts, greedy(6), routed_dp_rank=1)  # SGLang's external routing: all to replica 1
        assert _routed(eng) == [2, 6] and [o["output_ids"] for o in pinned] == [o["output_ids"] for o in want]
        with pytest.raises(InvalidRequest, match=r"routed_dp_rank=2 out of range \[0, 2\)"):
            eng.generate(prompts[0], greedy(1), routed_dp_rank=2)
        got_asked = eng.generate(prompts[2], greedy(3), **asked)["meta_info"]
        assert [len(got_asked[k]) for k in keys] == [len(want_asked[k]) for k in keys] and len(got_asked[keys[1]]) == 3
        assert [[t for _, t, _ in p or []] for k in keys for p in got_asked[k]] == [
            [t for _, t, _ in p or []] for k in keys for p in want_asked[k]]
        chunks = list(eng.generate(prompts[0], greedy(6), stream=True))  # streaming through a replica
        assert chunks[-1]["text"] == want[0]["text"]
        # more than one chunk (a consumer that lags gets the newest chunk only: a long answer, so
        # that a fast replica does not finish before the first read)
        assert len(list(eng.generate(prompts[0], greedy(200), stream=True))) > 1
        # round robin ignores prefixes: the same prompt twice lands on both replicas, the second uncached
        a = eng.generate(SHARED + "one", greedy(2))
        b = eng.generate(SHARED + "two", greedy(2))
        assert a["meta_info"]["cached_tokens"] == 0 and b["meta_info"]["cached_tokens"] == 0
        load = eng.engine.load()
        assert load["max_total_num_tokens"] == 2 * eng.engine.max_total_tokens and load["num_running_reqs"] == 0

        async def paused_then_resumed():  # /pause_generation: every replica pauses, then goes on
            await eng.engine.pause_generation("in_place")
            task = asyncio.ensure_future(eng.engine.generate(prompts[1], greedy(6)))
            await asyncio.sleep(0.3)
            ran = task.done()
            await eng.engine.continue_generation()
            return ran, await task

        ran, out = eng._call(paused_then_resumed())
        assert not ran and out["output_ids"] == want[1]["output_ids"]
        norms = eng._call(eng.engine.weights_by_name("model.norm.weight", 3))  # /get_weights_by_name: per replica
        assert len(norms) == 2 and norms[0] == norms[1] and len(norms[0]) == 3
        ok, msg = eng._call(eng.engine.update_weights_from_disk(str(model_path)))  # every replica reloads
        assert ok, msg
        assert eng.generate(prompts[1], greedy(6))["output_ids"] == want[1]["output_ids"]
        try:  # /freeze_gc: the front end and every replica (each answers the objects it froze)
            assert eng._call(eng.engine.freeze_gc()) > 0
            replies = [eng._call(eng.engine._call(r, "freeze_gc")) for r in eng.engine.replicas]
            assert len(replies) == 2 and all(n > 10_000 for n in replies)  # a replica's start-up heap
        finally:
            gc.unfreeze()  # (this test process)
        assert eng.generate(prompts[1], greedy(6))["output_ids"] == want[1]["output_ids"]


def test_prefix_aware_routing_reuses_one_replicas_cache(model_path):
    import core

    with core.Engine(model_path=str(model_path), **ENGINE, dp_size=2, load_balance_method="prefix") as eng:
        outs = [eng.generate(SHARED + tail, greedy(2)) for tail in ("one", "two", "three")]
        cached = [o["meta_info"]["cached_tokens"] for o in outs]
        assert cached[0] == 0 and all(c >= len(SHARED) - 1 for c in cached[1:]), cached
        assert sorted(_routed(eng)) == [0, 3]
        eng.generate("zzz unrelated", greedy(2))  # no shared block: the idle replica
        assert sorted(_routed(eng)) == [1, 3]


def test_killed_replica_fails_its_requests_and_the_other_keeps_serving(model_path):
    import core

    with core.Engine(model_path=str(model_path), **ENGINE, dp_size=2) as eng:
        fe = eng.engine
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(eng.generate, [f"story {i}:" for i in range(4)], greedy(150))
            deadline = time.monotonic() + 30
            while not all(r.inflight for r in fe.replicas):
                assert time.monotonic() < deadline and not fut.done()
                time.sleep(0.005)
            victim = fe.replicas[1]
            os.kill(victim.process.pid, signal.SIGKILL)
            outs = fut.result(timeout=30)
        reasons = [o["meta_info"]["finish_reason"] for o in outs]
        assert [r["type"] for r in reasons] == ["length", "abort", "length", "abort"], reasons
        assert "data-parallel replica 1 died (exit code -9)" in reasons[1]["message"]
        assert all(len(o["output_ids"]) == 150 for o in outs[::2])
        loads = fe.replica_loads()
        assert [r["alive"] for r in loads] == [True, False] and "died" in loads[1]["error"]
        again = eng.generate(["after 1", "after 2"], greedy(3))
        assert all(len(o["output_ids"]) == 3 for o in again)
        assert _routed(eng)[0] == 4 and fe.fatal_error is None


# --------------------------------------------------------------------------- core serve --dp-size 2


def test_server_aggregates_replicas_and_survives_one_dying(model_path):
    import httpx

    from tests.server_utils import launch, stop

    server = launch("--model-path", str(model_path), "--device", "cpu", "--dtype", "float32", "--dp-size", "2", "--enable-metrics",
                    "--load-balance-method", "shortest_queue")
    url = server.base_url

    def generate(n: int) -> None:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            rs = list(pool.map(lambda i: httpx.post(url + "/generate", json={
                "text": f"prompt {i}", "sampling_params": {"temperature": 0, "max_new_tokens": 4}}, timeout=60), range(n)))
        assert all(r.status_code == 200 and len(r.json()["output_ids"]) == 4 for r in rs), [r.text for r in rs]

    try:
        health = httpx.get(url + "/health")
        assert health.status_code == 200 and [r["alive"] for r in health.json()["dp_replicas"]] == [True, True]
        generate(4)
        metrics = httpx.get(url + "/metrics").text
        assert any(line.startswith("sglang:num_requests_total") and line.endswith(" 4.0") for line in metrics.splitlines())
        info = httpx.get(url + "/get_server_info").json()
        assert [s["dp_rank"] for s in info["internal_states"]] == [0, 1] and info["dp_size"] == 2
        loads = httpx.get(url + "/v1/loads").json()
        assert len(loads["loads"]) == 2 and loads["aggregate"]["max_total_num_tokens"] == 2 * 16384
        for path in ("/update_weights_from_tensor", "/release_memory_occupation"):  # (as SGLang: one engine only)
            r = httpx.post(url + path, json={"serialized_named_tensors": []} if "tensor" in path else None)
            assert r.status_code == 400 and "--dp-size > 1" in r.json()["message"], r.text
        os.kill(health.json()["dp_replicas"][1]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 20
        while (h := httpx.get(url + "/health")).json()["dp_replicas"][1]["alive"]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert h.status_code == 200 and "died" in h.json()["dp_replicas"][1]["error"]
        generate(3)
    finally:
        stop(server)


def test_engine_in_its_own_process_serves_as_one_engine(model_path, tmp_path):
    """``--enable-frontend-multiprocessing`` (the CUDA default): one engine in a process of its own
    behind the HTTP server answers as the in-process engine does: same greedy tokens, SGLang's
    empty /health, its resolved seed, a profile traced where the steps run."""
    import gzip
    import json
    import subprocess
    import sys

    import httpx
    import psutil

    import core
    from tests.server_utils import launch, stop

    prompt, params = "The capital of France", {"temperature": 0, "max_new_tokens": 6}
    with core.Engine(model_path=str(model_path), **ENGINE) as eng:
        want = eng.generate(prompt, params)["output_ids"]
    server = launch("--model-path", str(model_path), "--dtype", "float32", "--enable-frontend-multiprocessing")
    url = server.base_url
    try:
        assert psutil.Process(server.proc.pid).children(), "the engine runs in a child process"
        health = httpx.get(url + "/health")
        assert health.status_code == 200 and health.content == b""
        assert httpx.post(url + "/generate", json={"text": prompt, "sampling_params": params}).json()["output_ids"] == want
        with httpx.stream("POST", url + "/generate", json={"text": prompt, "sampling_params": params, "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert chunks[-1]["output_ids"] == want  # (steps the stream fell behind on coalesce)
        info = httpx.get(url + "/get_server_info").json()
        assert isinstance(info["random_seed"], int) and "dp_rank" not in info["internal_states"][0]
        trace = httpx.post(url + "/start_profile", json={"output_dir": str(tmp_path)}).json()["trace"]
        assert httpx.post(url + "/generate", json={"text": prompt, "sampling_params": params}).status_code == 200
        assert httpx.post(url + "/stop_profile").json()["trace"] == trace
        assert any(e.get("name", "").startswith("aten::") for e in json.loads(gzip.open(trace).read())["traceEvents"])
    finally:
        stop(server)
    both = subprocess.run([sys.executable, "-m", "core.cli", "serve", "--model-path", str(model_path), "--port", "1",
                           "--enable-frontend-multiprocessing", "--disable-frontend-multiprocessing"],
                          capture_output=True, text=True, timeout=120)
    assert both.returncode != 0 and "contradict" in both.stderr


def test_front_end_text_matches_the_engines(model_path):
    """Replicas send token ids and the front end makes the text (``ReqSpec.detokenize``), except
    for requests with stop strings: texts and finish reasons equal one engine's for long answers
    (byte-level fragments held back and flushed), stop tokens with and without ``no_stop_trim``,
    stop strings, and streamed."""
    import core

    prompt, g40 = "Hello there", {"temperature": 0.0, "max_new_tokens": 40}
    with core.Engine(model_path=str(model_path), **ENGINE) as one:
        ids = one.generate(prompt, g40)["output_ids"]
        stop_tok = next(t for i, t in enumerate(ids) if i >= 4 and t not in ids[:i])
        text = one.generate(prompt, g40)["text"]
        cases = [g40, {**g40, "stop_token_ids": [stop_tok]},
                 {**g40, "stop_token_ids": [stop_tok], "no_stop_trim": True},
                 {**g40, "stop": [text[len(text) // 2 : len(text) // 2 + 3]]}]
        want = [one.generate(prompt, c) for c in cases]
    assert want[1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    assert len(want[2]["text"]) > len(want[1]["text"]) and want[3]["meta_info"]["finish_reason"]["type"] == "stop"
    with core.Engine(model_path=str(model_path), **ENGINE, dp_size=2) as eng:
        got = [eng.generate(prompt, c) for c in cases]
        for g, w in zip(got, want):
            assert (g["text"], g["output_ids"], g["meta_info"]["finish_reason"]) == \
                (w["text"], w["output_ids"], w["meta_info"]["finish_reason"])
        streamed = list(eng.generate(prompt, cases[1], stream=True))
        assert streamed[-1]["text"] == want[1]["text"]


def test_replicas_hicache_counters_reach_the_front_ends_metrics(model_path):
    """With the engine in other processes, /metrics' HiCache tier counters are the replicas' (each
    reports its tier with its load; the front end sums them)."""
    import re

    import core
    from core.server.metrics import Metrics

    with core.Engine(model_path=str(model_path), **ENGINE, dp_size=2, enable_hierarchical_cache=True,
                     hicache_write_policy="write_through") as eng:
        metrics = Metrics("tiny")
        metrics.attach(eng.engine)
        for prompt in ("The capital of France", "abc def", "Hello there", "1, 2, 3,"):  # (a report: each step's)
            eng.generate(prompt, greedy(4))  # write-through: the prompts' KV copied to the host tier
        reports = [r["tier_stats"] for r in eng.engine.replica_loads()]
        for _ in range(50):  # (a replica's last report may still be on its way: the front end's loop takes them)
            time.sleep(0.1)
            if (again := [r["tier_stats"] for r in eng.engine.replica_loads()]) == reports:
                break
            reports = again
        text = metrics.render().decode()
        assert sum(r["bytes_to_host"] for r in reports) > 0

        def value(name: str) -> float:
            return float(re.search(rf'^{name}\{{[^}}]*\}} (\S+)$', text, re.M).group(1))

        assert value("core:hicache_device_to_host_bytes_total") == sum(r["bytes_to_host"] for r in reports)
        assert value("core:hicache_host_total_tokens") == sum(r["host_total_tokens"] for r in reports) > 0


def test_a_front_end_failure_fails_its_request_only(model_path, monkeypatch):
    """An exception while the front end mirrors a delta (here its text) fails that request with the
    error, aborts it on its replica, and leaves the other requests of the same message served."""
    import core
    from core.engine.data_parallel.engine import DataParallelEngine

    text = DataParallelEngine._text

    def boom(self, req, d):
        if req.rid == "boom":
            raise ValueError("no text")
        return text(self, req, d)

    monkeypatch.setattr(DataParallelEngine, "_text", boom)
    with core.Engine(model_path=str(model_path), **ENGINE, dp_size=2) as eng:
        want = eng.generate("abc def", greedy(6))
        outs = eng.generate(["abc def", "abc def"], greedy(6), rid=["boom", "fine"])
        assert outs[0]["meta_info"]["finish_reason"]["type"] == "abort" and "no text" in outs[0]["meta_info"]["finish_reason"]["message"]
        assert outs[1]["output_ids"] == want["output_ids"] and outs[1]["text"] == want["text"]
        assert eng.generate("abc def", greedy(6))["output_ids"] == want["output_ids"]
        assert eng.engine.num_running() == 0 and not eng.engine.has_work()


def test_a_call_to_a_replica_that_dies_fails_instead_of_hanging(model_path):
    """A call (a weight update, /start_profile...) in flight when its replica dies, or made to a
    dead one, raises Unavailable naming the replica; the other keeps serving."""
    import asyncio

    import core
    from core.errors import Unavailable

    with core.Engine(model_path=str(model_path), **ENGINE, dp_size=2) as eng:
        de = eng.engine
        victim = de.replicas[1]

        async def go() -> None:
            os.kill(victim.info["pid"], signal.SIGKILL)  # (the call below races the front end noticing)
            with pytest.raises(Unavailable, match="replica 1"):
                await asyncio.wait_for(de._call(victim, "freeze_gc"), 30)
            with pytest.raises(Unavailable, match="replica 1"):  # noticed by now: refused at once
                await asyncio.wait_for(de._call(victim, "freeze_gc"), 5)

        eng._call(go())
        assert eng.generate("abc def", greedy(3))["meta_info"]["finish_reason"]["type"] == "length"


def test_routed_dp_rank_over_http_body_and_header(model_path):
    """/generate's routed_dp_rank (data_parallel_rank: the old name) and the OpenAI endpoints'
    X-Data-Parallel-Rank header, checked against the replicas there are (one here: rank 0 only)."""
    from core.server.args import ServerArgs
    from tests.server_utils import serve_in_process

    async def calls(c):
        gen = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
        comp = {"prompt": "hi", "max_tokens": 1}
        return [(await c.post("/generate", json={**gen, "routed_dp_rank": 0})).status_code,
                (await c.post("/generate", json={**gen, "data_parallel_rank": 1})).json(),
                (await c.post("/v1/completions", json=comp, headers={"X-Data-Parallel-Rank": "0"})).status_code,
                (await c.post("/v1/completions", json={**comp, "routed_dp_rank": 0},
                              headers={"X-Data-Parallel-Rank": "3"})).json(),
                (await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                              headers={"X-Data-Parallel-Rank": "x"})).json()]

    ok_gen, bad_gen, ok_comp, bad_comp, bad_header = serve_in_process({"model_path": str(model_path)}, ServerArgs(), calls)
    assert ok_gen == ok_comp == 200
    assert bad_gen["error"]["param"] == "routed_dp_rank" and "routed_dp_rank=1 out of range [0, 1)" in bad_gen["error"]["message"]
    assert "routed_dp_rank=3" in bad_comp["error"]["message"]  # (the header wins over the body)
    assert bad_header["error"]["param"] == "routed_dp_rank"
