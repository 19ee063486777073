"""Overlap scheduling (issue 42): the next batch is scheduled, and handed to the forward thread,
before the running one's results are processed. Outputs are those of the plain loop, request
for request: greedy and seeded samples, stop strings and tokens, max_new_tokens, grammars,
logprobs, penalties, min_new_tokens, n > 1, chunked prefill, retraction, continuous decode
steps and abort; the host's work of step n + 1 happens while step n's forward runs; a request
aborted while its token is in flight frees its pages exactly once."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from tests.conftest import build_tiny_llama, make_engine

PROMPTS = [[5 + (i * 7 + j) % 90 for j in range(n)] for i, n in enumerate([12, 40, 7, 25, 33, 9, 61, 18])]

# one entry per behaviour, all in one batch (different lengths, so requests finish at different steps)
REQUESTS: list[dict[str, Any]] = [
    {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True},
    {"max_new_tokens": 17, "temperature": 0.8, "top_p": 0.9, "sampling_seed": 7, "ignore_eos": True},
    {"max_new_tokens": 30, "temperature": 0, "stop": ["ff"]},  # (seed 3's model writes "...sefff..." here)
    {"max_new_tokens": 25, "temperature": 0, "stop_token_ids": [216], "ignore_eos": True},  # its 5th token
    {"max_new_tokens": 12, "temperature": 0, "frequency_penalty": 0.7, "presence_penalty": 0.3, "ignore_eos": True},
    {"max_new_tokens": 15, "temperature": 0, "min_new_tokens": 9},
    {"max_new_tokens": 9, "temperature": 1.0, "top_k": 5, "sampling_seed": 3, "ignore_eos": True},
    {"max_new_tokens": 1, "temperature": 0},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-overlap")
    build_tiny_llama(path, seed=3)
    return path


def run_all(path: Path, overlap: bool, defer: bool = False, **kwargs: Any) -> tuple[list[dict], int]:
    """Every request of REQUESTS in one batch: (outputs, retractions). ``defer``: a decode's tokens
    stay on the device until the next batch is launched, as overlap scheduling runs on a GPU
    (``ModelRunner.defer_results``; the CPU stands in for the device)."""
    eng = make_engine(path, dtype="float32", device="cpu", enable_overlap_schedule=overlap,
                      disable_overlap_schedule=not overlap, **kwargs)
    eng.engine.runner.defer_results = defer
    try:
        assert eng.engine.overlap == overlap
        outs = eng.generate(input_ids=PROMPTS, sampling_params=REQUESTS, return_logprob=True, top_logprobs_num=2)
        return [{"ids": o["output_ids"], "text": o["text"], "finish": o["meta_info"]["finish_reason"],
                 "lp": [round(lp, 4) for lp, _, _ in o["meta_info"]["output_token_logprobs"]]} for o in outs], \
            eng.engine.scheduler.num_retracted
    finally:
        eng.engine.scheduler.check_accounting()
        eng.shutdown()


@pytest.mark.parametrize("variant", [
    {},
    {"chunked_prefill_size": 16},  # prompts in chunks, with decodes between them
    {"max_total_tokens": 128, "chunked_prefill_size": 32, "schedule_conservativeness": 0.1},  # a small pool: retraction
    {"num_continuous_decode_steps": 4},
    {"disable_radix_cache": True},
], ids=["plain", "chunked", "retraction", "continuous_steps", "no_radix_cache"])
def test_outputs_equal_the_plain_loop(tiny, variant):
    (plain, retracted), (over, retracted_over) = run_all(tiny, False, **variant), run_all(tiny, True, **variant)
    deferred, _ = run_all(tiny, True, defer=True, **variant)
    for i, (a, b, c) in enumerate(zip(plain, over, deferred)):
        assert a == b == c, (i, REQUESTS[i])
    finish = [o["finish"] for o in plain]
    assert finish[2] == {"type": "stop", "matched": "ff"} and finish[3] == {"type": "stop", "matched": 216}
    assert [len(o["ids"]) for o in plain][5] >= 9 and len(plain[7]["ids"]) == 1
    if "schedule_conservativeness" in variant:
        assert retracted > 0 and retracted_over > 0


def test_a_seeded_token_dropped_by_a_retraction_keeps_its_draw(tiny):
    """A token in flight when its request is retracted is dropped and sampled again after readmission
    with the same draw: seeded samples equal a pool that retracts nothing, as without overlap."""
    seeded = [{"max_new_tokens": 40, "temperature": 0.8, "seed": 100 + i, "ignore_eos": True} for i in range(6)]
    prompts = [[5 + (i * 7 + j) % 90 for j in range(n)] for i, n in enumerate([12, 20, 7, 25, 16, 9])]

    def run(**kwargs: Any) -> tuple[list[list[int]], int]:
        eng = make_engine(tiny, dtype="float32", device="cpu", **kwargs)
        try:
            outs = eng.generate(input_ids=prompts, sampling_params=seeded)
            return [o["output_ids"] for o in outs], eng.engine.scheduler.num_retracted
        finally:
            eng.shutdown()
    ref, none = run()
    small = {"max_total_tokens": 128, "schedule_conservativeness": 0.1}
    got, retracted = run(enable_overlap_schedule=True, **small)
    assert none == 0 and retracted > 0 and got == ref


def test_grammars_and_n_greater_than_one(tiny):
    """A grammar needs its matcher's state after each token: those steps wait for the results
    (logged once, naming why); the others around them overlap."""
    outs, paused = [], []
    for overlap in (False, True):
        eng = make_engine(tiny, dtype="float32", device="cpu", enable_overlap_schedule=overlap,
                          disable_overlap_schedule=not overlap)
        try:
            with capture_logs() as logs:
                got = eng.generate(input_ids=[PROMPTS[0], PROMPTS[1], PROMPTS[2]],
                                   sampling_params=[{"max_new_tokens": 12, "temperature": 0, "regex": "[0-9]{3,8}"},
                                                    {"max_new_tokens": 14, "temperature": 0, "ignore_eos": True},
                                                    {"max_new_tokens": 10, "temperature": 0.7, "n": 3,
                                                     "sampling_seed": 11, "ignore_eos": True}])
            outs.append([o["output_ids"] for o in got])
            paused.append([e["reason"] for e in logs if e["event"] == "engine.overlap_paused"])
        finally:
            eng.shutdown()
    assert outs[0] == outs[1]
    assert paused == [[], ["a grammar"]]  # the plain loop never pauses; overlap says why, once


def test_logprob_requests_overlap_and_keep_their_logprobs(tiny):
    """A step's logprobs come with its own token: requests asking for them do not make the next
    step wait (with the tokens deferred on the device, as on a GPU), and their logprobs are the
    plain loop's."""
    def run(overlap: bool) -> tuple[list, list[str]]:
        eng = make_engine(tiny, dtype="float32", device="cpu", enable_overlap_schedule=overlap,
                          disable_overlap_schedule=not overlap)
        eng.engine.runner.defer_results = overlap
        needs, reasons = eng.engine.scheduler.needs_results, []
        eng.engine.scheduler.needs_results = lambda: reasons.append(needs()) or reasons[-1]
        try:
            outs = eng.generate(input_ids=PROMPTS[:3], sampling_params={"max_new_tokens": 10, "temperature": 0,
                                                                         "ignore_eos": True},
                                return_logprob=True, top_logprobs_num=2)
            return [(o["output_ids"], o["meta_info"]["output_token_logprobs"], o["meta_info"]["output_top_logprobs"])
                    for o in outs], reasons
        finally:
            eng.shutdown()

    (plain, _), (over, reasons) = run(False), run(True)
    assert over == plain
    assert reasons.count("") >= 8 and set(reasons) == {""}  # every decode step overlapped


def test_speculation_overlaps_the_steps_it_does_not_verify(tiny):
    """NGRAM with overlap scheduling (tokens deferred on the device, as on a GPU): a step that may
    verify waits for the one in flight, and so does the step after a verify; steps of requests
    the drafter has nothing for overlap (it asks them again after 1, 2, 4, 8 steps). A repeated
    prompt drafts the first answer; the tokens are the plain loop's in every case."""
    prompts = [PROMPTS[1], PROMPTS[1], PROMPTS[3]]
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}

    class Nothing:
        calls = 0

        def propose(self, state: dict, tokens, max_tokens: int) -> list[int]:
            Nothing.calls += 1
            return []

    def run(overlap: bool, drafter: Any = None, **spec: Any) -> tuple[list, list[str], list[dict]]:
        eng = make_engine(tiny, dtype="float32", device="cpu", enable_overlap_schedule=overlap,
                          disable_overlap_schedule=not overlap, **spec)
        eng.engine.runner.defer_results = overlap
        if drafter is not None:
            eng.engine.scheduler.speculator.drafter = drafter
        needs, reasons = eng.engine.scheduler.needs_results, []
        eng.engine.scheduler.needs_results = lambda: reasons.append(needs()) or reasons[-1]
        try:
            outs = [eng.generate(input_ids=p, sampling_params=params) for p in prompts[:2]]  # the second drafts the first
            outs += eng.generate(input_ids=prompts, sampling_params=params)
            return [o["output_ids"] for o in outs], reasons, [o["meta_info"] for o in outs]
        finally:
            eng.engine.scheduler.check_accounting()
            eng.shutdown()

    plain, _, _ = run(False)
    spec, reasons, meta = run(True, speculative_algorithm="NGRAM")
    assert spec == plain
    assert meta[1]["spec_num_correct_drafts"] >= 12  # the repeated request's drafts, verified under overlap
    assert "a speculative verify" in reasons and reasons.count("") >= 10  # overlapped steps between them
    idle, reasons, _ = run(True, Nothing(), speculative_algorithm="NGRAM")
    assert idle == plain
    assert reasons.count("") > 3 * reasons.count("a speculative verify") and Nothing.calls > 0


def test_the_next_steps_host_work_runs_during_the_forward(tiny):
    """With a slow forward, step n + 1 is scheduled (and step n - 1 processed) on the loop while
    step n's forward runs on the forward thread: most schedule() calls find a forward unfinished."""
    eng = make_engine(tiny, dtype="float32", device="cpu", enable_overlap_schedule=True)
    ae = eng.engine
    ae.runner.defer_results = False  # (the forward thread's run is the step here; deferred: the next test)
    overlapped = []
    run, schedule = ae.runner.run, ae.scheduler.schedule

    def slow_run(batch):
        time.sleep(0.03)
        return run(batch)

    def watched_schedule():
        overlapped.append(ae._inflight is not None and not ae._inflight[1].done())
        return schedule()

    ae.runner.run, ae.scheduler.schedule = slow_run, watched_schedule
    try:
        t0 = time.perf_counter()
        out = eng.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 16, "temperature": 0, "ignore_eos": True})
        wall = time.perf_counter() - t0
        assert len(out["output_ids"]) == 16
    finally:
        eng.shutdown()
    assert sum(overlapped) >= 12, overlapped  # all but the first (nothing in flight) and the last
    assert wall < 16 * 0.03 * 1.5  # (the forwards back to back, not forward + host work in turn)


def test_overlap_shortens_the_gil_switch_interval_while_it_runs(tiny):
    """The forward thread's Python must not wait CPython's 5 ms behind the loop's: an overlapping
    engine shortens the interval until the last one stops; a plain one and a program's own value
    are left alone."""
    import math
    import sys

    from core.engine import gil_switch

    def now(seconds: float) -> bool:
        return math.isclose(sys.getswitchinterval(), seconds, rel_tol=1e-6)

    assert gil_switch._holders == 0 and now(gil_switch.DEFAULT_S)  # (no other engine alive in this module)
    plain = make_engine(tiny, dtype="float32", device="cpu", disable_overlap_schedule=True)
    try:
        assert now(gil_switch.DEFAULT_S)
        a, b = (make_engine(tiny, dtype="float32", device="cpu", enable_overlap_schedule=True) for _ in range(2))
        assert now(gil_switch.OVERLAP_S)
        a.shutdown()
        assert now(gil_switch.OVERLAP_S)  # b still overlaps
        b.shutdown()
        assert now(gil_switch.DEFAULT_S)
    finally:
        plain.shutdown()
    sys.setswitchinterval(0.001)  # the program's own choice
    try:
        c = make_engine(tiny, dtype="float32", device="cpu", enable_overlap_schedule=True)
        assert now(0.001)
        c.shutdown()
        assert now(0.001)
    finally:
        sys.setswitchinterval(gil_switch.DEFAULT_S)


def test_deferred_tokens_are_read_after_the_next_launch(tiny):
    """With ``defer_results`` (overlap scheduling on a GPU) a decode's tokens stay on the device:
    the next batch is launched with its future ids read there (forward_batch), and only then, on
    the forward thread, does the engine wait for the copy of the earlier tokens."""
    eng = make_engine(tiny, dtype="float32", device="cpu", enable_overlap_schedule=True)
    ae = eng.engine
    ae.runner.defer_results = True
    events: list[tuple[str, int]] = []
    kept: list = []
    run = ae.runner.run
    from core.engine import model_runner as mr
    from core.engine.schedule_batch import StepResult

    resolve = StepResult.resolve

    def spy_run(batch):
        out = run(batch)
        kept.append(out)  # (alive: ids stay unique)
        events.append(("run", id(out)))
        return out

    def spy_resolve(self):
        if self.pending is not None:
            events.append(("resolve", id(self)))
            assert threading.current_thread().name.startswith("core-forward")
        return resolve(self)

    seen_futures = []
    forward_batch = mr.forward_batch

    def spy_forward_batch(inputs, *a):
        seen_futures.append(inputs.future_tokens is not None and any(t < 0 for t in inputs.input_ids))
        return forward_batch(inputs, *a)

    ae.runner.run, StepResult.resolve, mr.forward_batch = spy_run, spy_resolve, spy_forward_batch
    try:
        out = eng.generate(input_ids=PROMPTS[:2], sampling_params={"max_new_tokens": 10, "temperature": 0, "ignore_eos": True})
    finally:
        ae.runner.run, StepResult.resolve, mr.forward_batch = run, resolve, forward_batch
        eng.shutdown()
    assert [len(o["output_ids"]) for o in out] == [10, 10]
    order = {rid: k for k, (kind, rid) in enumerate(e for e in events if e[0] == "run")}  # result -> its batch's number
    log = [(kind, order[rid]) for kind, rid in events]
    resolves = [(i, k) for i, (kind, k) in enumerate(log) if kind == "resolve"]
    assert len(resolves) >= 8, log
    for i, k in resolves:  # batch k's tokens are waited for only after batch k + 1 was launched (the last: none)
        assert ("run", k + 1) in log[:i] or k == len(order) - 1, log
    assert sum(seen_futures) >= 8  # the next batches' input ids read the device tokens


def test_an_abort_while_a_token_is_in_flight_frees_pages_once(tiny):
    """Abort a request between its batch's launch and its results: its pages go back once (the
    pool's accounting holds), the others finish as without the abort."""
    eng = make_engine(tiny, dtype="float32", device="cpu", enable_overlap_schedule=True, max_total_tokens=512)
    ae = eng.engine
    run = ae.runner.run
    steps = []

    def run_and_abort(batch):
        steps.append(len(batch.reqs))
        if len(steps) == 4:
            ae.scheduler.running[0].aborted = True  # (as abort() marks it) while this batch is in flight
        time.sleep(0.005)
        return run(batch)

    ae.runner.run = run_and_abort
    free_before = ae.allocator.num_free
    try:
        outs = eng.generate(input_ids=PROMPTS[:3], sampling_params={"max_new_tokens": 20, "temperature": 0, "ignore_eos": True})
    finally:
        ae.scheduler.check_accounting()  # every page free, cached or held: none lost, none twice
        eng.shutdown()
    reasons = [o["meta_info"]["finish_reason"]["type"] for o in outs]
    assert reasons.count("abort") == 1 and reasons.count("length") == 2, reasons
    assert all(len(o["output_ids"]) == 20 for o, r in zip(outs, reasons) if r == "length")
    assert ae.allocator.num_free + len(ae.tree_cache.all_pages()) == free_before


def test_overlap_flags():
    from core.engine.config import overlap_schedule
    from core.engine.config import engine_args_from_kwargs
    from core.errors import CoreError

    import torch

    def args(**kw):
        return engine_args_from_kwargs({"model_path": "x", **kw})

    assert overlap_schedule(args(), torch.device("cuda")) and not overlap_schedule(args(), torch.device("cpu"))
    assert overlap_schedule(args(enable_overlap_schedule=True), torch.device("cpu"))
    assert not overlap_schedule(args(disable_overlap_schedule=True), torch.device("cuda"))
    with pytest.raises(CoreError, match="contradict"):
        overlap_schedule(args(disable_overlap_schedule=True, enable_overlap_schedule=True), torch.device("cpu"))
    asyncio.get_event_loop_policy()  # (no loop needed: the choice is made before the engine runs)


def test_tensor_and_data_parallel_engines_overlap_too(tiny):
    """--tp-size 2 (rank 0 resolves the future ids before it broadcasts a step) and --dp-size 2
    (each replica overlaps its own steps) give the plain one-rank engine's tokens."""
    prompts, params = PROMPTS[:4], {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    want = [o["output_ids"] for o in run_engine(tiny, False, prompts, params)]
    assert [o["output_ids"] for o in run_engine(tiny, True, prompts, params, tp_size=2)] == want
    assert [o["output_ids"] for o in run_engine(tiny, True, prompts, params, dp_size=2)] == want


def run_engine(path: Path, overlap: bool, prompts: list, params: dict, **kwargs: Any) -> list[dict]:
    eng = make_engine(path, dtype="float32", device="cpu", enable_overlap_schedule=overlap,
                      disable_overlap_schedule=not overlap, max_total_tokens=512, **kwargs)
    try:
        return eng.generate(input_ids=prompts, sampling_params=params)
    finally:
        eng.shutdown()
