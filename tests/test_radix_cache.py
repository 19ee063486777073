"""Radix prefix cache: the tree on its own, the scheduler's page accounting under random load with
aborts, and greedy outputs with the cache on equal to outputs with it off on shared-prefix workloads."""

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

# --------------------------------------------------------------------------- the tree


def test_match_insert_and_split():
    t = RadixCache()
    assert t.match_prefix([1, 2, 3]) == ([], t.root)
    assert t.insert([1, 2, 3, 4], [11, 12, 13, 14]) == 0
    assert t.insert([1, 2, 3, 4], [21, 22, 23, 24]) == 4  # all duplicates
    pages, node = t.match_prefix([1, 2, 9])
    assert pages == [11, 12] and node.key == [1, 2]  # split at the divergence
    assert t.insert([1, 2, 5], [11, 12, 35]) == 2
    assert t.match_prefix([1, 2, 5, 6])[0] == [11, 12, 35]
    assert t.match_prefix([1, 2, 3, 4, 5])[0] == [11, 12, 13, 14]
    assert t.total_pages == 5 and t.evictable_pages == 5
    t.check()


def test_page_size_matches_whole_pages_only():
    t = RadixCache(page_size=2)
    assert t.insert([1, 2, 3, 4, 5, 6], [7, 8, 9]) == 0
    assert t.match_prefix([1, 2, 3, 4, 5])[0] == [7, 8]  # the odd token is not a whole page
    assert t.match_prefix([1, 2, 3, 9, 5, 6])[0] == [7]  # diverges inside page 2
    assert t.insert([1, 2, 3, 9], [7, 20]) == 2
    assert t.match_prefix([1, 2, 3, 9])[0] == [7, 20]
    with pytest.raises(AssertionError):
        t.insert([1, 2, 3], [7, 8])  # not page-aligned
    t.check()


def test_locks_protect_from_eviction_and_lru_order():
    t = RadixCache()
    t.insert([1, 2, 3], [1, 2, 3])
    t.insert([5, 6], [5, 6])
    t.insert([1, 2, 9], [1, 2, 9])  # splits [1,2] | [3], [9]
    _, locked = t.match_prefix([1, 2, 3])
    t.inc_lock_ref(locked)
    assert t.protected_pages == 3 and t.evictable_pages == 3
    t.match_prefix([5, 6])  # most recently used
    freed = t.evict(1)
    assert freed == [9]  # [1,2,3] is locked, [5,6] is newer
    assert t.evict(10) == [5, 6]  # the locked path survives everything
    assert t.match_prefix([1, 2, 3])[0] == [1, 2, 3]
    t.dec_lock_ref(locked)
    assert t.protected_pages == 0 and sorted(t.evict(10)) == [1, 2, 3]
    assert t.total_pages == 0
    t.check()


def test_lfu_evicts_least_frequently_used_first():
    t = RadixCache(eviction_policy="lfu")
    t.insert([1], [1])
    t.insert([2], [2])
    for _ in range(3):
        t.match_prefix([1])
    t.match_prefix([2])  # more recent, but used less often
    assert t.evict(1) == [2]
    with pytest.raises(ValueError):
        RadixCache(eviction_policy="fifo")


def test_reset_returns_pages_and_is_refused_while_locked():
    t = RadixCache()
    t.insert([1, 2], [4, 5])
    _, n = t.match_prefix([1, 2])
    t.inc_lock_ref(n)
    with pytest.raises(RuntimeError):
        t.reset()
    t.dec_lock_ref(n)
    assert sorted(t.reset()) == [4, 5] and t.total_pages == 0


# --------------------------------------------------------------------------- scheduler accounting


def _sched(num_pages: int, page_size: int, max_running: int = 8, chunk: int | None = None) -> Scheduler:
    alloc = PageAllocator(num_pages, page_size)
    table = ReqToTokenTable(max_running, 128 + page_size, torch.device("cpu"))
    return Scheduler(alloc, table, max_running_requests=max_running, max_prefill_tokens=64, context_len=128, eos_ids=(2,),
                     tree_cache=RadixCache(page_size), chunked_prefill_size=chunk)


@pytest.mark.parametrize("page_size,chunk", [(1, None), (4, 16), (3, 8)])
def test_random_stress_never_leaks_pages(page_size, chunk):
    """free + cached + in use == total after every step, with shared prefixes, aborts, retractions."""
    rng = random.Random(page_size)
    s = _sched(num_pages=96 // page_size + 1, page_size=page_size, chunk=chunk)
    prefixes = [[rng.randrange(3, 200) for _ in range(rng.randrange(4, 30))] for _ in range(4)]
    reqs, steps = [], 0
    for i in range(60):
        if rng.random() < 0.6:
            p = rng.choice(prefixes) + [rng.randrange(3, 200) for _ in range(rng.randrange(1, 12))]
            r = Req(f"r{i}", p, SamplingParams(max_new_tokens=rng.randrange(1, 20), ignore_eos=True))
            reqs.append(r)
            s.add(r)
        if rng.random() < 0.1 and reqs:
            s.abort(rng.choice(reqs).rid)
        batch, _ = s.schedule()
        if batch is not None:
            toks = [rng.randrange(3, 200) for _ in batch.reqs]
            s.process(batch, StepResult(SampleOutput(toks, None, None)))
        s.check_accounting()
        steps += 1
    while s.has_work:
        batch, _ = s.schedule()
        if batch is not None:
            s.process(batch, StepResult(SampleOutput([rng.randrange(3, 200) for _ in batch.reqs], None, None)))
        s.check_accounting()
        steps += 1
        assert steps < 3000
    for r in reqs:
        assert r.finished
        if r.finish_reason["type"] == "length":
            assert len(r.output_ids) == r.params.max_new_tokens
    assert s.tree_cache.protected_pages == 0
    assert s.allocator.num_free + s.tree_cache.total_pages == s.allocator.capacity
    assert s.tree_cache.hit_tokens > 0


def test_a_full_cache_under_decode_evicts_ahead_not_every_step():
    """Each eviction walks the whole tree, so a full cache under decode evicts room for
    EVICT_AHEAD steps at once (at most 1/EVICT_AHEAD_POOL_FRACTION of the pool), not one step's."""
    from core.engine.scheduler import EVICT_AHEAD, EVICT_AHEAD_POOL_FRACTION

    s = _sched(num_pages=1025, page_size=1, max_running=4)
    for i in range(32):  # fill the cache: 32 finished sequences of 30 tokens
        s.add(Req(f"old{i}", [100 + i] + [3 + (i * 7 + j) % 90 for j in range(25)], SamplingParams(max_new_tokens=4, ignore_eos=True)))
        while s.has_work:
            batch, _ = s.schedule()
            s.process(batch, StepResult(SampleOutput([5] * len(batch.reqs), None, None)))
    assert s.allocator.num_free < 4 * 40 and s.tree_cache.evictable_pages > 900
    asked: list[int] = []
    evict = s.tree_cache.evict
    s.tree_cache.evict = lambda n: asked.append(n) or evict(n)
    reqs = [Req(f"new{i}", [200 + i] * 8, SamplingParams(max_new_tokens=60, ignore_eos=True)) for i in range(4)]
    for r in reqs:
        s.add(r)
    decodes = 0
    while s.has_work:
        batch, _ = s.schedule()
        decodes += not batch.is_prefill
        s.process(batch, StepResult(SampleOutput([5] * len(batch.reqs), None, None)))
        s.check_accounting()
    assert all(len(r.output_ids) == 60 for r in reqs)
    ahead = min(4 * EVICT_AHEAD, 1025 // EVICT_AHEAD_POOL_FRACTION)  # a decode step of 4 needs 4 pages
    assert decodes > 50 and 1 <= len(asked) <= decodes * 4 // ahead + 2
    assert all(n >= min(ahead, 4) for n in asked)


def test_cached_prefix_is_not_recomputed():
    s = _sched(num_pages=65, page_size=1)
    a = Req("a", list(range(10, 30)), SamplingParams(max_new_tokens=2))
    s.add(a)
    while s.has_work:
        batch, _ = s.schedule()
        s.process(batch, StepResult(SampleOutput([7] * len(batch.reqs), None, None)))
    b = Req("b", list(range(10, 30)) + [5, 6], SamplingParams(max_new_tokens=1))
    s.add(b)
    batch, _ = s.schedule()
    assert batch.extend_lens == [2] and batch.positions == [20, 21] and b.cached_tokens == 20
    # the cached slots (the ones a wrote) are recorded in b's table row along with its new tokens'
    entries = {p: slot for r, p, slot in zip(*batch.table_writes) if r == b.row}
    assert entries == {**{p: p + 1 for p in range(20)}, 20: batch.out_cache_loc[0], 21: batch.out_cache_loc[1]}


# --------------------------------------------------------------------------- engine: cache on == cache off


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 256) for _ in range(n)]


def _workloads() -> dict[str, list[list[int]]]:
    rng = random.Random(0)
    system = _ids(rng, 60)
    base = _ids(rng, 40)
    return {
        "system_prompt": [system + _ids(rng, rng.randrange(3, 20)) for _ in range(6)],
        "identical": [base] * 4,
        "prefix_of_another": [base[:25], base, base + _ids(rng, 10)],
    }


@pytest.fixture(scope="module")
def engines(tiny_llama, engine_factory):
    path, _ = tiny_llama()
    on = engine_factory(path, max_total_tokens=2048)
    off = engine_factory(path, max_total_tokens=2048, disable_radix_cache=True)
    paged = engine_factory(path, max_total_tokens=2048, page_size=4)
    return on, off, paged


@pytest.mark.parametrize("workload", list(_workloads()))
def test_cache_on_equals_cache_off(engines, workload):
    on, off, paged = engines
    prompts = _workloads()[workload]
    ref = [o["output_ids"] for o in off.generate(input_ids=prompts, sampling_params=greedy(8))]
    for eng in (on, paged):
        eng.engine.flush_cache()
        # one at a time (later ones hit what earlier ones cached), then all at once (hits on a warm cache)
        seq = [eng.generate(input_ids=p, sampling_params=greedy(8)) for p in prompts]
        assert [o["output_ids"] for o in seq] == ref
        assert any(o["meta_info"]["cached_tokens"] > 0 for o in seq[1:])
        batch = eng.generate(input_ids=prompts, sampling_params=greedy(8))
        assert [o["output_ids"] for o in batch] == ref
        assert all(o["meta_info"]["cached_tokens"] > 0 for o in batch)
        assert_pool_free(eng)
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in off.generate(input_ids=prompts, sampling_params=greedy(2)))


def test_multi_turn_chat_reuses_the_conversation(engines):
    on, off, paged = engines
    rng = random.Random(1)
    for eng in (on, off, paged):
        eng.engine.flush_cache()
    convo = {e: _ids(random.Random(1), 30) for e in (on, off, paged)}
    for turn in range(3):
        user = _ids(rng, 8)
        outs = {}
        for eng in (on, off, paged):
            convo[eng] += user
            out = eng.generate(input_ids=convo[eng], sampling_params=greedy(6))
            outs[eng] = out
            convo[eng] += out["output_ids"]
        assert outs[on]["output_ids"] == outs[off]["output_ids"] == outs[paged]["output_ids"]
        if turn:
            prompt_len = outs[on]["meta_info"]["prompt_tokens"]
            # all but the new user message and the last reply token (never written to the cache) was cached
            assert outs[on]["meta_info"]["cached_tokens"] >= prompt_len - len(user) - 1
            assert outs[paged]["meta_info"]["cached_tokens"] >= prompt_len - len(user) - 1 - 4
    assert_pool_free(on)


def test_flush_cache_empties_the_tree_and_is_refused_while_running(engines):
    on = engines[0]
    ae = on.engine
    on.generate(input_ids=list(range(10, 50)), sampling_params=greedy(2))
    assert ae.tree_cache.total_pages > 0
    ae.scheduler.waiting.append(Req("fake", [5, 6], SamplingParams()))
    try:
        assert not ae.flush_cache() and ae.tree_cache.total_pages > 0
    finally:
        ae.scheduler.waiting.clear()
    assert ae.flush_cache()
    assert ae.tree_cache.total_pages == 0 and ae.allocator.num_free == ae.allocator.capacity
    assert_pool_free(on)
