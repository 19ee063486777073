"""Continuous batching: which requests run in the next forward, and what their results do.

Each step is either a prefill batch (newly admitted requests and at most one chunk of a long prompt,
bounded by ``max_prefill_tokens`` and ``chunked_prefill_size``) or a decode batch (every running
request adds one token), prefill first, as SGLang does. Chunks of a long prompt and decode steps
alternate (or share one forward with ``enable_mixed_chunk``), so running streams keep moving.

KV memory: requests reuse the longest cached prefix from the radix cache and prefill only the
rest. Admission does not reserve pages; it *estimates* future needs (SGLang's
``new_token_ratio``, scaled by ``schedule_conservativeness``), and when a decode step finds the
pool empty (after evicting unused cached prefixes), the most recently admitted requests are
retracted to the front of the queue, keeping their generated tokens, to re-prefill prompt+output
later. Waiting requests are ordered by a ``SchedulePolicy``. Pure bookkeeping: no asyncio, no
model; the engine drives it (overlap scheduling: see ``needs_results``).
"""

from __future__ import annotations

import time
from collections import deque

import structlog

from core.engine.mem_cache.kv_cache import PageAllocator, ReqToTokenTable
from core.engine.mem_cache.radix_cache import RadixCache
from core.engine.request import Req
from core.engine.schedule_batch import ScheduledBatch, StepResult, future_id
from core.engine.schedule_policy import SchedulePolicy
from core.engine.speculative import Speculator, host_read, multi_token_ok

log = structlog.get_logger("core.engine.scheduler")


# SGLang's scheduling constants (global_config / schedule_policy.py)
CLIP_MAX_NEW_TOKENS = 4096  # future tokens of one request counted at most this many in estimates
INIT_NEW_TOKEN_RATIO = 0.7  # times --schedule-conservativeness
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20
# An eviction walks the whole prefix tree: a full cache evicting one decode step's worth walked it every step
# (growing with the cache). Room for this many steps (at most 1/64 of the pool) is evicted at once (_alloc).
EVICT_AHEAD, EVICT_AHEAD_POOL_FRACTION = 8, 64


class Scheduler:
    def __init__(
        self, allocator: PageAllocator, table: ReqToTokenTable, *,
        max_running_requests: int, max_prefill_tokens: int, context_len: int, eos_ids: tuple[int, ...],
        tree_cache: RadixCache | None = None, chunked_prefill_size: int | None = None,
        schedule_policy: str = "fcfs", schedule_conservativeness: float = 1.0,
        enable_mixed_chunk: bool = False, enable_priority_scheduling: bool = False,
        schedule_low_priority_values_first: bool = False, seed: int = 0,
        decode_steps: int = 1, speculator: Speculator | None = None, prefill_max_requests: int | None = None,
        retraction_policy: str = "length",
    ) -> None:
        self.allocator, self.table, self.tree_cache = allocator, table, tree_cache
        self.max_running, self.max_prefill_tokens = max_running_requests, max_prefill_tokens
        self.prefill_max_requests = prefill_max_requests or 1 << 62  # --prefill-max-requests: a prefill batch's requests
        self.chunked_prefill_size = chunked_prefill_size if chunked_prefill_size and chunked_prefill_size > 0 else None
        self.context_len = context_len
        self.eos_ids = frozenset(eos_ids)
        self.policy = SchedulePolicy(schedule_policy, tree_cache, enable_priority=enable_priority_scheduling, seed=seed,
                                     low_priority_values_first=schedule_low_priority_values_first, retraction=retraction_policy)
        self.enable_mixed_chunk = enable_mixed_chunk
        self.decode_steps = decode_steps  # --num-continuous-decode-steps: the most decode steps one batch runs
        self.speculator = speculator  # --speculative-algorithm (core.engine.speculative)
        self.max_loras = 0  # --max-loras-per-batch with --enable-lora: distinct adapters among running requests
        self.init_new_token_ratio = min(INIT_NEW_TOKEN_RATIO * schedule_conservativeness, 1.0)
        self.min_new_token_ratio = min(self.init_new_token_ratio * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.new_token_ratio_decay = (self.init_new_token_ratio - self.min_new_token_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_new_token_ratio
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # admitted requests in admission order (the chunked one included)
        self.chunked_req: Req | None = None  # the request whose prompt is being prefilled in chunks
        self._chunk_ran_last = False
        self.num_retracted = 0  # requests retracted so far (a request may count more than once)
        # table row -> (positions, slots) not yet in the device table: written by the row's next batch
        self._table_pending: dict[int, tuple[list[int], list[int]]] = {}
        self.prefill_tokens = 0  # tokens computed by prefill forwards (cached prefixes excluded)

    # ------------------------------------------------------------------ queue
    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def abort(self, rid: str) -> bool:
        """Mark a request aborted; its resources go back at the next step boundary."""
        found = False
        for req in (*self.waiting, *self.running):
            if req.answers_to(rid):  # the exact rid, or every sequence of the API request ``rid``
                req.aborted, found = True, True
        return found

    def abort_all(self, message: str = "request aborted") -> int:
        """Mark every queued and running request aborted (finish message ``message``); how many were."""
        reqs = [r for r in (*self.waiting, *self.running) if not r.aborted and not r.finished]
        for req in reqs:
            req.aborted, req.abort_message = True, message
        return len(reqs)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def flush_cache(self) -> bool:
        """Empty the prefix cache (SGLang's /flush_cache); refused (False) while requests are queued or running."""
        if self.has_work:
            return False
        if self.tree_cache is not None:
            self.allocator.free(self.tree_cache.reset())
        return True

    # ------------------------------------------------------------------ memory
    @property
    def ps(self) -> int:
        return self.allocator.page_size

    def _evictable(self) -> int:
        return self.tree_cache.evictable_pages if self.tree_cache is not None else 0

    def _can_alloc(self, pages: int) -> bool:
        return pages <= self.allocator.num_free + self._evictable()

    def _alloc(self, pages: int) -> list[int]:
        """Take ``pages`` pages, evicting unused cached prefixes first when the free list is short."""
        short = pages - self.allocator.num_free
        if short > 0 and self.tree_cache is not None:
            ahead = min(pages * EVICT_AHEAD, self.allocator.num_pages // EVICT_AHEAD_POOL_FRACTION)
            self.allocator.free(self.tree_cache.evict(max(short, ahead)))
        return self.allocator.allocate(pages)

    def _write_row(self, req: Req, start: int, end: int) -> None:
        """Queue table entries [start, end) of a request's row; they travel with its next batch."""
        if end > start:
            ps = self.ps
            cols, slots = self._table_pending.setdefault(req.row, ([], []))
            cols.extend(range(start, end))
            slots.extend(req.pages[p // ps] * ps + p % ps for p in range(start, end))

    def _match(self, req: Req, load: bool = False) -> tuple[list[int], object]:
        """Cached prefix of a waiting request (its last token always recomputed); ``load``: admission's (mem_cache)."""
        if self.tree_cache is None or req.needs_prompt_logprobs:
            return [], None
        return self.tree_cache.match_prefix(req.cache_ids()[: req.seq_len - 1], load_back=load)

    def _release_kv(self, req: Req, cache: bool = True) -> None:
        """Give back a request's pages: its computed tokens go into the prefix cache (page-aligned),
        duplicates and the partial last page to the free list; unlock its cached prefix."""
        tree, ps = self.tree_cache, self.ps
        if tree is not None and cache:
            n = req.kv_done // ps * ps  # KV still in flight is not cached (its forward may yet fail)
            already = tree.insert(req.cache_ids()[:n], req.pages[: n // ps]) if n else 0
            self.allocator.free(req.pages[req.tree_pages : max(req.tree_pages, already // ps)] + req.pages[n // ps :])
        else:
            self.allocator.free(req.pages[req.tree_pages :])
        if req.last_node is not None:
            tree.dec_lock_ref(req.last_node)
        req.pages, req.tree_pages, req.last_node, req.kv_done = [], 0, None, 0

    def _cache_unfinished(self, req: Req) -> None:
        """After a prefill (chunk), share the request's computed prefix through the tree right away,
        so requests admitted next reuse it (SGLang's cache_unfinished_req)."""
        tree, ps = self.tree_cache, self.ps
        n = req.kv_done // ps * ps
        if tree is None or n <= req.tree_pages * ps:
            return
        ids = req.cache_ids()[:n]
        already = tree.insert(ids, req.pages[: n // ps])
        pages, node = tree.match_prefix(ids)
        assert len(pages) == n // ps, "radix insert/match disagree"
        dup = req.pages[req.tree_pages : max(req.tree_pages, already // ps)]
        old_tree = req.tree_pages
        req.pages[: n // ps] = pages
        if dup:
            self.allocator.free(dup)
            self._write_row(req, old_tree * ps, already // ps * ps)
        tree.inc_lock_ref(node)
        if req.last_node is not None:
            tree.dec_lock_ref(req.last_node)
        req.last_node, req.tree_pages = node, n // ps

    def check_accounting(self) -> None:
        """Every usable page is exactly one of: free, held by the tree, privately held by a running request."""
        held = [p for r in self.running for p in r.pages[r.tree_pages :]]
        tree = self.tree_cache.all_pages() if self.tree_cache is not None else []
        pages = sorted(self.allocator._free + tree + held)
        assert pages == list(range(1, self.allocator.num_pages)), "KV pages leaked or double-owned"
        if self.tree_cache is not None:
            self.tree_cache.check()

    # ------------------------------------------------------------------ policy
    def _sort_waiting(self) -> None:
        if len(self.waiting) > 1:  # (a cache-aware order counts prefixes cached in any tier: RadixCache.cached)
            self.waiting = deque(self.policy.order(list(self.waiting), lambda r: self.tree_cache.cached(
                r.cache_ids()[: r.seq_len - 1]) if self.tree_cache is not None and not r.needs_prompt_logprobs else (0, None)))

    # ------------------------------------------------------------------ batching
    def schedule(self) -> tuple[ScheduledBatch | None, list[Req]]:
        """Form the next batch; also returns requests finished by abort since the last step."""
        aborted = self._reap_aborted()
        # a request decodes from its last token, or (overlap scheduling) from the token the in-flight batch
        # is sampling for it unless that token ends it for sure (aborted, at a limit); not a prompt's last chunk
        decodable, ctx, chunked = [], self.context_len, self.chunked_req
        for r in self.running:  # (one pass, no calls: every request of an overlapped decode has d == 0)
            n, out = len(r.prompt_ids), len(r.output_ids)
            if ((d := n + out - r.kv_len) == 1 or (d == 0 and not r.aborted and out + 1 < r.params.max_new_tokens
                                                  and n + out + 1 < ctx)) and r is not chunked:
                decodable.append(r)
        prefill: list[tuple[Req, int]] = []
        if not (self._chunk_ran_last and decodable and not self.enable_mixed_chunk):
            prefill = self._get_prefill(decodable)
        self._chunk_ran_last = bool(prefill) and self.chunked_req is not None
        if prefill:
            reqs, lens = [r for r, _ in prefill], [n for _, n in prefill]
            self.prefill_tokens += sum(lens)
            if self.enable_mixed_chunk and decodable:
                need = sum(1 for r in decodable if r.kv_len % self.ps == 0)
                if self._can_alloc(need):
                    reqs, lens = reqs + decodable, lens + [1] * len(decodable)
            return self._build(reqs, lens, prefill=True), aborted
        if decodable:
            decodable = self._ensure_decode_memory(decodable)
            self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio)
            if (steps := self._continuous_steps(decodable)) > 1:
                return self._build_steps(decodable, steps), aborted
            if self.speculator is not None and (verify := self.speculator.verify_batch(self, decodable)) is not None:
                return verify, aborted
            return self._build_decode(decodable), aborted
        return None, aborted

    def needs_results(self) -> str:
        """Why the next batch must wait for the in-flight one's results (overlap; "" if not): multi-step decodes,
        a batch that may verify drafts (their tokens follow the last one), a request with a token in
        flight whose sampling reads its outputs (``host_read``)."""
        if self.decode_steps > 1:
            return "--num-continuous-decode-steps"
        if self.speculator is not None and self.speculator.may_verify(self.running):
            return "a speculative verify"
        return next((why for r in self.running if (why := host_read(r, overlap=True)) and r.kv_len == r.seq_len), "")

    def _continuous_steps(self, reqs: list[Req]) -> int:
        """How many decode steps ``reqs`` run in one batch: up to ``decode_steps`` while nothing
        waits for admission (a new request then waits for at most one batch), where no request
        needs a step's result before the next (``multi_token_ok``), within every request's
        ``max_new_tokens`` and the context length, and where the pool holds every step's pages."""
        k = self.decode_steps
        if k <= 1 or self.waiting or self.chunked_req is not None or self.speculator is not None:
            return 1
        for r in reqs:
            if not multi_token_ok(r):
                return 1
            k = min(k, r.params.max_new_tokens - len(r.output_ids), self.context_len - r.seq_len)
        if k > 1:
            pages_for = self.allocator.pages_for
            if not self._can_alloc(sum(max(0, pages_for(r.kv_len + k) - len(r.pages)) for r in reqs)):
                return 1
        return max(k, 1)

    def _build_steps(self, reqs: list[Req], steps: int) -> ScheduledBatch:
        """``steps`` decode steps: their pages, slots (step-major) and table entries taken now."""
        ps, b = self.ps, len(reqs)
        locs = [0] * (b * steps)
        writes: tuple[list[int], list[int], list[int]] = ([], [], [])
        rows, cols, slots = writes
        for i, req in enumerate(reqs):
            self._take_queued(req, writes)
            start = req.kv_len
            self._grow(req, start + steps)
            for k in range(steps):
                pos = start + k
                locs[k * b + i] = slot = req.pages[pos // ps] * ps + pos % ps
                rows.append(req.row)
                cols.append(pos)
                slots.append(slot)
            req.kv_len = start + steps  # process() sets it back to the tokens kept
            req.future_index = -1  # (needs_results: nothing is built on a multi-step batch's tokens)
        return ScheduledBatch(reqs, [1] * b, [r.token_at(r.kv_len - steps) for r in reqs],
                              [r.kv_len - steps for r in reqs], locs, False, writes, steps,
                              rows=[r.row for r in reqs], seq_lens=[r.kv_len for r in reqs], live=list(range(b)))

    def _get_prefill(self, decodable: list[Req]) -> list[tuple[Req, int]]:
        """Admit what fits: the ongoing chunked request first, then waiting requests in policy order."""
        ps = self.ps
        out: list[tuple[Req, int]] = []
        rem_input = self.max_prefill_tokens
        rem_chunk = self.chunked_prefill_size
        claimed = 0  # pages this batch will allocate
        if self.chunked_req is not None:
            req = self.chunked_req
            left = req.seq_len - req.kv_len
            n = left if rem_chunk is None or left <= rem_chunk else rem_chunk // ps * ps
            need = self.allocator.pages_for(req.kv_len + n) - len(req.pages)
            if n <= 0 or not self._can_alloc(need):
                return []  # no room yet: running requests decode (and free pages) first
            if n == left:
                self.chunked_req = None
            out.append((req, n))
            claimed += need
            rem_input -= n
            if rem_chunk is not None:
                rem_chunk -= n
            if self.chunked_req is not None:
                return out
        if not self.waiting:
            return out
        self._sort_waiting()
        # estimated future tokens of what already runs (SGLang's rem_total_token_offset)
        offset = sum(min(r.params.max_new_tokens - len(r.output_ids), CLIP_MAX_NEW_TOKENS) * self.new_token_ratio
                     + (r.seq_len - r.kv_len - (1 if r.kv_len == r.seq_len - 1 else 0))
                     for r in self.running)
        for _, n in out:
            offset -= n
        skipped: list[Req] = []  # waiting requests whose LoRA adapter would exceed --max-loras-per-batch
        while self.waiting and len(self.running) < self.max_running and self.table.num_free:
            req = self.waiting[0]
            if req.aborted or len(out) >= self.prefill_max_requests:  # (aborted since the reap: dropped next step)
                break
            if req.lora_id and self.max_loras and len({r.lora_id for r in self.running if r.lora_id} | {req.lora_id}) > self.max_loras:
                skipped.append(self.waiting.popleft())
                continue
            pages, node = self._match(req, load=True)
            prefix = len(pages) * ps
            extend = req.seq_len - prefix
            if out and extend > rem_input:
                break
            chunked = False
            if rem_chunk is not None and extend > rem_chunk and not req.needs_prompt_logprobs:
                extend = rem_chunk // ps * ps
                if extend <= 0:
                    break
                chunked = True
            elif rem_chunk is not None and extend > rem_chunk and out:
                break
            future = min(req.params.max_new_tokens - len(req.output_ids), CLIP_MAX_NEW_TOKENS)
            if node is not None:
                self.tree_cache.inc_lock_ref(node)  # before counting evictable pages: ours are not
            need = self.allocator.pages_for(prefix + extend) - len(pages)
            budget = self.allocator.num_free + self._evictable() - claimed
            rem_total = budget * ps - offset
            fits = need <= budget and (not (self.running or out) or
                                       (req.seq_len - prefix) + future + ps <= rem_total)
            if not fits:
                if node is not None:
                    self.tree_cache.dec_lock_ref(node)
                break
            self.waiting.popleft()
            req.row, req.forward_entry_time = self.table.alloc_row(), req.forward_entry_time or time.perf_counter()
            req.pages, req.tree_pages, req.last_node, req.kv_len = list(pages), len(pages), node, prefix
            req.kv_done = prefix
            self._write_row(req, 0, prefix)
            if req.num_retractions == 0:
                req.cached_tokens = prefix
            if self.tree_cache is not None:
                self.tree_cache.record(prefix, req.seq_len)
            self.running.append(req)
            out.append((req, extend))
            claimed += need
            offset += (req.seq_len - prefix - extend) + future
            rem_input -= extend
            if rem_chunk is not None:
                rem_chunk -= extend
            if chunked:
                self.chunked_req = req
                break
            if rem_input <= 0 or (rem_chunk is not None and rem_chunk <= 0):
                break
        self.waiting.extendleft(reversed(skipped))
        return out

    def _ensure_decode_memory(self, decodable: list[Req]) -> list[Req]:
        """Retract requests (``SchedulePolicy.retraction_victim``'s first) until the decode step's new pages fit."""
        ps = self.ps
        need = sum(1 for r in decodable if r.kv_len % ps == 0)
        if self._can_alloc(need):
            return decodable
        retracted: list[Req] = []
        while not self._can_alloc(need):
            victims = [r for r in reversed(self.running) if not (len(decodable) == 1 and r is decodable[0])]
            if not victims:
                break
            victim = self.policy.retraction_victim(victims)
            if victim in decodable:
                decodable.remove(victim)
                need -= 1 if victim.kv_len % ps == 0 else 0
            self._retract(victim)
            retracted.append(victim)
        if not self._can_alloc(need):
            raise RuntimeError("the KV pool cannot hold a single request; this is a bug in admission limits")
        for r in reversed(retracted):  # oldest retracted first at the head of the queue
            self.waiting.appendleft(r)
        decoded = sum(len(r.output_ids) for r in self.running)
        max_new = sum(r.params.max_new_tokens for r in self.running)
        self.new_token_ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(self.running)) / max(max_new, 1))
        self.num_retracted += len(retracted)
        log.warning("scheduler.retract", num_retracted=len(retracted), rids=[r.rid for r in retracted],
                    running=len(self.running), new_token_ratio=round(self.new_token_ratio, 4),
                    free_pages=self.allocator.num_free, evictable_pages=self._evictable())
        return decodable

    def _retract(self, req: Req) -> None:
        """Back to the queue with its generated tokens (and detokenizer state); its KV goes to the cache."""
        if req is self.chunked_req:
            self.chunked_req = None
        self._release_kv(req)
        self._table_pending.pop(req.row, None)
        self.table.free_row(req.row)
        req.row, req.kv_len = -1, 0
        req.num_retractions += 1
        self.running.remove(req)

    def _take_queued(self, req: Req, writes: tuple[list[int], list[int], list[int]]) -> None:
        """Move ``req``'s queued table entries (``_write_row``) into a batch's ``writes``."""
        if self._table_pending and (queued := self._table_pending.pop(req.row, None)) is not None:
            writes[0].extend([req.row] * len(queued[0]))
            writes[1].extend(queued[0])
            writes[2].extend(queued[1])

    def _grow(self, req: Req, end: int) -> None:
        """Take pages until ``req`` holds positions [0, end)."""
        if (need := self.allocator.pages_for(end) - len(req.pages)) > 0:
            req.pages += self._alloc(need)

    def _build(self, reqs: list[Req], extend_lens: list[int], prefill: bool) -> ScheduledBatch:
        """Take pages for the new tokens and list their slots (and the table entries to write)."""
        ps = self.ps
        input_ids: list[int] = []
        rows: list[int] = []
        positions: list[int] = []
        locs: list[int] = []
        extra: tuple[list[int], list[int], list[int]] = ([], [], [])
        live: list[int] = []
        futures = False
        for i, (req, n) in enumerate(zip(reqs, extend_lens)):
            self._take_queued(req, extra)
            start = end = req.kv_len
            end += n
            self._grow(req, end)
            pages = req.pages
            positions.extend(range(start, end))
            locs.extend(pages[start:end] if ps == 1 else (pages[p // ps] * ps + p % ps for p in range(start, end)))
            rows.extend([req.row] * n)
            if start < req.seq_len:
                input_ids.extend(req.tokens(start, end))
            else:  # a decode under overlap scheduling: the token the in-flight batch samples for it
                input_ids.append(future_id(req.future_index))
                futures = True
            req.kv_len = end
            if end >= req.seq_len:  # samples a token (a non-final prompt chunk does not)
                live.append(i)
                req.future_index = i
        writes = (rows, positions, locs) if not extra[0] else (extra[0] + rows, extra[1] + positions, extra[2] + locs)
        return ScheduledBatch(reqs, extend_lens, input_ids, positions, locs, prefill, writes, rows=[r.row for r in reqs],
                              seq_lens=[r.kv_len for r in reqs], live=live, futures=futures)

    def _build_decode(self, reqs: list[Req]) -> ScheduledBatch:
        """A decode batch: ``_build`` for one token each, in a few passes over the batch (its pages
        taken in one allocation, in the same order): ~3 us a request a step was ``_build``'s loop."""
        ps, b = self.ps, len(reqs)
        extra: tuple[list[int], list[int], list[int]] = ([], [], [])
        for req in reqs if self._table_pending else ():
            self._take_queued(req, extra)
        positions = [r.kv_len for r in reqs]
        grow = [r for r, p in zip(reqs, positions) if p >= len(r.pages) * ps]  # at a page boundary
        for r, page in zip(grow, self._alloc(len(grow)) if grow else ()):
            r.pages.append(page)
        locs, input_ids, rows = [], [], []
        futures = False
        for i, r in enumerate(reqs):  # (one pass: ~1 us a request where a pass per list took ~1.5)
            p = r.kv_len
            locs.append(r.pages[p] if ps == 1 else r.pages[p // ps] * ps + p % ps)
            rows.append(r.row)
            out, j = r.output_ids, p - len(r.prompt_ids)
            if j < len(out):
                input_ids.append(out[j] if j >= 0 else r.prompt_ids[p])
            else:  # overlap scheduling: the token the in-flight batch samples for it
                input_ids.append(future_id(r.future_index))
                futures = True
            r.kv_len, r.future_index = p + 1, i
        writes = (rows, positions, locs) if not extra[0] else (extra[0] + rows, extra[1] + positions, extra[2] + locs)
        return ScheduledBatch(reqs, [1] * b, input_ids, positions, locs, False, writes, rows=rows,
                              seq_lens=[p + 1 for p in positions], live=list(range(b)), futures=futures)

    # ------------------------------------------------------------------ results
    def process(self, batch: ScheduledBatch, result: StepResult) -> list[tuple[Req, str]]:
        """Append sampled tokens, detokenize, check stop conditions, free finished requests.

        Returns (request, new text) for every request in the batch."""
        now = time.perf_counter()
        s = result.sample
        toks, lps, prompt_lps = s.token_ids, s.logprobs, result.input_logprobs
        updates: list[tuple[Req, str]] = []
        # (hoisted: a decode of 256 requests took ~2 us a request through the attribute chains)
        drafts, rows, seq_lens, multi, check = batch.drafts, batch.rows, batch.seq_lens, batch.steps > 1, self._check_finish
        spec, prefill, hidden = self.speculator is not None, batch.is_prefill, result.hidden
        for i, req in enumerate(batch.reqs):
            if req.row != rows[i]:  # retracted (or failed) after this batch was built (overlap): its token
                batch.drop_token(req)  # is dropped, recomputed after readmission (as SGLang does) with its own draw
                continue
            # this batch's KV is written (a verify's draft positions: only those kept below)
            req.kv_done = seq_lens[i] - (len(drafts[i]) if drafts else 0)
            if drafts is not None:
                if not (req.finished or req.aborted):  # the draft tokens the target agrees with, and its own next
                    kept = self.speculator.kept(req, drafts[i], *result.kept[i], batch.draft_parents and batch.draft_parents[i])
                    updates.append((req, self._append_steps(req, kept, now)))
                    continue
            if prompt_lps and i in prompt_lps:
                req.input_logprobs, req.input_top_logprobs, req.input_token_ids_logprobs = prompt_lps[i]
            if s.failed and i in s.failed and req.finish_reason is None:  # its logit processor failed: as an abort
                req.finish_reason = {"type": "abort", "message": s.failed[i]}
            if req.finish_reason is not None or req.aborted:  # aborted while the forward ran: dropped at the next step
                if multi:  # a multi-step decode's entries after the first are not kept
                    req.kv_len = req.kv_done = req.seq_len
                updates.append((req, ""))
                continue
            out = req.output_ids
            if seq_lens[i] < len(req.prompt_ids) + len(out):  # a chunk of a longer prompt: nothing sampled yet
                self._cache_unfinished(req)
                continue
            if req.params.max_new_tokens == 0:  # prompt-only request (e.g. for prompt logprobs)
                req.finish_reason = {"type": "length", "length": 0}
                updates.append((req, ""))
                continue
            tok = toks[i]
            if multi:  # a multi-step decode: its tokens up to the first that finishes the request
                updates.append((req, self._append_steps(req, [tok] + [t[i] for t in result.more_tokens], now)))
                continue
            out.append(tok)  # (SGLang counts every decode: each token after the first, mixed or re-prefilled)
            if hidden and i in hidden:  # its forward's state (core.engine.hidden_states), kept with the token
                req.add_hidden(hidden[i])
            if spec:
                req.spec_verify_ct += len(out) > 1
            if req.first_token_time is None:
                req.first_token_time = now
            if lps is not None and req.return_logprob:
                req.add_logprobs(s, i)
            delta = check(req, tok)
            if delta:
                req.text += delta
            updates.append((req, delta))
            if prefill and req.finish_reason is None:
                self._cache_unfinished(req)
        for req in [r for r in self.running if r.finish_reason is not None]:
            self._free(req)
            req.finish_time = now
        return updates

    def _append_steps(self, req: Req, tokens: list[int], now: float) -> str:
        """Append a multi-step decode's or a verify's ``tokens`` until one finishes the request
        and return the new text; ``kv_len`` (and ``kv_done``) end one behind ``seq_len`` (the slots of
        entries not kept stay in its pages, to be rewritten or freed)."""
        req.kv_len = req.seq_len - 1
        delta = ""
        for tok in tokens:
            req.output_ids.append(tok)
            req.kv_len += 1
            delta += self._check_finish(req, tok)
            if req.finished:
                break
        if req.first_token_time is None:
            req.first_token_time = now
        req.text += delta
        req.kv_done = req.kv_len  # the kept tokens' inputs: their KV is written
        return delta

    def _check_finish(self, req: Req, tok: int) -> str:
        p, detok = req.params, req.detokenizer
        hit_eos = (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids
        delta = ""
        if detok is not None and (not hit_eos or p.no_stop_trim):  # (SGLang keeps a matched stop token
            delta = detok.add([tok])  # with no_stop_trim: its text, unless a skipped special token)
        if hit_eos:
            req.finish_reason = {"type": "stop", "matched": tok}
        elif detok is not None and detok.matched_stop is not None:
            req.finish_reason = {"type": "stop", "matched": detok.matched_stop}
        elif req.grammar is not None and req.grammar.is_terminated():  # constrained output complete: its last
            req.finish_reason = {"type": "stop", "matched": tok}  # token, as SGLang reports it (EOS under ignore_eos)
        elif (n := len(req.output_ids)) >= p.max_new_tokens or len(req.prompt_ids) + n >= self.context_len:
            req.finish_reason = {"type": "length", "length": n}
        else:
            return delta
        if detok is not None and detok.matched_stop is None:
            delta += detok.flush()
        return delta

    def fail(self, reqs: list[Req], message: str) -> None:
        """Finish requests whose forward failed, returning their pages (their KV is not cached)."""
        now = time.perf_counter()
        for req in reqs:
            if not req.finished:
                req.finish_reason, req.finish_time = {"type": "abort", "message": message}, now
            if req.row >= 0:
                self._free(req, cache=False)
            elif req in self.waiting:
                self.waiting.remove(req)

    def fail_all(self, message: str) -> list[Req]:
        """Finish every queued and running request with ``message`` and return them: the containment
        for a scheduling bug, after which no request's state can be trusted. Afterwards nothing is
        queued or running and the pool is consistent; if freeing the requests one by one cannot
        restore that, the prefix cache is dropped and every page and table row is given back wholesale."""
        reqs = [*self.waiting, *self.running]
        self.waiting.clear()
        try:
            self.fail(reqs, message)
            self.check_accounting()
            assert self.table.num_free == self.table.table.shape[0], "table rows leaked"
        except Exception:
            log.exception("scheduler.reset_after_failure")
            self._reset_pool(reqs, message)
        return reqs

    def _reset_pool(self, reqs: list[Req], message: str) -> None:
        """A fresh scheduler's state: nothing queued or running, the prefix cache empty (its locks
        may be wrong), every page and table row free; ``reqs`` finished with ``message``."""
        now = time.perf_counter()
        for req in reqs:
            if not req.finished:
                req.finish_reason, req.finish_time = {"type": "abort", "message": message}, now
            req.row, req.pages, req.tree_pages, req.last_node = -1, [], 0, None
        self.waiting.clear()
        self.running.clear()
        self.chunked_req, self._chunk_ran_last = None, False
        self._table_pending.clear()
        if self.tree_cache is not None:
            self.tree_cache.protected_pages = 0
            self.tree_cache.reset()
        self.allocator._free = list(range(self.allocator.num_pages - 1, 0, -1))
        self.table._free_rows = list(range(self.table.table.shape[0] - 1, -1, -1))

    def _reap_aborted(self) -> list[Req]:
        gone = [r for r in self.waiting if r.aborted] + [r for r in self.running if r.aborted and not r.finished]
        if not gone:
            return []
        self.waiting = deque(r for r in self.waiting if not r.aborted)
        now = time.perf_counter()
        for req in gone:
            req.finish_reason = {"type": "abort", "message": req.abort_message}
            req.finish_time = now
            if req.row >= 0:
                self._free(req)
        return gone

    def _free(self, req: Req, cache: bool = True) -> None:
        if req is self.chunked_req:
            self.chunked_req = None
        self._release_kv(req, cache)
        self._table_pending.pop(req.row, None)
        self.table.free_row(req.row)
        req.row = -1
        self.running.remove(req)

