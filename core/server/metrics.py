"""Prometheus metrics with SGLang's names (``sglang:...``), fed by the engine's listeners.

Counters and latency histograms are updated from ``engine.finish_listeners`` and
``engine.step_listeners``; the load gauges (running / queued requests, token usage)
are read from ``AsyncEngine.load()`` when ``/metrics`` is scraped, so they are
exact even when the engine is idle (an abort between steps shows at once).

Each ``Metrics`` owns a private ``CollectorRegistry``: several servers (or tests) in
one process never collide in prometheus-client's global registry.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from core.engine import AsyncEngine
    from core.engine.request import Req
    from core.engine.scheduler import ScheduledBatch

# Requests the server makes to itself (warm-up, /health_generate) stay out of the metrics.
INTERNAL_RID_PREFIXES = ("HEALTH_CHECK_", "WARMUP_")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                15.0, 20.0, 25.0, 30.0, 60.0)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08, 0.1, 0.2,
               0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 150.0,
               200.0, 250.0, 300.0, 350.0, 500.0, 1000.0)
# SGLang's prompt / generation token-length histograms' default bounds (--prompt-tokens-buckets default)
TOKEN_BUCKETS = (100, 300, 500, 700, 1000, 1500, 2000, 3000, 4000, 5000, 6000, 7000, 8000, 9000, 10000, 12500,
                 15000, 17500, 20000, 22500, 25000, 27500, 30000, 35000, 40000, 60000, 80000, 100000, 200000,
                 300000, 400000, 600000, 800000, 1000000, 1100000)
THROUGHPUT_WINDOW_S = 10.0

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """SGLang-named metrics for one served model; ``enabled=False`` makes every method a no-op.
    ``buckets``: histogram bounds by attribute name (``ttft``, ``itl``...), from SGLang's bucket flags
    (``core.server.observability``); the others keep their defaults."""

    def __init__(self, model_name: str, enabled: bool = True, buckets: dict[str, tuple[float, ...]] | None = None) -> None:
        self.enabled = enabled
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self._started = time.perf_counter()
        self._gen_window: deque[tuple[float, int]] = deque()  # (time, tokens generated in a step)
        self._last_token_time: dict[Any, float] = {}  # Req -> time of its latest token (for ITL)
        self._engine: AsyncEngine | None = None
        labels = ["model_name"]
        reg = self.registry

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=reg)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=reg)

        def hist(name: str, doc: str, default: tuple[float, ...], key: str) -> Histogram:
            return Histogram(name, doc, labels, buckets=(buckets or {}).get(key, default), registry=reg)

        # counters (prometheus-client appends _total)
        self.prompt_tokens = counter("sglang:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("sglang:generation_tokens", "Number of generation tokens processed.")
        self.cached_tokens = counter("sglang:cached_tokens", "Number of cached prompt tokens.")
        self.num_requests = counter("sglang:num_requests", "Number of requests processed.")
        self.num_aborted_requests = counter("sglang:num_aborted_requests", "Number of requests aborted.")
        # histograms
        self.ttft = hist("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS, "ttft")
        self.itl = hist("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        ITL_BUCKETS, "itl")
        self.tpot = hist("sglang:time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                         ITL_BUCKETS, "tpot")
        self.e2e = hist("sglang:e2e_request_latency_seconds", "Histogram of end-to-end request latency in seconds.",
                        E2E_BUCKETS, "e2e")
        self.prompt_tokens_hist = hist("sglang:prompt_tokens_histogram", "Histogram of prompt token length.",
                                       TOKEN_BUCKETS, "prompt_tokens_hist")
        self.uncached_prompt_tokens_hist = hist("sglang:uncached_prompt_tokens_histogram", "Histogram of uncached "
                                                "(compute) prompt token length.", TOKEN_BUCKETS,
                                                "uncached_prompt_tokens_hist")
        self.generation_tokens_hist = hist("sglang:generation_tokens_histogram", "Histogram of generation token "
                                           "length.", TOKEN_BUCKETS, "generation_tokens_hist")
        # gauges (load ones refreshed at scrape time)
        self.num_running_reqs = gauge("sglang:num_running_reqs", "The number of running requests.")
        self.num_queue_reqs = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        self.num_used_tokens = gauge("sglang:num_used_tokens", "The number of used tokens.")
        self.token_usage = gauge("sglang:token_usage", "The token usage.")
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "The prefix cache hit rate.")
        self.gen_throughput = gauge("sglang:gen_throughput", "The generation throughput (token/s).")
        self.max_total_num_tokens = gauge("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV pool.")
        self.max_running_requests = gauge("sglang:max_running_requests", "Maximum number of running requests.")
        self.is_ready = gauge("sglang:is_ready", "1 when the server is ready to serve requests.")
        self.spec_accept_length = gauge("sglang:spec_accept_length", "Mean acceptance length of speculative decoding "
                                        "(tokens per verify forward, over finished requests).")
        self.spec_accept_rate = gauge("sglang:spec_accept_rate", "Speculative acceptance rate (accepted drafts / "
                                      "proposed drafts, over finished requests).")
        self._spec = [0, 0, 0, 0]  # tokens, verifies, correct drafts, proposed drafts of finished requests
        # HiCache's host and storage tiers (core.engine.mem_cache.hierarchical; SGLang exports none of its own for them):
        # counters follow the cache's cumulative stats at scrape time, zero while the tier is off
        self.hicache = {
            "host_hit_tokens": counter("core:hicache_host_hit_tokens", "Prompt tokens served from the host tier "
                                       "(loaded back instead of prefilled)."),
            "bytes_to_host": counter("core:hicache_device_to_host_bytes", "KV bytes copied from the device pool "
                                     "to the host pool (backups)."),
            "bytes_to_device": counter("core:hicache_host_to_device_bytes", "KV bytes copied from the host pool "
                                       "back to the device pool (load-backs)."),
            "load_seconds": counter("core:hicache_load_back_seconds", "Host seconds spent issuing KV loads back from "
                                    "the host tier (on a GPU the copies then run on their own stream)."),
            "backup_seconds": counter("core:hicache_backup_seconds", "Seconds spent copying KV to the host tier."),
            "host_evicted_pages": counter("core:hicache_host_evicted_pages", "Host-tier pages dropped to make room "
                                          "in the host pool."),
            "storage_hit_tokens": counter("core:hicache_storage_hit_tokens", "Prompt tokens served from the storage "
                                          "tier (read into the host pool and loaded back)."),
            "bytes_to_storage": counter("core:hicache_host_to_storage_bytes", "KV bytes written to the storage tier."),
            "bytes_from_storage": counter("core:hicache_storage_to_host_bytes", "KV bytes read from the storage tier."),
            "storage_read_seconds": counter("core:hicache_storage_read_seconds", "Seconds admissions spent reading "
                                            "the storage tier."),
            "storage_write_seconds": counter("core:hicache_storage_write_seconds", "Seconds the background writer "
                                             "spent writing to the storage tier."),
            "storage_failed_writes": counter("core:hicache_storage_failed_writes", "Pages the storage backend could "
                                             "not store."),
        }
        self.hicache_host_used_tokens = gauge("core:hicache_host_used_tokens", "Tokens held by the host KV pool.")
        self.hicache_host_total_tokens = gauge("core:hicache_host_total_tokens", "Capacity of the host KV pool in tokens.")
        self._hicache_seen: dict[str, float] = {}

    # ------------------------------------------------------------------ wiring
    def attach(self, engine: AsyncEngine) -> None:
        """Register the listeners on the engine (only when enabled)."""
        self._engine = engine
        if not self.enabled:
            return
        engine.step_listeners.append(self.on_step)
        engine.finish_listeners.append(self.on_finish)
        self.max_total_num_tokens.labels(self.model_name).set(engine.max_total_tokens)
        self.max_running_requests.labels(self.model_name).set(engine.max_running_requests)

    # ------------------------------------------------------------------ listeners (loop thread, never raise)
    def on_step(self, batch: ScheduledBatch, duration: float) -> None:
        """A step ran; its results are processed right after the listeners, so the tokens each request
        gained (a verify's accepted ones, a multi-step decode's up to its stop) are counted once they
        are in (``_after_step``, next on the loop)."""
        try:
            now = time.perf_counter()
            counts = [(req, len(req.output_ids)) for req in batch.reqs if not (
                req.finished or req.aborted or req.params.max_new_tokens == 0 or req.kv_len < req.seq_len)]
            try:
                asyncio.get_running_loop().call_soon(self._after_step, counts, now)
            except RuntimeError:  # no loop (a listener driven by hand): the step's tokens as scheduled
                self._after_step(counts, now, batch.steps_run)
        except Exception:  # a metrics bug must never break serving
            pass

    def _after_step(self, counts: list[tuple[Req, int]], now: float, steps: int | None = None) -> None:
        """Each request's new tokens into the throughput window and, after its first token, into the
        ITL histogram: a gap over n tokens is n observations of gap / n, as SGLang's."""
        try:
            tokens = 0
            for req, before in counts:
                new = steps if steps is not None else len(req.output_ids) - before
                if new <= 0:
                    continue
                tokens += new
                if req.rid.startswith(INTERNAL_RID_PREFIXES) or not req.log_metrics:
                    continue
                last = self._last_token_time.get(req)
                if last is not None:
                    for _ in range(new):
                        self.itl.labels(self.model_name).observe((now - last) / new)
                self._last_token_time[req] = now
            self._gen_window.append((now, tokens))
            self._trim(now)
        except Exception:  # a metrics bug must never break serving
            pass

    def on_finish(self, req: Req) -> None:
        try:
            try:  # (after the step's ``_after_step``, which may still observe its last gap)
                asyncio.get_running_loop().call_soon(self._last_token_time.pop, req, None)
            except RuntimeError:
                self._last_token_time.pop(req, None)
            if req.rid.startswith(INTERNAL_RID_PREFIXES) or not req.log_metrics:
                return
            m = self.model_name
            n_out = len(req.output_ids)
            self.num_requests.labels(m).inc()
            self.prompt_tokens.labels(m).inc(len(req.prompt_ids))
            self.generation_tokens.labels(m).inc(n_out)
            self.cached_tokens.labels(m).inc(req.cached_tokens)
            self.prompt_tokens_hist.labels(m).observe(len(req.prompt_ids))
            self.uncached_prompt_tokens_hist.labels(m).observe(len(req.prompt_ids) - req.cached_tokens)
            self.generation_tokens_hist.labels(m).observe(n_out)
            if (req.finish_reason or {}).get("type") == "abort":
                self.num_aborted_requests.labels(m).inc()
            end = req.finish_time or time.perf_counter()
            self.e2e.labels(m).observe(end - req.arrival)
            if req.spec_verify_ct:
                t = self._spec
                t[0], t[1] = t[0] + n_out, t[1] + req.spec_verify_ct
                t[2], t[3] = t[2] + req.spec_num_correct_drafts, t[3] + req.spec_num_proposed_drafts
                self.spec_accept_length.labels(m).set(t[0] / t[1])
                if t[3]:
                    self.spec_accept_rate.labels(m).set(t[2] / t[3])
            if req.first_token_time is not None:
                self.ttft.labels(m).observe(req.first_token_time - req.arrival)
                if n_out > 1:
                    self.tpot.labels(m).observe((end - req.first_token_time) / (n_out - 1))
        except Exception:
            pass

    def _trim(self, now: float) -> None:
        while self._gen_window and now - self._gen_window[0][0] > THROUGHPUT_WINDOW_S:
            self._gen_window.popleft()

    def spec_report(self) -> dict[str, float]:
        """SGLang's ``avg_spec_accept_length`` (its bench_serving reads it from ``/server_info``): the
        finished requests' tokens per verify; empty before any."""
        tokens, verifies = self._spec[0], self._spec[1]
        return {"avg_spec_accept_length": tokens / verifies} if verifies else {}

    def throughput(self) -> float:
        """Generated tokens per second over the last ``THROUGHPUT_WINDOW_S`` (0 when disabled)."""
        now = time.perf_counter()
        self._trim(now)
        span = min(THROUGHPUT_WINDOW_S, max(now - self._started, 1e-3))
        return sum(t for _, t in self._gen_window) / span

    # ------------------------------------------------------------------ scrape
    def refresh(self, ready: bool = True) -> None:
        """Read the live load gauges from the engine."""
        m = self.model_name
        self.is_ready.labels(m).set(1 if ready else 0)
        engine = self._engine
        if engine is None:
            return
        load = engine.load()
        self.num_running_reqs.labels(m).set(load["num_running_reqs"])
        self.num_queue_reqs.labels(m).set(load["num_waiting_reqs"])
        self.num_used_tokens.labels(m).set(load["num_used_tokens"])
        self.token_usage.labels(m).set(load["token_usage"])
        self.cache_hit_rate.labels(m).set(load["cache_hit_rate"])  # cumulative cached / prompt tokens of admitted prefills
        self.gen_throughput.labels(m).set(self.throughput())
        self._refresh_hicache(engine)

    def _refresh_hicache(self, engine: AsyncEngine) -> None:
        """Bring the host tier's counters up to the cache's cumulative stats (a no-op without the tier)."""
        stats_of = (getattr(engine, "tier_stats", None)  # (replicas in other processes: their reports)
                    or getattr(getattr(engine, "tree_cache", None), "tier_stats", None))
        if stats_of is None or (stats := stats_of()) is None:
            return
        m = self.model_name
        for key, c in self.hicache.items():
            if (delta := stats[key] - self._hicache_seen.get(key, 0)) > 0:
                c.labels(m).inc(delta)
            self._hicache_seen[key] = stats[key]
        self.hicache_host_used_tokens.labels(m).set(stats["host_used_tokens"])
        self.hicache_host_total_tokens.labels(m).set(stats["host_total_tokens"])

    def render(self, ready: bool = True) -> bytes:
        self.refresh(ready)
        return generate_latest(self.registry)
