"""Scheduler bookkeeping driven by hand: admission, batch shapes, finishing, aborts (no model)."""

from __future__ import annotations

import pytest
import torch

from core.engine.mem_cache.kv_cache import PageAllocator, ReqToTokenTable
from core.engine.request import Req
from core.engine.sampler import SampleOutput
from core.engine.sampling_params import SamplingParams
from core.engine.scheduler import Scheduler, StepResult

EOS = 2


def make(num_pages: int = 65, page_size: int = 1, max_running: int = 4, max_prefill: int = 1000, ctx: int = 64) -> Scheduler:
    alloc = PageAllocator(num_pages, page_size)
    table = ReqToTokenTable(max_running, ctx + page_size, torch.device("cpu"))
    return Scheduler(alloc, table, max_running_requests=max_running, max_prefill_tokens=max_prefill, context_len=ctx, eos_ids=(EOS,))


def req(rid: str, prompt_len: int, max_new: int = 4, **params) -> Req:
    return Req(rid, [10 + i for i in range(prompt_len)], SamplingParams(max_new_tokens=max_new, **params))


def step(s: Scheduler, tokens: dict[str, int] | int = 7):
    """Schedule one batch and feed it ``tokens`` (one per request; an int for all)."""
    batch, aborted = s.schedule()
    assert batch is not None
    toks = [tokens if isinstance(tokens, int) else tokens[r.rid] for r in batch.reqs]
    s.process(batch, StepResult(SampleOutput(toks, None, None)))
    return batch, aborted


def table_entries(batch, row: int) -> dict[int, int]:
    """Position -> slot entries the batch asks the runner to record in table row ``row``."""
    return {p: slot for r, p, slot in zip(*batch.table_writes) if r == row}


def assert_all_free(s: Scheduler) -> None:
    assert not s.running and not s.waiting
    assert s.allocator.num_free == s.allocator.capacity
    assert s.table.num_free == s.table.table.shape[0]


def test_idle_schedule_is_empty():
    s = make()
    assert s.schedule() == (None, [])
    assert not s.has_work


def test_admission_respects_max_running_requests():
    s = make(max_running=2)
    reqs = [req(f"r{i}", 3) for i in range(5)]
    for r in reqs:
        s.add(r)
    batch, _ = s.schedule()
    assert batch.is_prefill and [r.rid for r in batch.reqs] == ["r0", "r1"]
    assert [r.rid for r in s.waiting] == ["r2", "r3", "r4"]
    s.process(batch, StepResult(SampleOutput([7, 7], None, None)))
    batch, _ = s.schedule()  # full: the running two decode, nobody is admitted
    assert not batch.is_prefill and [r.rid for r in batch.reqs] == ["r0", "r1"]


def test_admission_estimates_future_pages_and_waits_for_them():
    s = make(num_pages=11)  # 10 usable pages of 1 token
    a, b = req("a", 4, max_new=3), req("b", 4, max_new=3)  # up to 7 pages each
    s.add(a)
    s.add(b)
    batch, _ = s.schedule()
    assert batch.reqs == [a] and list(s.waiting) == [b]
    assert len(a.pages) == 4  # pages are taken as tokens land, nothing is reserved
    # a decodes to completion; b is not admitted while a's estimated future tokens leave too little room
    s.process(batch, StepResult(SampleOutput([7], None, None)))
    for _ in range(2):
        batch, _ = step(s)
        assert batch.reqs == [a]
    assert a.finished and a.finish_reason == {"type": "length", "length": 3}
    assert a.pages == [] and a.row == -1 and s.allocator.num_free == 10
    batch, _ = s.schedule()  # pages are back: b is admitted now
    assert batch.is_prefill and batch.reqs == [b]


def test_queue_is_fifo_even_when_a_later_request_would_fit():
    s = make(num_pages=11)
    big, small = req("big", 6, max_new=4), req("small", 1, max_new=1)
    s.add(req("first", 5, max_new=2))  # 7 pages
    s.add(big)  # 10 pages: cannot fit now
    s.add(small)  # 2 pages: would fit, but stays behind big
    batch, _ = s.schedule()
    assert [r.rid for r in batch.reqs] == ["first"]
    assert list(s.waiting) == [big, small]


def test_max_prefill_tokens_splits_prefill_but_admits_one_oversized_prompt():
    s = make(max_prefill=25)
    for i in range(3):
        s.add(req(f"r{i}", 10))
    batch, _ = s.schedule()
    assert [r.rid for r in batch.reqs] == ["r0", "r1"] and batch.extend_lens == [10, 10]
    s = make(max_prefill=5)
    s.add(req("long", 12))
    batch, _ = s.schedule()
    assert [r.rid for r in batch.reqs] == ["long"], "a lone prompt longer than max_prefill_tokens still runs"


def test_prefill_runs_before_decode_and_new_requests_join_between_decodes():
    s = make()
    a = req("a", 3, max_new=5)
    s.add(a)
    batch, _ = step(s)
    assert batch.is_prefill
    batch, _ = step(s)
    assert not batch.is_prefill and batch.reqs == [a]
    b = req("b", 6, max_new=5)
    s.add(b)
    batch, _ = step(s)
    assert batch.is_prefill and batch.reqs == [b], "the new prompt is prefilled before a decodes again"
    batch, _ = step(s)
    assert not batch.is_prefill and batch.reqs == [a, b] and batch.extend_lens == [1, 1]
    assert a.output_ids == [7, 7, 7] and b.output_ids == [7, 7]


def test_batch_positions_slots_and_table_with_pages():
    s = make(num_pages=9, page_size=4)
    a, b = req("a", 6, max_new=3), req("b", 2, max_new=2)
    s.add(a)
    s.add(b)
    batch, _ = s.schedule()
    assert batch.input_ids == a.prompt_ids + b.prompt_ids
    assert batch.positions == [0, 1, 2, 3, 4, 5, 0, 1]
    assert a.pages == [1, 2] and b.pages == [3]
    assert batch.out_cache_loc == [4, 5, 6, 7, 8, 9, 12, 13]
    assert table_entries(batch, a.row) == {0: 4, 1: 5, 2: 6, 3: 7, 4: 8, 5: 9}
    assert table_entries(batch, b.row) == {0: 12, 1: 13}
    assert s.allocator.num_free == 8 - 3
    s.process(batch, StepResult(SampleOutput([40, 41], None, None)))
    batch, _ = s.schedule()
    assert batch.input_ids == [40, 41] and batch.positions == [6, 2]
    assert batch.out_cache_loc == [10, 14]
    assert table_entries(batch, a.row) == {6: 10} and table_entries(batch, b.row) == {2: 14}
    assert a.kv_len == 7 and b.kv_len == 3


def test_finished_requests_leave_at_once_and_return_everything():
    s = make(num_pages=17, page_size=2)
    a, b = req("a", 3, max_new=1), req("b", 3, max_new=4)
    s.add(a)
    s.add(b)
    batch, _ = step(s)
    assert a.finished and a.finish_reason == {"type": "length", "length": 1}
    assert s.running == [b] and a.row == -1 and a.pages == []
    assert a.finish_time is not None
    batch, _ = s.schedule()
    assert batch.reqs == [b]
    s.process(batch, StepResult(SampleOutput([EOS], None, None)))
    assert b.finish_reason == {"type": "stop", "matched": EOS} and b.output_ids == [7, EOS]
    assert_all_free(s)


def test_stop_conditions():
    s = make()
    ign = req("ign", 2, max_new=3, ignore_eos=True)
    stop = req("stop", 2, max_new=3, stop_token_ids=[9])
    s.add(ign)
    s.add(stop)
    step(s, {"ign": EOS, "stop": 8})
    step(s, {"ign": EOS, "stop": 9})
    assert stop.finish_reason == {"type": "stop", "matched": 9} and stop.output_ids == [8, 9]
    assert not ign.finished
    step(s, {"ign": EOS})
    assert ign.finish_reason == {"type": "length", "length": 3} and ign.output_ids == [EOS] * 3
    assert_all_free(s)


def test_context_length_ends_a_request():
    s = make(ctx=8)
    r = req("r", 6, max_new=10)
    s.add(r)
    step(s)
    step(s)
    assert r.finish_reason == {"type": "length", "length": 2} and r.seq_len == 8
    assert_all_free(s)


def test_prompt_only_request_finishes_after_prefill():
    s = make()
    r = req("r", 5, max_new=0)
    s.add(r)
    step(s)
    assert r.finish_reason == {"type": "length", "length": 0} and r.output_ids == []
    assert_all_free(s)


def test_abort_waiting_and_running_requests():
    s = make(max_running=1)
    a, b = req("a", 3, max_new=10), req("b", 3)
    s.add(a)
    s.add(b)
    step(s)
    assert s.abort("b") and s.abort("a") and not s.abort("nobody")
    batch, aborted = s.schedule()
    assert batch is None and set(aborted) == {a, b}
    for r in (a, b):
        assert r.finish_reason == {"type": "abort", "message": "request aborted"}
    assert_all_free(s)


def test_abort_matches_the_n_sequences_of_a_request():
    """An abort reaches the exact rid and every sequence of the request group it names; a rid
    that merely looks like a copy of it ("x-7", another client's request) is left alone."""
    s = make()
    seqs = [req(f"x-{i}", 2) for i in range(3)]
    for r in seqs:
        r.group = "x"
    lookalike, other = req("x-7", 2), req("xy", 2)
    for r in (*seqs, lookalike, other):
        s.add(r)
    assert s.abort("x")
    assert all(r.aborted for r in seqs) and not other.aborted and not lookalike.aborted
    assert s.abort("x-7") and lookalike.aborted and not other.aborted
    assert not s.abort("nobody")


def test_abort_during_forward_drops_the_result():
    s = make()
    r = req("r", 3, max_new=5)
    s.add(r)
    batch, _ = s.schedule()
    s.abort("r")  # arrives while the forward runs
    s.process(batch, StepResult(SampleOutput([7], None, None)))
    assert r.output_ids == [] and not r.finished
    _, aborted = s.schedule()
    assert aborted == [r] and r.finish_reason["type"] == "abort"
    assert_all_free(s)


def test_fail_returns_pages():
    s = make(page_size=2)
    a, b = req("a", 3), req("b", 5)
    s.add(a)
    s.add(b)
    batch, _ = s.schedule()
    s.fail(batch.reqs, "boom")
    assert a.finish_reason == {"type": "abort", "message": "boom"} == b.finish_reason
    assert_all_free(s)


@pytest.mark.parametrize("page_size", [1, 3])
def test_many_requests_through_a_small_pool(page_size):
    """More work than fits at once: everything finishes, in bounded running sets, and nothing leaks."""
    s = make(num_pages=40 // page_size + 1, page_size=page_size, max_running=3)
    reqs = [req(f"r{i}", 2 + i % 7, max_new=1 + i % 5) for i in range(20)]
    for r in reqs:
        s.add(r)
    steps = 0
    while s.has_work:
        batch, _ = step(s)
        assert len(batch.reqs) <= 3
        assert 0 <= s.allocator.num_free <= s.allocator.capacity
        steps += 1
        assert steps < 500
    assert all(r.finish_reason == {"type": "length", "length": r.params.max_new_tokens} for r in reqs)
    assert_all_free(s)


# ---- --num-continuous-decode-steps: several decode steps in one batch
def multi(steps: int = 4, **kwargs) -> Scheduler:
    s = make(**kwargs)
    s.decode_steps = steps
    return s


def started(s: Scheduler, *reqs: Req) -> None:
    """Admit ``reqs`` and run their prefill (token 7 each)."""
    for r in reqs:
        s.add(r)
    batch, _ = step(s)
    assert batch.is_prefill and batch.steps == 1


def test_a_decode_batch_takes_every_steps_slots_up_front():
    s = multi(4, num_pages=17, page_size=2)
    a, b = req("a", 3, max_new=10), req("b", 2, max_new=10)
    started(s, a, b)
    batch, _ = s.schedule()
    assert not batch.is_prefill and batch.steps == 4
    assert batch.input_ids == [7, 7] and batch.positions == [3, 2] and batch.extend_lens == [1, 1]
    for i, r in enumerate((a, b)):  # step k's slots at [k * B, (k + 1) * B), each in the request's own pages
        slots = {batch.positions[i] + k: batch.out_cache_loc[2 * k + i] for k in range(4)}
        assert slots == {p: r.pages[p // 2] * 2 + p % 2 for p in slots}
        assert table_entries(batch, r.row) == slots
    assert len(set(batch.out_cache_loc)) == 8
    s.process(batch, StepResult(SampleOutput([20, 30], None, None), [[21, 31], [22, 32], [23, 33]]))
    assert a.output_ids == [7, 20, 21, 22, 23] and b.output_ids == [7, 30, 31, 32, 33]
    assert a.kv_len == a.seq_len - 1 and b.kv_len == b.seq_len - 1


def test_steps_ended_early_keep_their_slots_for_the_next_batch():
    s = multi(4, num_pages=17, page_size=2)
    a = req("a", 3, max_new=10)
    started(s, a)
    batch, _ = s.schedule()
    reserved = list(batch.out_cache_loc)
    batch.steps_run = 2  # the runner ran two steps (a stop token of another request ended them)
    s.process(batch, StepResult(SampleOutput([20], None, None), [[21]]))
    assert a.output_ids == [7, 20, 21] and a.kv_len == 5
    batch, _ = s.schedule()  # positions 5.. again, into the slots taken for them before
    assert batch.positions == [5] and batch.input_ids == [21] and batch.out_cache_loc[:2] == reserved[2:]
    assert batch.steps == 4
    s.process(batch, StepResult(SampleOutput([EOS], None, None), [[EOS], [EOS], [EOS]]))
    assert a.finish_reason == {"type": "stop", "matched": EOS} and a.output_ids == [7, 20, 21, EOS]
    assert_all_free(s)


def test_a_stop_inside_the_steps_drops_the_tokens_after_it():
    s = multi(4)
    a, b = req("a", 2, max_new=10), req("b", 2, max_new=10, stop_token_ids=[9])
    started(s, a, b)
    batch, _ = s.schedule()
    s.process(batch, StepResult(SampleOutput([20, 30], None, None), [[EOS, 9], [22, 32], [23, 33]]))
    assert a.output_ids == [7, 20, EOS] and a.finish_reason == {"type": "stop", "matched": EOS}
    assert b.output_ids == [7, 30, 9] and b.finish_reason == {"type": "stop", "matched": 9}
    assert_all_free(s)


def test_the_steps_stop_at_max_new_tokens_and_the_context():
    s = multi(8, num_pages=400, ctx=20)
    a, b = req("a", 3, max_new=4), req("b", 14, max_new=50)
    started(s, a, b)  # a may add 3 more tokens; b reaches the context (20) after 5
    batch, _ = s.schedule()
    assert batch.steps == 3
    s.process(batch, StepResult(SampleOutput([20, 30], None, None), [[21, 31], [22, 32]]))
    assert a.finish_reason == {"type": "length", "length": 4} and not b.finished
    batch, _ = s.schedule()
    assert batch.reqs == [b] and batch.steps == 2
    s.process(batch, StepResult(SampleOutput([33], None, None), [[34]]))
    assert b.finish_reason == {"type": "length", "length": 6} and b.seq_len == 20
    assert_all_free(s)


@pytest.mark.parametrize("why", ["waiting", "logprobs", "penalty", "min_new_tokens", "grammar", "pool"])
def test_one_step_where_a_step_must_be_seen_before_the_next(why):
    """A waiting request is admitted at the next batch; logprobs, penalties, min_new_tokens and
    grammars need each step's result in Python; a pool without room for every step's pages."""
    s = multi(4, num_pages=12 if why == "pool" else 65)
    params = {"logprobs": {}, "penalty": {"frequency_penalty": 0.5}, "min_new_tokens": {"min_new_tokens": 2}}.get(why, {})
    a = req("a", 3, max_new=10, **params)
    a.return_logprob = why == "logprobs"
    started(s, a, req("b", 3, max_new=10))
    if why == "grammar":
        a.grammar = object()
    if why == "waiting":
        s.add(req("c", 60 - 4, max_new=10))  # larger than the pool leaves: it waits
    batch, _ = s.schedule()
    assert not batch.is_prefill and batch.steps == 1
    if why == "min_new_tokens":  # once reached, the steps run together again
        s.process(batch, StepResult(SampleOutput([20, 30], None, None)))
        batch, _ = s.schedule()
        assert batch.steps == 4


def test_an_abort_while_the_steps_run_drops_them():
    s = multi(4)
    a, b = req("a", 3, max_new=10), req("b", 3, max_new=10)
    started(s, a, b)
    batch, _ = s.schedule()
    s.abort("a")
    s.process(batch, StepResult(SampleOutput([20, 30], None, None), [[21, 31], [22, 32], [23, 33]]))
    assert a.output_ids == [7] and a.kv_len == a.seq_len and b.output_ids == [7, 30, 31, 32, 33]
    _, aborted = s.schedule()
    assert aborted == [a]
    s.abort("b")
    s.schedule()
    assert_all_free(s)


def test_prefill_max_requests_caps_a_prefill_batch() -> None:
    """SGLang's --prefill-max-requests: five short prompts that fit one prefill go two at a time."""
    alloc, table = PageAllocator(65, 1), ReqToTokenTable(8, 65, torch.device("cpu"))
    s = Scheduler(alloc, table, max_running_requests=8, max_prefill_tokens=1000, context_len=64, eos_ids=(EOS,),
                  prefill_max_requests=2)
    for i in range(5):
        s.add(req(f"r{i}", 3))
    sizes = []
    while s.waiting:
        batch = s.schedule()[0]
        if batch.is_prefill:
            sizes.append(len(batch.reqs))
        s.process(batch, StepResult(SampleOutput([7] * len(batch.reqs), None, None)))
    assert sizes == [2, 2, 1]
    assert make().prefill_max_requests >= 1 << 62  # (no limit by default)


def test_prefill_max_requests_reaches_the_scheduler(tiny_llama) -> None:
    from core.errors import CoreError
    from tests.conftest import make_engine

    eng = make_engine(tiny_llama()[0], prefill_max_requests=3)
    try:
        assert eng.engine.scheduler.prefill_max_requests == 3
    finally:
        eng.shutdown()
    with pytest.raises(CoreError, match="--prefill-max-requests must be >= 1, got 0"):
        make_engine(tiny_llama()[0], prefill_max_requests=0)
