"""The offline Engine API on a tiny random Llama with a char-level tokenizer: generate forms,
streaming, async, seeds, stop conditions, aborts, bad input, and KV-pool leak checks."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import threading
import time

import pytest

from core.errors import CoreError, InvalidRequest, ModelLoadError
from tests.conftest import assert_greedy_matches, assert_pool_free, finished_requests, greedy, hf_greedy, make_engine

PROMPT = "The quick brown fox"


def wait_until(cond, timeout: float = 30.0) -> None:
    """Poll ``cond`` (not a timing assertion: the deadline only bounds a hang)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.005)


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return tiny_llama("gqa")


@pytest.fixture(scope="module")
def eng(tiny, engine_factory):
    path, _ = tiny
    return engine_factory(path, max_total_tokens=1024, max_running_requests=16)


@pytest.fixture(scope="module")
def long_eng(tiny_llama, engine_factory):
    """Same weights, 4096 positions: long requests stay running for as long as an abort test needs."""
    path, _ = tiny_llama("gqa", max_position_embeddings=4096)
    return engine_factory(path, max_total_tokens=8192, max_running_requests=8)


LONG = {"temperature": 0, "max_new_tokens": 4000, "ignore_eos": True}


@pytest.fixture(autouse=True)
def _pool_is_free_after_each_test(request):
    yield
    for name in ("eng", "long_eng"):
        if name in request.fixturenames:
            e = request.getfixturevalue(name)
            wait_until(lambda: not e.engine.scheduler.has_work)
            assert_pool_free(e)


def ids_of(eng, text: str) -> list[int]:
    return eng.tokenizer.encode(text, add_special_tokens=True)


# --------------------------------------------------------------------------- generate forms


def test_single_text_prompt_matches_transformers(eng, tiny):
    _, hf = tiny
    out = eng.generate(PROMPT, greedy(8))
    assert set(out) >= {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == 8
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["id"] and meta["e2e_latency"] >= 0 and meta["cached_tokens"] == 0
    assert_greedy_matches(hf, ids_of(eng, PROMPT), out["output_ids"], 8)
    assert out["text"] == eng.tokenizer.decode(out["output_ids"], skip_special_tokens=True)


def test_batch_of_text_prompts_and_of_input_ids(eng):
    prompts = ["a", "Hello there", "Twelve chars"]
    by_text = eng.generate(prompts, greedy(5))
    assert isinstance(by_text, list) and len(by_text) == 3
    by_ids = eng.generate(input_ids=[ids_of(eng, p) for p in prompts], sampling_params=greedy(5))
    assert [o["output_ids"] for o in by_ids] == [o["output_ids"] for o in by_text]
    assert [o["text"] for o in by_ids] == [o["text"] for o in by_text]
    for p, o in zip(prompts, by_text):
        assert o["meta_info"]["prompt_tokens"] == len(p)
        assert o == eng.generate(p, greedy(5)) | {"meta_info": o["meta_info"]}


def test_per_prompt_sampling_params(eng):
    outs = eng.generate(["one", "two", "three"], [greedy(2), greedy(5), {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}])
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [2, 5, 3]
    with pytest.raises(InvalidRequest) as e:
        eng.generate(["one", "two"], [greedy(2)])
    assert e.value.param == "sampling_params"


def test_n_returns_n_outputs(eng):
    outs = eng.generate(PROMPT, {"temperature": 1.0, "max_new_tokens": 6, "min_new_tokens": 6, "n": 3, "seed": 7})
    assert isinstance(outs, list) and len(outs) == 3
    assert len({o["meta_info"]["id"] for o in outs}) == 3
    assert len({tuple(o["output_ids"]) for o in outs}) > 1, "n samples with derived seeds should differ"
    # greedy n=2 gives two identical sequences; a batch of 2 prompts with n=2 gives 4 outputs
    g = eng.generate(PROMPT, greedy(4, n=2))
    assert len(g) == 2 and g[0]["output_ids"] == g[1]["output_ids"]
    assert len(eng.generate(["ab", "cd"], greedy(2, n=2))) == 4


def test_stream_yields_cumulative_text_ending_with_the_final_text(eng):
    final = eng.generate(PROMPT, greedy(12))
    chunks = list(eng.generate(PROMPT, greedy(12), stream=True))
    assert chunks
    for a, b in zip(chunks, chunks[1:]):
        assert b["text"].startswith(a["text"])
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    for c in chunks:
        assert final["text"].startswith(c["text"])
    assert chunks[-1]["text"] == final["text"] and chunks[-1]["output_ids"] == final["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])

    # the same through AsyncEngine on its own loop, consumed without a gap: exact
    async def on_loop():
        return [c async for c in await eng.engine.generate(PROMPT, greedy(12), stream=True)]

    chunks = eng._call(on_loop())
    assert chunks[-1]["text"] == final["text"] and chunks[-1]["output_ids"] == final["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert all(b["text"].startswith(a["text"]) for a, b in zip(chunks, chunks[1:]))


def test_slow_stream_consumer_still_gets_the_final_chunk(eng):
    """Regression: the stream used to check ``req.finished`` only after the consumer came back,
    so a request that finished meanwhile ended the stream without its final chunk."""
    it = eng.generate(PROMPT, {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}, stream=True)
    chunks = [next(it)]
    assert chunks[0]["meta_info"]["finish_reason"] is None
    wait_until(lambda: not eng.engine.scheduler.has_work)  # the request finishes while the consumer is busy
    chunks += list(it)
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 40}
    assert len(chunks[-1]["output_ids"]) == 40


def test_batch_stream_chunks_carry_their_index(eng):
    prompts = ["first", "second one"]
    final = eng.generate(prompts, greedy(6))
    last: dict[int, dict] = {}
    for chunk in eng.generate(prompts, greedy(6), stream=True):
        assert chunk["index"] in (0, 1)
        last[chunk["index"]] = chunk
    assert [last[i]["text"] for i in (0, 1)] == [o["text"] for o in final]


def test_async_generate_and_async_stream(eng):
    expected = eng.generate(PROMPT, greedy(7))

    async def main():
        out = await eng.async_generate(PROMPT, greedy(7))
        batch = await eng.async_generate([PROMPT, "xyz"], greedy(7))
        chunks = [c async for c in await eng.async_generate(PROMPT, greedy(7), stream=True)]
        concurrent = await asyncio.gather(*(eng.async_generate(PROMPT, greedy(7)) for _ in range(3)))
        return out, batch, chunks, concurrent

    out, batch, chunks, concurrent = asyncio.run(main())
    assert out["output_ids"] == expected["output_ids"] and out["text"] == expected["text"]
    assert batch[0]["output_ids"] == expected["output_ids"] and len(batch) == 2
    assert all(c["text"].startswith(p["text"]) for p, c in zip(chunks, chunks[1:]))
    assert chunks[-1]["text"] == expected["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 7}
    assert [c["output_ids"] for c in concurrent] == [expected["output_ids"]] * 3


def test_small_cpu_decodes_run_on_the_loop_thread_and_never_beside_another_forward(eng):
    """A CPU decode of a few rows runs on the event loop's thread (no hand-off to the forward
    thread), as does a larger one that the last decode's pace says is short; prefills and long
    decodes stay on the forward thread, and while a job such as an embedding forward holds the
    forward thread, decodes queue behind it there instead."""
    ae = eng.engine
    if ae.device.type != "cpu" or ae.overlap:
        pytest.skip("inline decodes are the CPU's plain loop (overlap hands every forward to the thread)")
    expected = eng.generate(PROMPT, greedy(6))["output_ids"]
    seen: list[tuple[bool, int, str]] = []
    run = ae.runner.run

    def spy(batch):
        seen.append((batch.is_prefill, len(batch.reqs), threading.current_thread().name))
        return run(batch)

    ae.runner.run = spy
    try:
        assert eng.generate(PROMPT, greedy(6))["output_ids"] == expected
        on = {(p, name) for p, _, name in seen}
        assert on == {(True, "core-forward_0"), (False, "core-engine-loop")}, on
        seen.clear()
        ae.inline_decode_rows, ae.inline_decode_s = 2, 0.0  # a batch of 3 decodes is no longer "small"
        outs = eng.generate([PROMPT] * 3, [greedy(6)] * 3)
        assert [o["output_ids"] for o in outs] == [expected] * 3
        assert {name for p, n, name in seen if not p and n == 3} == {"core-forward_0"}
        seen.clear()
        ae.inline_decode_s = 10.0  # at the pace of the decodes before (far below 10 s for 3 rows): inline
        outs = eng.generate([PROMPT] * 3, [greedy(6)] * 3)
        assert [o["output_ids"] for o in outs] == [expected] * 3
        assert {name for p, n, name in seen if not p and n == 3} == {"core-engine-loop"}
        seen.clear()
        ae.inline_decode_rows = 8
        ae._forward_jobs += 1  # as while an encode or a weight reload is queued on the forward thread
        assert eng.generate(PROMPT, greedy(6))["output_ids"] == expected
        assert {name for _, _, name in seen} == {"core-forward_0"}
    finally:
        ae._forward_jobs = 0
        ae.inline_decode_rows, ae.inline_decode_s = 8, 0.005
        ae.runner.run = run


def test_the_loop_runs_until_idle_between_inline_decode_steps(long_eng):
    """While inline decodes keep the loop's thread busy, a chain of callbacks on the loop (a
    request being parsed, a disconnect on its way to an abort) still moves many hops per step,
    not one."""
    ae = long_eng.engine
    if ae.device.type != "cpu" or ae.overlap:
        pytest.skip("inline decodes are the CPU's plain loop (overlap hands every forward to the thread)")
    steps: list[bool] = []
    ae.step_listeners.append(lambda batch, seconds: steps.append(batch.is_prefill))

    async def chain(hops: int) -> int:
        while not steps or steps[-1]:  # a decode step has run: the decodes are under way
            await asyncio.sleep(0)
        before = len(steps)
        for _ in range(hops):
            await asyncio.sleep(0)
        return len(steps) - before

    async def main() -> int:
        stream = await long_eng.engine.generate(PROMPT, {**LONG, "max_new_tokens": 400}, stream=True)
        hop_steps = asyncio.ensure_future(chain(40))
        async for _ in stream:
            if hop_steps.done():
                break  # leaving the stream aborts the request
        return await hop_steps

    try:
        elapsed = asyncio.run_coroutine_threadsafe(main(), long_eng._loop).result(60)
    finally:
        ae.step_listeners.pop()
    assert all(not p for p in steps[1:])  # the steps meanwhile were decodes (inline: one row)
    assert elapsed <= 4, f"40 loop rounds took {elapsed} decode steps"


# --------------------------------------------------------------------------- sampling controls


def test_seed_reproduces_and_different_seeds_differ(eng):
    sp = {"temperature": 1.0, "max_new_tokens": 12, "min_new_tokens": 12}
    a = eng.generate(PROMPT, {**sp, "seed": 1234})["output_ids"]
    b = eng.generate(PROMPT, {**sp, "seed": 1234})["output_ids"]
    c = eng.generate(PROMPT, {**sp, "seed": 4321})["output_ids"]
    assert a == b
    assert a != c
    # a seeded request is unaffected by what it is batched with
    batch = eng.generate([PROMPT, "other", "more words"], [{**sp, "seed": 1234}, {**sp, "seed": 5}, sp])
    assert batch[0]["output_ids"] == a
    assert eng.generate(PROMPT, {**sp, "sampling_seed": 1234})["output_ids"] == a


def test_stop_string_is_excluded_and_reported(eng):
    sp = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    full = eng.generate(PROMPT, sp)["text"]
    assert len(full) >= 10
    stop = full[6:8]
    cut = full.index(stop)
    out = eng.generate(PROMPT, {**sp, "stop": stop})
    assert out["text"] == full[:cut]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = eng.generate(PROMPT, {**sp, "stop": [stop], "no_stop_trim": True})
    assert kept["text"] == full[: cut + len(stop)]
    # a stop string that never appears changes nothing
    none = eng.generate(PROMPT, {**sp, "stop": ["\n\n\n"]})
    assert none["text"] == full and none["meta_info"]["finish_reason"]["type"] == "length"
    # streaming never shows the stop string, not even partly
    chunks = list(eng.generate(PROMPT, {**sp, "stop": stop}, stream=True))
    assert chunks[-1]["text"] == full[:cut]
    assert all(full[:cut].startswith(c["text"]) for c in chunks)


def test_stop_token_ids(eng):
    sp = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    ids = eng.generate(PROMPT, sp)["output_ids"]
    tok = ids[4]
    k = ids.index(tok)
    out = eng.generate(PROMPT, {**sp, "stop_token_ids": [tok]})
    assert out["output_ids"] == ids[: k + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok}
    assert out["text"] == eng.tokenizer.decode(ids[:k]), "the stop token's text is not emitted"
    # ... unless no_stop_trim (vLLM's include_stop_str_in_output) asks for it, as SGLang keeps it then
    kept = eng.generate(PROMPT, {**sp, "stop_token_ids": [tok], "no_stop_trim": True})
    assert kept["output_ids"] == ids[: k + 1] and kept["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok}
    assert kept["text"] == eng.tokenizer.decode(ids[: k + 1]) != out["text"]
    # min_new_tokens blocks the stop token, so generation goes past it
    blocked = eng.generate(PROMPT, {**sp, "stop_token_ids": [tok], "min_new_tokens": k + 2})
    assert blocked["meta_info"]["completion_tokens"] >= k + 2
    assert tok not in blocked["output_ids"][: k + 2]


def test_eos_from_the_model_config_ends_generation(tiny, engine_factory, tmp_path):
    """Make a token the model really generates its EOS (config.json and generation_config.json)."""
    path, _ = tiny
    p = [1, 40, 41, 42]
    plain = engine_factory(path, skip_tokenizer_init=True)
    ids = plain.generate(input_ids=p, sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})["output_ids"]
    eos = ids[2]
    k = ids.index(eos)
    dst = tmp_path / "eos"
    shutil.copytree(path, dst)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((dst / name).read_text())
        cfg["eos_token_id"] = eos
        (dst / name).write_text(json.dumps(cfg))
    eng = engine_factory(dst, skip_tokenizer_init=True)
    assert eng.engine.model_config.eos_ids == (eos,)
    out = eng.generate(input_ids=p, sampling_params={"temperature": 0, "max_new_tokens": 8})
    assert out["output_ids"] == ids[: k + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    out = eng.generate(input_ids=p, sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
    assert out["output_ids"] == ids and out["meta_info"]["finish_reason"]["type"] == "length"
    # min_new_tokens blocks the EOS until it is reached
    out = eng.generate(input_ids=p, sampling_params={"temperature": 0, "max_new_tokens": 8, "min_new_tokens": k + 2})
    assert eos not in out["output_ids"][: k + 2] and len(out["output_ids"]) >= k + 2
    assert_pool_free(eng)


def test_max_new_tokens_zero_returns_only_prompt_logprobs(eng):
    out = eng.generate(PROMPT, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
    assert out["output_ids"] == [] and out["text"] == ""
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert len(out["meta_info"]["input_token_logprobs"]) == len(PROMPT)


def test_min_new_tokens_and_ignore_eos(eng):
    out = eng.generate(PROMPT, {"temperature": 0, "max_new_tokens": 9, "min_new_tokens": 9})
    assert out["meta_info"]["completion_tokens"] == 9
    out = eng.generate(PROMPT, {"temperature": 0, "max_new_tokens": 9, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 9


def test_return_logprob_with_text_prompt(eng):
    out = eng.generate(PROMPT, greedy(3), return_logprob=True, top_logprobs_num=2)
    meta = out["meta_info"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(lp <= 0 for lp, _, _ in meta["output_token_logprobs"])
    assert [len(t) for t in meta["output_top_logprobs"]] == [2, 2, 2]
    # greedy: the chosen token is the top-1
    assert [t[0][1] for t in meta["output_top_logprobs"]] == out["output_ids"]


# --------------------------------------------------------------------------- aborts


def test_abort_running_request_from_its_stream(long_eng):
    eng, rid = long_eng, "abort-stream"
    chunks = []
    with finished_requests(eng) as done:
        for chunk in eng.generate(PROMPT, LONG, stream=True, rid=rid):
            chunks.append(chunk)
            if len(chunks) == 1:
                assert eng.engine.scheduler.running, "the request is running"
                assert eng.abort_request(rid) is True
    req = done[rid]
    assert req.finish_reason == {"type": "abort", "message": "request aborted"}
    assert 0 < len(req.output_ids) < 4000
    assert chunks[-1]["meta_info"]["finish_reason"] == req.finish_reason, "the stream ends with the aborted state"
    assert chunks[-1]["output_ids"] == req.output_ids and chunks[-1]["text"] == req.text
    assert eng.abort_request(rid) is False, "a finished request is gone"
    assert_pool_free(eng)


def test_abort_blocking_generate_from_another_thread(long_eng):
    eng, rid = long_eng, "abort-blocking"
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(out=eng.generate(PROMPT, LONG, rid=rid)), daemon=True)
    t.start()
    wait_until(lambda: any(r.rid == rid and r.output_ids for r in list(eng.engine.scheduler.running)) or not t.is_alive())
    assert eng.abort_request(rid)
    t.join(30)
    out = result["out"]
    assert out["meta_info"]["finish_reason"] == {"type": "abort", "message": "request aborted"}
    assert 0 < len(out["output_ids"]) < 4000
    assert_pool_free(eng)


def test_abort_by_request_id_covers_its_n_sequences(long_eng):
    eng, rid = long_eng, "multi"
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(out=eng.generate(PROMPT, {**LONG, "n": 2}, rid=rid)), daemon=True)
    t.start()
    wait_until(lambda: sum(r.rid.startswith("multi-") and bool(r.output_ids) for r in list(eng.engine.scheduler.running)) == 2
               or not t.is_alive())
    assert eng.abort_request(rid)
    t.join(30)
    outs = result["out"]
    assert [o["meta_info"]["id"] for o in outs] == ["multi-0", "multi-1"]
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
    assert_pool_free(eng)


def test_abandoned_stream_aborts_its_request(long_eng):
    eng = long_eng
    with finished_requests(eng) as done:
        it = eng.generate(PROMPT, LONG, stream=True, rid="abandoned")
        next(it)
        it.close()
        wait_until(lambda: "abandoned" in done and not eng.engine.scheduler.has_work)
    assert done["abandoned"].finish_reason["type"] == "abort"
    assert_pool_free(eng)

    async def main():  # the same for an async consumer that stops early
        agen = await eng.async_generate(PROMPT, LONG, stream=True, rid="abandoned-async")
        async for _ in agen:
            break
        await agen.aclose()

    with finished_requests(eng) as done:
        asyncio.run(main())
        wait_until(lambda: "abandoned-async" in done and not eng.engine.scheduler.has_work)
    assert done["abandoned-async"].finish_reason["type"] == "abort"
    assert_pool_free(eng)


def test_abort_queued_request(tiny, engine_factory):
    """With one running slot, the second prompt of a batch waits; aborting it (from the engine loop,
    once the first has decoded twice, so deterministically while queued) finishes it without running it."""
    path, hf = tiny
    eng = engine_factory(path, skip_tokenizer_init=True, max_running_requests=1)
    ae = eng.engine
    aborted = []

    def listener(batch, dt):
        if not aborted and any(r.rid == "q_1" for r in ae.scheduler.waiting) and len(batch.reqs[0].output_ids) >= 2:
            aborted.append(ae.abort("q_1"))

    ae.step_listeners.append(listener)
    try:
        a, b = eng.generate(input_ids=[[1, 5, 6], [1, 7]], sampling_params=greedy(10), rid="q")
    finally:
        ae.step_listeners.remove(listener)
    assert aborted == [True]
    assert b["meta_info"]["finish_reason"] == {"type": "abort", "message": "request aborted"} and b["output_ids"] == []
    assert a["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    assert_greedy_matches(hf, [1, 5, 6], a["output_ids"], 10)
    assert_pool_free(eng)


def test_load_queries_and_abort_all(tiny, engine_factory):
    """The queries the server asks instead of reading the scheduler: with one running slot and
    three prompts, one runs and two wait; abort_all (from the engine loop) aborts all three with
    its reason and counts them; afterwards the engine is idle and the pool free."""
    path, _ = tiny
    eng = engine_factory(path, skip_tokenizer_init=True, max_running_requests=1)
    ae = eng.engine
    seen: dict = {}

    def listener(batch, dt):
        if not seen and len(batch.reqs[0].output_ids) >= 2:
            seen.update(waiting=ae.num_waiting(), running=ae.num_running(), busy=ae.has_work(), load=ae.load(),
                        known=(ae.has_request("all_0"), ae.has_request("all_2"), ae.has_request("all"), ae.has_request("x")))
            seen["aborted"] = ae.abort_all("stopped by the test")
            seen["again"] = ae.abort_all()  # already aborted: not counted twice

    assert (ae.num_waiting(), ae.num_running(), ae.has_work()) == (0, 0, False)
    ae.step_listeners.append(listener)
    try:
        outs = eng.generate(input_ids=[[1, 5, 6], [1, 7], [1, 8, 9]], sampling_params=greedy(50), rid="all")
    finally:
        ae.step_listeners.remove(listener)
    assert (seen["waiting"], seen["running"], seen["busy"]) == (2, 1, True)
    assert seen["known"] == (True, True, True, False)  # "all" is the batch's group: an abort of it reaches all three
    load = seen["load"]
    assert (load["num_running_reqs"], load["num_waiting_reqs"], load["num_total_reqs"]) == (1, 2, 3)
    assert load["max_running_requests"] == ae.max_running_requests == 1
    assert load["max_total_num_tokens"] == ae.max_total_tokens
    assert load["num_used_tokens"] >= 3 + 2 and load["num_used_tokens"] + load["num_free_tokens"] == ae.max_total_tokens
    assert 0 < load["token_usage"] < 1
    assert (seen["aborted"], seen["again"]) == (3, 0)
    assert [o["meta_info"]["finish_reason"] for o in outs] == [{"type": "abort", "message": "stopped by the test"}] * 3
    wait_until(lambda: not ae.has_work())
    assert (ae.num_waiting(), ae.num_running(), ae.abort_all()) == (0, 0, 0)
    assert ae.load()["num_total_reqs"] == 0
    assert_pool_free(eng)


def test_random_stress_with_aborts_leaves_the_pool_free(tiny, engine_factory):
    """Many requests of random lengths through a small paged pool, a third abandoned or aborted
    mid-way; the survivors equal transformers' greedy output and every page comes back."""
    path, hf = tiny
    eng = engine_factory(path, skip_tokenizer_init=True, page_size=2, max_total_tokens=160, max_running_requests=6)
    rng = random.Random(1)
    specs = []
    for i in range(24):
        plen, n = rng.randint(1, 30), rng.randint(1, 12)
        specs.append(([1] + [rng.randrange(3, 256) for _ in range(plen - 1)], n, rng.choice(["keep", "keep", "break", "abort"])))

    async def main():
        async def one(i: int):
            p, n, mode = specs[i]
            await asyncio.sleep(rng.random() * 0.02)
            rid = f"stress-{i}"
            agen = await eng.async_generate(input_ids=p, sampling_params=greedy(n), stream=True, rid=rid)
            last = None
            async for chunk in agen:
                last = chunk
                if mode == "break" and len(chunk["output_ids"]) >= 1:
                    break
                if mode == "abort":
                    await asyncio.get_running_loop().run_in_executor(None, eng.abort_request, rid)
                    mode = "aborted"
            return last

        return await asyncio.gather(*(one(i) for i in range(len(specs))))

    with finished_requests(eng) as done:
        asyncio.run(main())
        wait_until(lambda: all(f"stress-{i}" in done for i in range(len(specs))) and not eng.engine.scheduler.has_work)
    assert_pool_free(eng)
    kept = 0
    for i, (p, n, mode) in enumerate(specs):
        req = done[f"stress-{i}"]
        if mode == "keep":
            assert req.finish_reason == {"type": "length", "length": n}
            assert_greedy_matches(hf, p, req.output_ids, n)
            kept += 1
        else:
            assert req.finish_reason["type"] in ("abort", "length")
            assert req.output_ids == hf_greedy(hf, p, n)[: len(req.output_ids)]
    assert kept >= 8
    # the engine still serves normally afterwards
    p = specs[0][0]
    assert_greedy_matches(hf, p, eng.generate(input_ids=p, sampling_params=greedy(4))["output_ids"], 4)
    assert_pool_free(eng)


# --------------------------------------------------------------------------- bad requests


@pytest.mark.parametrize("params,field", [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"n": 0}, "n"),
    ({"min_p": 1.5}, "min_p"),
    ({"top_k": -2}, "top_k"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_new_tokens": 5, "max_new_tokens": 2}, "min_new_tokens"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"temperature": "hot"}, "temperature"),
    ({"bogus_param": 1}, "bogus_param"),
])
def test_invalid_sampling_params_rejected_before_scheduling(eng, params, field):
    finished = []
    eng.engine.finish_listeners.append(finished.append)
    try:
        with pytest.raises(InvalidRequest) as e:
            eng.generate(PROMPT, params)
        assert e.value.param == field
        assert field in str(e.value)
        # in a batch, one bad entry rejects the whole call before anything runs
        with pytest.raises(InvalidRequest):
            eng.generate(["fine", "also fine"], [greedy(2), params])
        assert not eng.engine.scheduler.has_work and finished == []
    finally:
        eng.engine.finish_listeners.remove(finished.append)
    assert eng.generate(PROMPT, greedy(2))["meta_info"]["completion_tokens"] == 2


def test_invalid_async_request_raises_in_the_caller(eng):
    async def main():
        with pytest.raises(InvalidRequest) as e:
            await eng.async_generate(PROMPT, {"top_p": 2})
        return e.value.param

    assert asyncio.run(main()) == "top_p"


@pytest.mark.parametrize("ids", [[1, 2, 256], [1, -1], [1, 2**40], [], [1, "a"], [1, True]])
def test_bad_input_ids(eng, ids):
    with pytest.raises(InvalidRequest) as e:
        eng.generate(input_ids=ids, sampling_params=greedy(1))
    assert e.value.param in ("input_ids", "prompt")
    if ids and isinstance(ids[-1], int) and not isinstance(ids[-1], bool):
        assert str(ids[-1]) in str(e.value)


def test_bad_logprob_options(eng):
    with pytest.raises(InvalidRequest) as e:
        eng.generate(PROMPT, greedy(1), return_logprob=True, top_logprobs_num=21)
    assert e.value.param == "top_logprobs_num"
    with pytest.raises(InvalidRequest) as e:
        eng.generate(PROMPT, greedy(1), return_logprob=True, logprob_start_len=len(PROMPT))
    assert e.value.param == "logprob_start_len"


def test_prompt_longer_than_context(tiny, engine_factory):
    path, hf = tiny
    eng = engine_factory(path, skip_tokenizer_init=True, context_length=32)
    with pytest.raises(InvalidRequest) as e:
        eng.generate(input_ids=[1] + [9] * 39, sampling_params=greedy(1))
    assert e.value.param == "prompt" and "40" in str(e.value) and "32" in str(e.value)
    with pytest.raises(InvalidRequest):
        eng.generate(input_ids=[1] + [9] * 31, sampling_params=greedy(1))
    # a prompt that fits, without max_new_tokens, is cut at the context length instead of erroring
    # (an explicit max_new_tokens past it is an error, as SGLang's: tests/test_offline_api.py)
    p = [1] + [9] * 29
    out = eng.generate(input_ids=p, sampling_params={"temperature": 0, "ignore_eos": True})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    assert_greedy_matches(hf, p, out["output_ids"], 2)
    assert_pool_free(eng)


def test_request_larger_than_the_pool_is_rejected(tiny, engine_factory):
    path, _ = tiny
    eng = engine_factory(path, skip_tokenizer_init=True, max_total_tokens=32)
    with pytest.raises(InvalidRequest) as e:
        eng.generate(input_ids=[1] * 20, sampling_params={"max_new_tokens": 20})
    assert e.value.param == "max_new_tokens"
    assert eng.generate(input_ids=[1] * 20, sampling_params=greedy(12))["meta_info"]["completion_tokens"] == 12
    assert_pool_free(eng)


def test_text_prompt_without_tokenizer(tiny, engine_factory):
    path, _ = tiny
    eng = engine_factory(path, skip_tokenizer_init=True)
    with pytest.raises(InvalidRequest) as e:
        eng.generate("hello", greedy(1))
    assert e.value.param == "text"
    out = eng.generate(input_ids=[1, 2, 3], sampling_params=greedy(2))
    assert out["text"] == "" and len(out["output_ids"]) == 2


# --------------------------------------------------------------------------- bad models / lifecycle


def test_unknown_architecture(tiny, tmp_path):
    src, _ = tiny
    dst = tmp_path / "foo"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as e:
        make_engine(dst)
    assert "FooForCausalLM" in str(e.value) and "LlamaForCausalLM" in str(e.value)


def test_missing_model_path_and_hub_id(tmp_path, monkeypatch):
    with pytest.raises(ModelLoadError) as e:
        make_engine(tmp_path / "nope")
    assert "does not exist" in str(e.value) and "nope" in str(e.value)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # an empty cache, and no download
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as e:
        make_engine("HuggingFaceTB/SmolLM2-135M-Instruct")
    msg = str(e.value)
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in msg and "not in the local Hugging Face cache" in msg


def test_folder_without_weights_or_config(tmp_path, tiny):
    with pytest.raises(ModelLoadError, match="no config.json"):
        make_engine(tmp_path)
    src, _ = tiny
    dst = tmp_path / "noweights"
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors or \\*.bin"):
        make_engine(dst, skip_tokenizer_init=True)


def test_unknown_engine_argument(tiny):
    path, _ = tiny
    with pytest.raises(CoreError, match="bogus"):
        make_engine(path, bogus=1)
    with pytest.raises(CoreError, match="pp_size"):  # SGLang options without the feature are refused by name
        make_engine(path, pp_size=2)


def test_shutdown_twice_is_safe_and_context_manager(tiny):
    path, _ = tiny
    e = make_engine(path, skip_tokenizer_init=True)
    assert e.generate(input_ids=[1, 2], sampling_params=greedy(2))["meta_info"]["completion_tokens"] == 2
    e.shutdown()
    e.shutdown()
    with make_engine(path, skip_tokenizer_init=True) as e2:
        assert len(e2.generate(input_ids=[1, 2], sampling_params=greedy(1))["output_ids"]) == 1
    e2.shutdown()


def test_shutdown_finishes_in_flight_requests(tiny_llama):
    """Regression: shutdown stopped the loop before a blocked generate() could see its abort.
    Both the running and the still-queued request of the call end as aborted."""
    path, _ = tiny_llama("gqa", max_position_embeddings=4096)
    e = make_engine(path, skip_tokenizer_init=True, max_running_requests=1, max_total_tokens=8192)
    result: dict = {}
    # daemon: should shutdown ever leave it blocked again, it must not keep pytest from exiting
    t = threading.Thread(target=lambda: result.update(out=e.generate(input_ids=[[1, 2, 3], [1, 9]], sampling_params=LONG)),
                         daemon=True)
    t.start()
    wait_until(lambda: any(r.output_ids for r in list(e.engine.scheduler.running)) or not t.is_alive())
    assert len(e.engine.scheduler.waiting) == 1
    e.shutdown()
    assert_pool_free(e)
    t.join(10)
    assert not t.is_alive(), "generate() still blocked after shutdown"
    running, queued = result["out"]
    assert running["meta_info"]["finish_reason"] == {"type": "abort", "message": "engine shut down"}
    assert queued["meta_info"]["finish_reason"] == {"type": "abort", "message": "engine shut down"}
    assert running["output_ids"] and queued["output_ids"] == []
