"""SGLang's scheduler log lines: one per prefill batch (``scheduler.prefill_batch``: new sequences,
new and cached prompt tokens, KV token usage, running and queued requests) and one every
``--decode-log-interval`` decode batches (``scheduler.decode_batch``: running requests, KV tokens
in use, token usage, generated tokens per second since the last such line, queued requests), at
info level: what an operator used to SGLang's "Prefill batch" / "Decode batch" lines reads. A step
listener: it runs after each forward, before the batch's results are processed."""

from __future__ import annotations

import time
from typing import Any

import structlog

log = structlog.get_logger("core.engine.scheduler")


class BatchLog:
    """The engine's step listener for the batch log lines (``on_step``). A decode batch's tokens
    are counted as its rows times its steps; a speculative verify's (how many drafts it kept is
    known only after its results) at the next step."""

    def __init__(self, engine: Any, interval: int) -> None:
        self.engine, self.interval = engine, interval
        self.decodes, self.tokens, self.since = 0, 0, time.perf_counter()
        self._verify: list[tuple[Any, int]] = []  # the last verify's requests and their output lengths then

    def on_step(self, batch: Any, elapsed: float) -> None:
        if self._verify:  # (its results are in now)
            self.tokens += sum(len(r.output_ids) - n for r, n in self._verify)
            self._verify = []
        if batch.is_prefill:
            load = self.engine.load()
            # cached: the prefix-cache hits of the sequences starting here (a later chunk's start is no hit)
            cached = sum(start for r, n, e in zip(batch.reqs, batch.seq_lens, batch.extend_lens)
                         if (start := n - e) == r.cached_tokens)
            log.info("scheduler.prefill_batch", new_seq=len(batch.reqs), new_token=sum(batch.extend_lens),
                     cached_token=cached, token_usage=round(load["token_usage"], 2),
                     running_req=load["num_running_reqs"], queue_req=load["num_waiting_reqs"])
            return
        if getattr(batch, "drafts", None) is not None:
            self._verify = [(r, len(r.output_ids)) for r in batch.reqs]
        else:
            self.tokens += len(batch.reqs) * batch.steps_run
        self.decodes += 1
        if self.decodes % self.interval:
            return
        now = time.perf_counter()
        load = self.engine.load()
        log.info("scheduler.decode_batch", running_req=load["num_running_reqs"], token=load["num_used_tokens"],
                 token_usage=round(load["token_usage"], 2), gen_throughput=round(self.tokens / max(now - self.since, 1e-9), 2),
                 queue_req=load["num_waiting_reqs"])
        self.tokens, self.since = 0, now
