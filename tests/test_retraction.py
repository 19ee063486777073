"""KV pressure: admission estimates, retraction when decode runs out of pages, and resumption
with the generated tokens kept, so no request fails or changes its output because of memory."""

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
from tests.conftest import assert_pool_free, finished_requests, greedy


def _sched(num_pages: int, cache: bool = True, **kw) -> Scheduler:
    alloc = PageAllocator(num_pages, 1)
    table = ReqToTokenTable(8, 64 + 1, torch.device("cpu"))
    return Scheduler(alloc, table, max_running_requests=8, max_prefill_tokens=1000, context_len=64, eos_ids=(2,),
                     tree_cache=RadixCache(1) if cache else None, **kw)


def _run(s: Scheduler, tok: int = 7, limit: int = 1000) -> int:
    steps = 0
    while s.has_work:
        batch, _ = s.schedule()
        if batch is not None:
            s.process(batch, StepResult(SampleOutput([tok] * len(batch.reqs), None, None)))
        s.check_accounting()
        steps += 1
        assert steps < limit
    return steps


@pytest.mark.parametrize("cache", [True, False])
def test_decode_out_of_pages_retracts_the_most_recent_and_resumes(cache):
    s = _sched(26, cache=cache)  # 25 usable pages: room for one request (18 tokens) and a half
    a = Req("a", list(range(10, 16)), SamplingParams(max_new_tokens=12))
    b = Req("b", list(range(20, 26)), SamplingParams(max_new_tokens=12))
    s.add(a)
    s.add(b)
    batch, _ = s.schedule()
    assert batch.reqs == [a]  # the estimate keeps b out at first ...
    s.process(batch, StepResult(SampleOutput([7], None, None)))
    s.new_token_ratio = 0.0  # ... pretend the estimate became optimistic: b gets in
    batch, _ = s.schedule()
    assert batch.reqs == [b]
    s.process(batch, StepResult(SampleOutput([7], None, None)))
    retracted_at = None
    for step in range(30):
        batch, _ = s.schedule()
        s.process(batch, StepResult(SampleOutput([7] * len(batch.reqs), None, None)))
        if b in s.waiting:
            assert batch.reqs == [a]
            retracted_at = step
            break
    assert retracted_at is not None and s.num_retracted == 1 and b.num_retractions == 1
    assert list(s.waiting) == [b] and b.row == -1 and b.pages == [] and b.kv_len == 0
    kept = list(b.output_ids)
    assert kept and b.seq_len == 6 + len(kept)  # generated tokens are kept
    assert s.new_token_ratio > 0.5  # the estimate turned conservative
    s.check_accounting()
    _run(s)
    for r in (a, b):
        assert r.finish_reason == {"type": "length", "length": 12} and r.output_ids == [7] * 12
    assert b.output_ids[: len(kept)] == kept


def test_resume_reprefills_prompt_and_output_minus_the_cached_prefix():
    s = _sched(65)
    r = Req("r", list(range(10, 20)), SamplingParams(max_new_tokens=8))
    s.add(r)
    for _ in range(4):
        batch, _ = s.schedule()
        s.process(batch, StepResult(SampleOutput([7], None, None)))
    assert r.output_ids == [7] * 4 and r.kv_len == 13
    s._retract(r)
    s.waiting.appendleft(r)
    s.check_accounting()
    batch, _ = s.schedule()
    # 13 tokens were cached on retraction; the last generated token is recomputed for its logits
    assert batch.is_prefill and batch.extend_lens == [1] and batch.positions == [13]
    assert batch.input_ids == [7]
    s.process(batch, StepResult(SampleOutput([8], None, None)))
    assert r.output_ids == [7] * 4 + [8]
    _run(s)
    assert len(r.output_ids) == 8


def test_tiny_pool_completes_many_long_requests_through_retraction(tiny_llama, engine_factory):
    """A 512-token pool and 20 concurrent requests of up to ~200 tokens each: all finish, outputs
    equal an unconstrained run, and requests were retracted along the way."""
    path, _ = tiny_llama()
    rng = random.Random(3)
    system = [rng.randrange(3, 256) for _ in range(20)]
    prompts = [(system if i % 2 else []) + [rng.randrange(3, 256) for _ in range(rng.randrange(20, 60))] for i in range(20)]
    params = [greedy(rng.randrange(60, 120)) for _ in prompts]
    big = engine_factory(path, max_total_tokens=8192, disable_radix_cache=True)
    ref = [o["output_ids"] for o in big.generate(input_ids=prompts, sampling_params=params)]
    for kwargs in ({}, {"disable_radix_cache": True}, {"page_size": 4, "chunked_prefill_size": 32}):
        eng = engine_factory(path, max_total_tokens=512, **kwargs)
        with finished_requests(eng) as done:
            outs = eng.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in outs] == ref, kwargs
        assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
        assert len(done) == 20
        assert eng.engine.scheduler.num_retracted > 0, kwargs
        assert_pool_free(eng)


def test_max_running_requests_caps_the_batch(tiny_llama, engine_factory):
    path, _ = tiny_llama()
    eng = engine_factory(path, max_running_requests=3)
    sizes = []
    eng.engine.step_listeners.append(lambda batch, dt: sizes.append(len(batch.reqs)))
    outs = eng.generate(input_ids=[[5 + i, 6, 7] for i in range(8)], sampling_params=greedy(4))
    assert len(outs) == 8 and max(sizes) == 3
    assert_pool_free(eng)


@pytest.mark.parametrize("policy", ["length", "priority"])
def test_retraction_policy_picks_the_victim(policy):
    """``--retraction-policy`` (SGLang's orders): ``length`` retracts the request with the fewest
    output tokens (then the longest prompt); ``priority`` the least important first (one without a
    priority least of all; here higher values first), then as ``length``. Either way the others
    finish unchanged and the victim resumes."""
    s = _sched(40, cache=False, retraction_policy=policy, enable_priority_scheduling=True)
    low = Req("low", list(range(10, 14)), SamplingParams(max_new_tokens=12), priority=1)
    high = Req("high", list(range(20, 24)), SamplingParams(max_new_tokens=12), priority=5)
    long = Req("long", list(range(30, 38)), SamplingParams(max_new_tokens=12), priority=9)
    for r in (low, high):
        s.add(r)
    batch, _ = s.schedule()
    s.process(batch, StepResult(SampleOutput([7] * len(batch.reqs), None, None)))
    s.add(long)  # admitted last, with a longer prompt: the fewest output tokens from here on
    s.new_token_ratio = 0.0  # (an optimistic estimate: all three get in, then decode runs out of pages)
    victim = None
    for _ in range(40):
        batch, _ = s.schedule()
        s.process(batch, StepResult(SampleOutput([7] * len(batch.reqs), None, None)))
        if s.waiting:
            victim = s.waiting[0]
            break
    assert victim is (long if policy == "length" else low), victim.rid
    _run(s)
    for r in (low, high, long):
        assert r.output_ids == [7] * 12


def test_retraction_policy_reaches_the_scheduler(tiny_llama) -> None:
    from core.errors import CoreError

    from tests.conftest import make_engine

    eng = make_engine(tiny_llama()[0], retraction_policy="priority")
    try:
        assert eng.engine.scheduler.policy.retraction == "priority"
    finally:
        eng.shutdown()
    with pytest.raises(CoreError, match="--retraction-policy 'oldest' is not one of length, priority"):
        make_engine(tiny_llama()[0], retraction_policy="oldest")
