"""Chunked prefill: long prompts are prefilled in chunks between decode steps of running requests,
with outputs equal to unchunked prefill."""

from __future__ import annotations

import random

import pytest
import torch

from core.engine.mem_cache.kv_cache import PageAllocator, ReqToTokenTable
from core.engine.mem_cache.radix_cache import RadixCache
from core.engine.request import Req
from core.engine.sampler import SampleOutput
from core.engine.sampling_params import SamplingParams
from core.engine.scheduler import Scheduler, StepResult
from tests.conftest import assert_pool_free, greedy


def _sched(chunk: int | None, mixed: bool = False, page_size: int = 1) -> Scheduler:
    alloc = PageAllocator(400 // page_size + 1, page_size)
    table = ReqToTokenTable(8, 256 + page_size, torch.device("cpu"))
    return Scheduler(alloc, table, max_running_requests=8, max_prefill_tokens=1000, context_len=256, eos_ids=(2,),
                     tree_cache=RadixCache(page_size), chunked_prefill_size=chunk, enable_mixed_chunk=mixed)


def _step(s: Scheduler):
    batch, _ = s.schedule()
    s.process(batch, StepResult(SampleOutput([7] * len(batch.reqs), None, None)))
    s.check_accounting()
    return batch


def test_long_prompt_chunks_alternate_with_decode_steps():
    s = _sched(chunk=16)
    short = Req("short", [5, 6, 7], SamplingParams(max_new_tokens=20))
    s.add(short)
    _step(s)  # short prefilled, now decoding
    long = Req("long", list(range(10, 60)), SamplingParams(max_new_tokens=2))  # 50 tokens: 4 chunks
    s.add(long)
    kinds = []
    while not long.output_ids:
        b = _step(s)
        kinds.append([(r.rid, n) for r, n in zip(b.reqs, b.extend_lens)])
    assert kinds == [[("long", 16)], [("short", 1)], [("long", 16)], [("short", 1)], [("long", 16)], [("short", 1)],
                     [("long", 2)]]
    assert short.output_ids and len(short.output_ids) == 1 + 3  # the stream kept moving
    assert long.cached_tokens == 0 and s.chunked_req is None


def test_mixed_chunk_runs_chunk_and_decodes_in_one_forward():
    s = _sched(chunk=16, mixed=True)
    short = Req("short", [5, 6, 7], SamplingParams(max_new_tokens=20))
    s.add(short)
    _step(s)
    long = Req("long", list(range(10, 50)), SamplingParams(max_new_tokens=2))
    s.add(long)
    b = _step(s)
    assert [(r.rid, n) for r, n in zip(b.reqs, b.extend_lens)] == [("long", 16), ("short", 1)] and b.is_prefill
    assert len(short.output_ids) == 2 and not long.output_ids


def test_a_prompts_one_token_last_chunk_runs_once_in_a_mixed_batch():
    """A last chunk of exactly one token looks like a decode (one token left to compute): it was
    also taken as one, so the mixed batch held the request twice and ran its token twice."""
    s = _sched(chunk=8, mixed=True)
    short = Req("short", [5, 6, 7], SamplingParams(max_new_tokens=20))
    s.add(short)
    _step(s)
    long = Req("long", list(range(10, 27)), SamplingParams(max_new_tokens=2))  # 17 tokens: 8, 8, then 1
    s.add(long)
    batches = [_step(s) for _ in range(3)]
    assert [[(r.rid, n) for r, n in zip(b.reqs, b.extend_lens)] for b in batches] == [
        [("long", 8), ("short", 1)], [("long", 8), ("short", 1)], [("long", 1), ("short", 1)]]
    assert len(long.output_ids) == 1 and long.kv_len == 17


def test_chunks_respect_page_boundaries():
    s = _sched(chunk=10, page_size=4)
    r = Req("r", list(range(10, 40)), SamplingParams(max_new_tokens=1))
    s.add(r)
    lens = []
    while s.has_work:
        lens.append(_step(s).extend_lens[0])
    assert lens == [8, 8, 8, 6]


@pytest.fixture(scope="module")
def path(tiny_llama):
    return tiny_llama()[0]


@pytest.mark.parametrize("kwargs", [
    {"chunked_prefill_size": 16},
    {"chunked_prefill_size": 24, "page_size": 4},
    {"chunked_prefill_size": 16, "enable_mixed_chunk": True},
    {"chunked_prefill_size": 7, "disable_radix_cache": True},
])
def test_chunked_outputs_equal_unchunked(path, engine_factory, kwargs):
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (150, 5, 90, 33, 200)]
    params = [greedy(n) for n in (10, 30, 10, 20, 8)]
    ref_eng = engine_factory(path, chunked_prefill_size=-1, disable_radix_cache=True)
    assert ref_eng.engine.scheduler.chunked_prefill_size is None
    ref = [o["output_ids"] for o in ref_eng.generate(input_ids=prompts, sampling_params=params)]
    eng = engine_factory(path, **kwargs)
    outs = eng.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == ref
    # the same prompts again, one by one, while the cache (if any) is warm
    assert [eng.generate(input_ids=p, sampling_params=sp)["output_ids"] for p, sp in zip(prompts, params)] == ref
    assert_pool_free(eng)


def test_prompt_logprobs_are_never_chunked(path, engine_factory):
    prompt = list(range(10, 80))
    ref = engine_factory(path, chunked_prefill_size=-1).generate(
        input_ids=prompt, sampling_params=greedy(3), return_logprob=True, logprob_start_len=0)
    eng = engine_factory(path, chunked_prefill_size=8)
    for _ in range(2):  # the second time the prompt is cached, but prompt logprobs need it all
        out = eng.generate(input_ids=prompt, sampling_params=greedy(3), return_logprob=True, logprob_start_len=0)
        assert out["output_ids"] == ref["output_ids"]
        got = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"]]
        want = [lp for lp, _, _ in ref["meta_info"]["input_token_logprobs"]]
        assert got[0] is None and len(got) == len(prompt)
        assert got[1:] == pytest.approx(want[1:], abs=1e-4)
    assert_pool_free(eng)


def test_default_chunk_size_per_device(path, engine_factory, device):
    """SGLang's 8192 on a GPU; 2048 on a CPU, where a long prefill chunk stalls every decode."""
    eng = engine_factory(path)
    assert eng.engine.scheduler.chunked_prefill_size == (2048 if device == "cpu" else 8192)
