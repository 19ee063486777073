"""Continuous batching: which requests run in the next forward, and what their results do.

Each step is either a prefill batch (newly admitted requests, bounded by
``max_prefill_tokens``) or a decode batch (every running request adds one token),
prefill first, as SGLang does by default. New requests therefore join between
decode steps and finished ones leave at once. Pure bookkeeping: no asyncio, no
model; the engine drives it.
"""

from __future__ import annotations

import time
from collections import deque

import attrs
import structlog
import torch

from core.kv_cache import PageAllocator, ReqToTokenTable
from core.request import Req
from core.sampler import SampleOutput

log = structlog.get_logger("core.scheduler")


@attrs.define
class ScheduledBatch:
    reqs: list[Req]
    extend_lens: list[int]
    input_ids: list[int]  # flattened new tokens
    positions: torch.Tensor  # [T]
    out_cache_loc: torch.Tensor  # [T]
    is_prefill: bool


@attrs.define
class StepResult:
    sample: SampleOutput
    # per request index: (logprobs of prompt tokens from logprob_start_len, their top logprobs)
    input_logprobs: dict[int, tuple[list[float | None], list[list[tuple[int, float]]]]] = attrs.field(factory=dict)


class Scheduler:
    def __init__(
        self,
        allocator: PageAllocator,
        table: ReqToTokenTable,
        *,
        max_running_requests: int,
        max_prefill_tokens: int,
        context_len: int,
        eos_ids: tuple[int, ...],
    ) -> None:
        self.allocator, self.table = allocator, table
        self.max_running = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.context_len = context_len
        self.eos_ids = frozenset(eos_ids)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []

    # ------------------------------------------------------------------ queue
    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def abort(self, rid: str) -> bool:
        """Mark a request aborted; its resources go back at the next step boundary."""
        found = False
        for req in (*self.waiting, *self.running):
            if req.rid == rid or (req.rid.startswith(rid + "-") and req.rid[len(rid) + 1 :].isdigit()):  # n > 1 copies
                req.aborted, found = True, True
        return found

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def pages_needed(self, req: Req) -> int:
        return self.allocator.pages_for(len(req.prompt_ids) + req.params.max_new_tokens)

    # ------------------------------------------------------------------ batching
    def schedule(self) -> tuple[ScheduledBatch | None, list[Req]]:
        """Form the next batch; also returns requests finished by abort since the last step."""
        aborted = self._reap_aborted()
        admitted: list[Req] = []
        tokens = 0
        while self.waiting and len(self.running) + len(admitted) < self.max_running and self.table.num_free:
            req = self.waiting[0]
            need = self.pages_needed(req)
            if admitted and tokens + len(req.prompt_ids) > self.max_prefill_tokens:
                break
            if not self.allocator.can_reserve(need):
                break
            self.waiting.popleft()
            self.allocator.reserve(need)
            req.reserved, req.row = need, self.table.alloc_row()
            admitted.append(req)
            tokens += len(req.prompt_ids)
        if admitted:
            self.running.extend(admitted)
            return self._build(admitted, [len(r.prompt_ids) for r in admitted], prefill=True), aborted
        if self.running:
            return self._build(list(self.running), [1] * len(self.running), prefill=False), aborted
        return None, aborted

    def _build(self, reqs: list[Req], extend_lens: list[int], prefill: bool) -> ScheduledBatch:
        """Take pages for the new tokens and record their slots in the request table."""
        ps = self.allocator.page_size
        input_ids: list[int] = []
        rows: list[int] = []
        positions: list[int] = []
        locs: list[int] = []
        for req, n in zip(reqs, extend_lens):
            start = req.kv_len
            while len(req.pages) * ps < start + n:
                req.pages.append(self.allocator.take())
                req.reserved -= 1
            pages, span = req.pages, range(start, start + n)
            positions.extend(span)
            locs.extend(pages[p // ps] * ps + p % ps for p in span)
            rows.extend([req.row] * n)
            input_ids.extend(req.token_at(p) for p in span)
            req.kv_len = start + n
        pos_t, loc_t = torch.tensor(positions), torch.tensor(locs)
        self.table.table[torch.tensor(rows), pos_t] = loc_t
        return ScheduledBatch(reqs, extend_lens, input_ids, pos_t, loc_t, prefill)

    # ------------------------------------------------------------------ results
    def process(self, batch: ScheduledBatch, result: StepResult) -> list[tuple[Req, str]]:
        """Append sampled tokens, detokenize, check stop conditions, free finished requests.

        Returns (request, new text) for every request in the batch."""
        now = time.perf_counter()
        s = result.sample
        updates = []
        for i, req in enumerate(batch.reqs):
            if i in result.input_logprobs:
                req.input_logprobs, req.input_top_logprobs = result.input_logprobs[i]
            if req.finished or req.aborted:  # aborted while the forward ran: dropped at the next step
                updates.append((req, ""))
                continue
            if req.params.max_new_tokens == 0:  # prompt-only request (e.g. for prompt logprobs)
                req.finish_reason = {"type": "length", "length": 0}
                updates.append((req, ""))
                continue
            tok = s.token_ids[i]
            req.output_ids.append(tok)
            if req.first_token_time is None:
                req.first_token_time = now
            if s.logprobs is not None and req.return_logprob:
                req.output_logprobs.append(s.logprobs[i])
                if req.top_logprobs_num and s.top_logprobs is not None:
                    req.output_top_logprobs.append(s.top_logprobs[i])
            delta = self._check_finish(req, tok)
            req.text += delta
            updates.append((req, delta))
        for req in [r for r in self.running if r.finished]:
            self._free(req)
            req.finish_time = now
        return updates

    def _check_finish(self, req: Req, tok: int) -> str:
        p = req.params
        hit_eos = (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids
        delta = ""
        if req.detokenizer is not None and not hit_eos:
            delta = req.detokenizer.add([tok])
        if hit_eos:
            req.finish_reason = {"type": "stop", "matched": tok}
        elif req.detokenizer is not None and req.detokenizer.matched_stop is not None:
            req.finish_reason = {"type": "stop", "matched": req.detokenizer.matched_stop}
        elif len(req.output_ids) >= p.max_new_tokens or req.seq_len >= self.context_len:
            req.finish_reason = {"type": "length", "length": len(req.output_ids)}
        if req.finished and req.detokenizer is not None and req.detokenizer.matched_stop is None:
            delta += req.detokenizer.flush()
        return delta

    def fail(self, reqs: list[Req], message: str) -> None:
        """Finish requests whose forward failed, returning their pages."""
        now = time.perf_counter()
        for req in reqs:
            if not req.finished:
                req.finish_reason = {"type": "abort", "message": message}
                req.finish_time = now
            if req.row >= 0:
                self._free(req)

    def _reap_aborted(self) -> list[Req]:
        gone = [r for r in self.waiting if r.aborted] + [r for r in self.running if r.aborted and not r.finished]
        if not gone:
            return []
        self.waiting = deque(r for r in self.waiting if not r.aborted)
        now = time.perf_counter()
        for req in gone:
            req.finish_reason = {"type": "abort", "message": "request aborted"}
            req.finish_time = now
            if req.row >= 0:
                self._free(req)
        return gone

    def _free(self, req: Req) -> None:
        self.allocator.release(req.pages, req.reserved)
        req.pages, req.reserved = [], 0
        self.table.free_row(req.row)
        req.row = -1
        self.running.remove(req)
