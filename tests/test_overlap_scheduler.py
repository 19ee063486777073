"""The scheduler under overlap scheduling, driven without a model (issue 42): batch n + 1 is built
before batch n's results are processed, its decodes naming the in-flight tokens by future id. A
deterministic fake forward (each sampled token a function of the request and its position) makes
both orders give the same outputs, which these random workloads check along with the pool's
accounting after every step: prefix sharing, chunked prefill, a pool small enough to retract,
stop tokens, aborts, pages of 1 and 4 tokens."""

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

EOS = 2


def token(rid: str, pos: int) -> int:
    """The fake model's token at position ``pos`` of request ``rid`` (EOS now and then)."""
    h = hash((rid, pos)) % 97
    return EOS if h == 0 else 10 + h


class FakeRunner:
    """Checks each batch's inputs against the true sequences and samples ``token``: it reads the
    batch's own fields only, as the real runner does, and resolves future ids from the last batch."""

    def __init__(self, prompts: dict[str, list[int]]) -> None:
        self.prompts, self.last = prompts, None

    def run(self, batch) -> StepResult:
        ids = [t if t >= 0 else self.last[-1 - t] for t in batch.input_ids]
        k = 0
        for r, n in zip(batch.reqs, batch.extend_lens):
            for p in batch.positions[k:k + n]:
                prompt = self.prompts[r.rid]
                want = prompt[p] if p < len(prompt) else token(r.rid, p)
                assert ids[k] == want, (r.rid, p, ids[k], want)
                k += 1
        toks = [0] * len(batch.reqs)
        for i in batch.live:
            toks[i] = token(batch.reqs[i].rid, batch.seq_lens[i])
        self.last = toks
        return StepResult(SampleOutput(toks, None, None))


def workload(seed: int) -> list[Req]:
    rng = random.Random(seed)
    shared = [50 + i for i in range(rng.randrange(4, 20))]
    reqs = []
    for i in range(rng.randrange(6, 14)):
        prompt = (shared if rng.random() < 0.5 else []) + [60 + rng.randrange(30) for _ in range(rng.randrange(1, 40))]
        params = SamplingParams(max_new_tokens=rng.randrange(1, 24), ignore_eos=rng.random() < 0.5)
        reqs.append(Req(f"r{seed}-{i}", prompt, params))
    return reqs


def drive(seed: int, overlap: bool, page_size: int, pages: int, chunk: int | None) -> dict[str, tuple]:
    reqs = workload(seed)
    alloc = PageAllocator(pages, page_size)
    table = ReqToTokenTable(6, 128 + page_size, torch.device("cpu"))
    s = Scheduler(alloc, table, max_running_requests=6, max_prefill_tokens=64, context_len=96, eos_ids=(EOS,),
                  tree_cache=RadixCache(page_size), chunked_prefill_size=chunk, schedule_conservativeness=0.2)
    runner = FakeRunner({r.rid: list(r.prompt_ids) for r in reqs})
    rng = random.Random(seed + 1)
    abort_at = {r.rid: rng.randrange(1, 10) for r in reqs if rng.random() < 0.2}  # abort after this many tokens
    for r in reqs:
        s.add(r)
    inflight = None
    futures = 0  # batches built on an in-flight batch's tokens

    def complete(batch, result) -> None:
        s.process(batch, result)
        s.check_accounting()
        for r in batch.reqs:
            if r.rid in abort_at and len(r.output_ids) >= abort_at[r.rid] and not r.finished:
                r.aborted = True
                r.abort_message = "aborted by the test"

    for _ in range(5000):
        if inflight is not None and (not overlap or s.needs_results()):
            complete(*inflight)
            inflight = None
        batch, _ = s.schedule()
        if batch is None:
            if inflight is None:
                break
            complete(*inflight)
            inflight = None
            continue
        result = runner.run(batch)
        futures += batch.futures
        if inflight is not None:
            complete(*inflight)
        inflight = (batch, result)
    assert not s.has_work and inflight is None
    assert (futures > 0) == overlap
    s.check_accounting()
    assert alloc.num_free + len(s.tree_cache.all_pages()) == alloc.capacity  # every page free or cached
    return {r.rid: (tuple(r.output_ids), (r.finish_reason or {}).get("type")) for r in reqs}, s.num_retracted


@pytest.mark.parametrize("page_size,pages,chunk", [(1, 200, None), (1, 90, 16), (4, 40, 16)],
                         ids=["roomy", "retracting_chunked", "pages_of_4"])
@pytest.mark.parametrize("seed", range(6))
def test_overlap_order_gives_the_plain_orders_outputs(seed, page_size, pages, chunk):
    plain, _ = drive(seed, False, page_size, pages, chunk)
    over, _ = drive(seed, True, page_size, pages, chunk)
    assert over == plain
    assert all(ids for ids, reason in plain.values() if reason != "abort")


def test_the_small_pool_retracts_in_both_orders():
    retracted = [drive(seed, overlap, 1, 90, 16)[1] for seed in range(6) for overlap in (False, True)]
    assert sum(retracted[0::2]) > 0 and sum(retracted[1::2]) > 0
