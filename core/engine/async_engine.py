"""The online engine: one asyncio loop, one scheduler coroutine, the forward on a worker thread.

``AsyncEngine`` lives on the caller's event loop (the HTTP server's, for ``core
serve``); ``core.engine.offline.Engine`` wraps it for SGLang's offline API.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import secrets
import time
from typing import Any, Callable

import structlog
import torch

from core.engine import deterministic, gc_watch, gil_switch, memory_saver, pause
from core.engine.distributed.collectives import KVSpec
from core.engine.device import check_openmp_policy, configure_cpu_runtime, engine_device
from core.engine.distributed.tensor_parallel import RankFailure, start_tensor_parallel
from core.engine.lora.serving import attach_lora
from core.engine.multimodal.engine import attach_multimodal
from core.engine.config import EngineArgs, check_scheduling_args, overlap_schedule
from core.errors import CoreError, InvalidRequest, ModelLoadError, Unavailable
from core.interfaces import AttentionConfig
from core.layers import fused, local_heads
from core.engine.frontend import RequestFrontEnd
from core.engine.mem_cache.kv_cache import (
    PageAllocator, ReqToTokenTable, allocate_kv_cache, cpu_kv_tokens, kv_bytes_per_token, kv_cache_dtype,
)
from core.engine.batch_log import BatchLog
from core.engine.model_loader.loader import ModelConfig, load_model_config, pooling_config, with_tokenizer_eos
from core.engine.grammar import GrammarManager, json_whitespace_options
from core.engine.profiler import StepProfiler
from core.engine.model_loader.model_build import build_model
from core.engine.cuda_graph import DEFAULT_MAX_BS, CudaGraphRunner, why_no_cuda_graph
from core.engine.hybrid_attention import attention_backend_name, build_attention_backend
from core.engine.model_runner import ModelRunner
from core.plugins import PluginManager, load_plugins
from core.engine.mem_cache.hierarchical import build_tree_cache
from core.engine.request import Req
from core.engine.sampler import Sampler
from core.engine.scheduler import ScheduledBatch, Scheduler
from core.engine.speculative import build_speculator
from core.engine.speculative.draft_model import EngineDraftContext
from core.engine.watchdog import Watchdog
from core.engine.model_loader.weight_sync import WeightSync
from core.engine.model_loader.weight_update import update_weights

log = structlog.get_logger("core.engine")

DEFAULT_CPU_CHUNKED_PREFILL_SIZE = 2048
CPU_INLINE_DECODE_ROWS = 8  # a CPU decode step of up to this many rows runs on the event loop (_runs_inline)
CPU_INLINE_DECODE_S = 0.010  # as does a larger one that the last decode's pace says takes at most this


class AsyncEngine(RequestFrontEnd):
    """Owns the model, the KV pool and the scheduler; requests go in with ``make_requests`` +
    ``submit`` (or ``generate``) and come out through ``stream``. Every method but the forward
    runs on the caller's event loop; servers ask it about load (``num_waiting``, ``has_work``,
    ``load``...) and abort through it, never through the scheduler."""

    def __init__(self, args: EngineArgs, plugins: PluginManager | None = None) -> None:
        self.args = args
        configure_cpu_runtime(args.cpu_threads)
        self.plugins = plugins or load_plugins(args.plugins, strict=args.strict_plugins)
        self.device = engine_device(args)
        check_openmp_policy(self.device)
        self.model_config: ModelConfig = load_model_config(
            args.model_path, args.dtype, self.device, args.context_length, args.served_model_name, args.json_model_override_args
        )
        self.tokenizer = None if args.skip_tokenizer_init else self._load_tokenizer()
        mc = self.model_config = with_tokenizer_eos(self.model_config, self.tokenizer)
        self.fatal_error: str | None = None  # set once when a tensor-parallel rank fails: the engine has stopped
        self.fatal_listeners: list[Callable[[str], None]] = []  # called on the loop thread with the message
        self._loop_ref: asyncio.AbstractEventLoop | None = None
        self._stopped = False
        self.tp_group = start_tensor_parallel(args, self.device)  # None unless --tp-size > 1
        # unseeded samples differ from one launch to the next, as SGLang's (a random seed when none is given)
        self.random_seed = args.random_seed if args.random_seed is not None else secrets.randbelow(1 << 30)
        try:
            self.model = self.tp_group.load(self._load_model) if self.tp_group else self._load_model()
            fused(torch.empty(0, device=self.device))  # compile the fused-op kernels now, not in the first (watched) step
            self.vocab_size = mc.text_config.vocab_size
            if args.is_embedding and not self.is_classifier:
                pooling_config(mc.path)  # a sentence-transformers layout this server cannot follow: refused at start
            self._build_kv_pool()
        except BaseException:
            if self.tp_group is not None:
                self.tp_group.stop()
            raise
        self.sampler = Sampler(self.vocab_size, self.device, seed=self.random_seed, num_slots=self.table.table.shape[0])
        self.runner = ModelRunner(self.model, self.attn_backend, self.table, self.sampler, mc.eos_ids, self.device)
        if self.tp_group is not None:
            self.runner.tp = self.tp_group
            self.tp_group.on_failure = self._on_rank_failure
        self.grammar = GrammarManager(self.plugins, args.grammar_backend, self.tokenizer, self.vocab_size, mc.eos_ids, json_whitespace_options(args))
        self.runner.grammar, self.runner.speculator, self.runner.kv_cache = self.grammar, self.scheduler.speculator, self.kv_cache
        self.lora, self.multimodal = attach_lora(self), attach_multimodal(self)  # (before the graphs capture LoRA)
        self.runner.graphs = self._capture_cuda_graphs()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="core-forward")
        # small CPU decodes run on the loop's thread (_runs_inline); 0: every forward on the executor
        cpu = self.device.type == "cpu" and self.tp_group is None
        self.inline_decode_rows, self.inline_decode_s = (CPU_INLINE_DECODE_ROWS, CPU_INLINE_DECODE_S) if cpu else (0, 0.0)
        self._decode_row_s = float("inf")  # the last decode's seconds per row, forward to results (_runs_inline)
        self._forward_jobs = 0  # jobs queued or running on the forward thread (_on_forward_thread)
        self.overlap = overlap_schedule(args, self.device)
        self._gil_short = self.overlap and gil_switch.shorten()  # (restored at shutdown)
        self.runner.defer_results = self.overlap and self.device.type == "cuda" and self.tp_group is None
        self.runner.overlap = self.overlap
        if self.scheduler.speculator is not None:
            self.scheduler.speculator.overlap = self.overlap
        # (batch, its forward's future, start time) scheduled but not yet processed (overlap scheduling)
        self._inflight: tuple[ScheduledBatch, asyncio.Future, float] | None = None
        self._overlap_paused: set[str] = set()  # the reasons a step waited for the one in flight, logged once each
        # a step past --watchdog-timeout stops the engine for good, through the same thread-safe path as a failed rank
        self.watchdog = Watchdog(args.watchdog_timeout, self._on_rank_failure, soft_timeout=args.soft_watchdog_timeout)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        # while a weight update runs: requests submitted meanwhile, admitted once it is done (None: no update)
        self._held: list[Req] | None = None
        self.paused, self.parked = False, asyncio.Event()  # /pause_generation (core.engine.pause): the loop waits
        self._update_lock = asyncio.Lock()  # one weight update at a time
        self.weight_sync = WeightSync(self)  # weights from a trainer, in place (RL: core.engine.model_loader.weight_sync)
        self.memory_saver = memory_saver.MemorySaver(self)  # --enable-memory-saver's release and resume
        self.log = log
        # Observers (metrics, request logs): called on the loop thread, must be cheap and never raise.
        self.step_listeners: list[Callable[[ScheduledBatch, float], None]] = []
        self.finish_listeners: list[Callable[[Req], None]] = [] if self.lora is None else [self.lora.release]
        self.profiler = StepProfiler(self._executor, self.device)  # /start_profile, /stop_profile
        self.step_listeners += [self.profiler.on_step, BatchLog(self, args.decode_log_interval).on_step]
        self.plugins.pm.hook.on_startup(engine=self)

    # ------------------------------------------------------------------ start-up
    def _load_tokenizer(self):
        from transformers import AutoTokenizer

        path = self.args.tokenizer_path or self.model_config.path
        try:
            return AutoTokenizer.from_pretrained(path)
        except Exception as e:
            raise ModelLoadError(f"cannot load tokenizer from {path}: {e}") from e

    def _load_model(self, mc: ModelConfig | None = None, load_format: str | None = None) -> torch.nn.Module:
        return build_model(self.plugins, self.args, mc or self.model_config, self.device, load_format)

    def _build_kv_pool(self) -> None:
        args, mc, cfg = self.args, self.model_config, self.model_config.text_config
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        if self.tp_group is not None:  # this rank's heads: the KV pool is sharded like the model
            heads, kv_heads = local_heads(heads, kv_heads, self.tp_group.tp)
        kv_dtype = kv_cache_dtype(args.kv_cache_dtype, mc.dtype)
        per_token = kv_bytes_per_token(cfg.num_hidden_layers, kv_heads, head_dim, kv_dtype)
        if args.max_total_tokens:
            tokens = args.max_total_tokens
        else:
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                frac = args.mem_fraction_static or 0.88
                budget = total * frac - (total - free)
                if budget <= per_token * 16:
                    raise ModelLoadError(f"--mem-fraction-static {frac} leaves no memory for the KV cache; raise it or set --max-total-tokens")
                tokens = int(budget // per_token)
            else:
                import psutil

                vm = psutil.virtual_memory()
                tokens = cpu_kv_tokens(vm.total, vm.available, args.mem_fraction_static or 0.3, per_token,
                                       mc.context_len, args.max_running_requests)
        ps = args.page_size
        if ps < 1:
            raise ModelLoadError(f"--page-size must be >= 1, got {ps}")
        num_pages = tokens // ps + 1  # +1: the padding page
        self.kv_cache = allocate_kv_cache(cfg.num_hidden_layers, num_pages, ps, kv_heads, head_dim, kv_dtype, self.device)
        self.allocator = PageAllocator(num_pages, ps)
        self.max_total_tokens = self.allocator.capacity * ps
        max_running = args.max_running_requests or max(1, min(256, self.max_total_tokens // 16))
        self.table = ReqToTokenTable(max_running, mc.context_len + ps, self.device)
        check_scheduling_args(args)
        gc_watch.configure(args)  # (the process's collector: the last engine's settings apply)
        self.tree_cache = build_tree_cache(args, self.allocator, self.kv_cache, per_token, self.plugins, mc)  # (mem_cache)
        chunk = args.chunked_prefill_size
        if chunk is None:  # SGLang picks by GPU memory; 2048 (its small-GPU value) keeps a CPU forward short
            chunk = 8192 if self.device.type == "cuda" else DEFAULT_CPU_CHUNKED_PREFILL_SIZE
        self.chunked_prefill_size = chunk if chunk > 0 else None
        self.scheduler = Scheduler(
            self.allocator, self.table, max_running_requests=max_running, max_prefill_tokens=args.max_prefill_tokens,
            context_len=mc.context_len, eos_ids=mc.eos_ids, tree_cache=self.tree_cache,
            chunked_prefill_size=self.chunked_prefill_size, schedule_policy=args.schedule_policy,
            schedule_conservativeness=args.schedule_conservativeness, enable_mixed_chunk=args.enable_mixed_chunk,
            enable_priority_scheduling=args.enable_priority_scheduling,
            schedule_low_priority_values_first=args.schedule_low_priority_values_first, seed=self.random_seed,
            decode_steps=args.num_continuous_decode_steps, speculator=build_speculator(args, self.plugins),
            prefill_max_requests=args.prefill_max_requests, retraction_policy=args.retraction_policy,
        )
        backend_name = attention_backend_name(args, self.plugins, self.device, mc)  # (per phase: hybrid_attention)
        self.attention_backend_name = backend_name
        self.attn_backend = build_attention_backend(self.plugins, backend_name, AttentionConfig(
            cfg.num_hidden_layers, heads, kv_heads, head_dim, mc.dtype, self.device, self.kv_cache))
        deterministic.setup(args, self.device, self.model, self.attn_backend)  # (--enable-deterministic-inference)
        if self.tp_group is not None:
            self.tp_group.setup_kv(KVSpec(num_pages, ps, kv_dtype, backend_name))
        if (spec := self.scheduler.speculator) is not None:  # a model drafter's models, with the target's KV geometry
            spec.load(EngineDraftContext(args, self.model, self.plugins, mc, self.device, num_pages, ps, kv_dtype, backend_name))
        log.info("engine.ready", model=mc.source, architecture=mc.architecture, dtype=str(mc.dtype), device=str(self.device),
                 kv_tokens=self.max_total_tokens, page_size=ps, max_running_requests=max_running,
                 radix_cache=self.tree_cache is not None, chunked_prefill_size=self.chunked_prefill_size,
                 schedule_policy=args.schedule_policy,
                 attention_backend=backend_name, threads=torch.get_num_threads())

    # ------------------------------------------------------------------ requests
    def submit(self, reqs: list[Req]) -> None:
        self._ensure_running()
        if self.lora is not None:  # each request holds its adapter until it finishes
            reqs = self.lora.admit(reqs, self._finished)
        if self._held is not None:  # a weight update is under way: no prefix of the old weights may be reused
            self._held.extend(reqs)
            return
        if any(r.grammar is None and r.constraint is not None for r in reqs):
            # not prepared by the caller: compile in the background, the running batch is not held up
            asyncio.get_running_loop().create_task(self._submit_after_compile(reqs))
            return
        for r in reqs:
            self.scheduler.add(r)
        self._wake.set()

    async def _submit_after_compile(self, reqs: list[Req]) -> None:
        try:
            await self.prepare_grammars(reqs)
        except InvalidRequest as e:
            for r in reqs:
                r.finish_reason = {"type": "abort", "message": e.message}
                r.finish_time = time.perf_counter()
                self._finished(r)
            return
        try:
            self.submit(reqs)
        except CoreError as e:  # the engine stopped while compiling: nobody else will finish them
            for r in reqs:
                r.finish_reason, r.finish_time = {"type": "abort", "message": str(e)}, time.perf_counter()
                self._finished(r)

    def flush_cache(self) -> bool:
        """Empty the radix prefix cache, every tier of it (storage too); False (nothing done) while
        requests are queued or running."""
        ok = not self._held and self.scheduler.flush_cache()
        if ok:
            getattr(self.tree_cache, "clear_storage", bool)()
            log.info("engine.cache_flushed")
        return ok

    async def freeze_gc(self) -> int:
        """SGLang's ``/freeze_gc``: what this process holds now leaves later collector passes
        (``gc_watch.freeze``); how many objects are frozen."""
        return gc_watch.freeze("engine")

    def abort(self, rid: str) -> bool:
        """Abort a queued or running request (every sequence of its group: n > 1 copies, batch items);
        False when none matched. Its KV pages go back at the next step boundary."""
        found = self.scheduler.abort(rid)
        for req in self._held or ():  # finished as aborted when admitted after the update
            if req.answers_to(rid):
                req.aborted = found = True
        if found and self._wake is not None:
            self._wake.set()
        return found

    def abort_all(self, reason: str = "aborted by the server") -> int:
        """Abort every queued and running request; returns how many were aborted.
        ``reason`` becomes their finish message."""
        n = self.scheduler.abort_all(reason)
        for req in self._held or ():
            if not req.aborted:
                req.aborted, req.abort_message, n = True, reason, n + 1
        if n and self._wake is not None:
            self._wake.set()
        return n

    # ------------------------------------------------------------------ load queries (for the server)
    def num_waiting(self) -> int:
        """Requests queued for admission (not yet running), those held by a weight update included."""
        return len(self.scheduler.waiting) + len(self._held or ())

    def num_running(self) -> int:
        """Requests admitted to the running batch (a chunked prefill included)."""
        return len(self.scheduler.running)

    def has_work(self) -> bool:
        """True while any request is queued or running (or held by a weight update)."""
        return self.scheduler.has_work or bool(self._held)

    def has_request(self, rid: str) -> bool:
        """True while a sequence with this rid, or of the request group ``rid``, is queued or running
        (for duplicate-rid checks)."""
        return any(r.answers_to(rid) for r in (*self.scheduler.waiting, *self.scheduler.running, *(self._held or ())))

    @property
    def max_running_requests(self) -> int:
        """How many requests may run in one batch (``--max-running-requests`` or its derived default)."""
        return self.scheduler.max_running

    def load(self) -> dict[str, Any]:
        """Running / queued requests and KV pool usage, SGLang's ``/get_load`` keys plus the
        prefix-cache hit rate. Unused cached prefixes count as free: they are evictable."""
        alloc, tree = self.allocator, self.tree_cache
        ps = alloc.page_size
        capacity = alloc.capacity * ps
        free = (alloc.num_free + (tree.evictable_pages if tree is not None else 0)) * ps
        used = capacity - free
        running, waiting = self.num_running(), self.num_waiting()
        return {
            "num_running_reqs": running,
            "num_waiting_reqs": waiting,
            "num_total_reqs": running + waiting,
            "num_used_tokens": used,
            "num_free_tokens": free,
            "max_total_num_tokens": capacity,
            "token_usage": round(used / capacity, 6) if capacity else 0.0,
            "max_running_requests": self.max_running_requests,
            "cache_hit_rate": tree.hit_rate if tree is not None else 0.0,
            "cache_hit_tokens": tree.hit_tokens if tree is not None else 0,  # (a front end over replicas
            "cache_query_tokens": tree.query_tokens if tree is not None else 0,  # weighs their rates by these)
        }

    # ------------------------------------------------------------------ scheduler loop
    def _ensure_running(self) -> None:
        if self.fatal_error is not None:
            raise Unavailable(f"the engine has stopped: {self.fatal_error}")
        self._loop_ref = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        """Step until cancelled. Each step contains its own failures (``_step``); if the loop
        itself dies, the engine stops for good (``healthy`` False, every request failed)."""
        try:
            while True:
                await self._step()
        except asyncio.CancelledError:
            raise
        except RankFailure as e:  # tensor parallelism: the ranks cannot step together any more
            self._fatal(str(e))
        except BaseException as e:
            log.critical("engine.loop_died", exc_info=True)
            self._fatal(f"the scheduler loop died: {type(e).__name__}: {e}")
            if not isinstance(e, Exception):
                raise

    async def _step(self) -> None:
        """Schedule, run and process one batch. Whatever raises fails the requests concerned with
        a message naming the stage, and the loop goes on: a failing ``schedule()`` fails every
        queued and running request (the scheduler's state is no longer trusted, so it is reset);
        a failing forward or result processing fails that batch.

        With overlap scheduling the next batch is scheduled and handed to the forward thread
        before the running one's results are processed (SGLang's zero-overhead scheduler): its
        decodes take the tokens still being sampled as future ids (``schedule_batch.future_id``),
        and the host's scheduling and result processing run while the device computes. Where
        the next batch needs those results first (``Scheduler.needs_results``) they are
        processed before scheduling, for that step only."""
        if self.paused:  # nothing is scheduled until /continue_generation (core.engine.pause)
            return await pause.park(self)
        self.watchdog.begin()
        if self._inflight is not None and (why := self.scheduler.needs_results()):
            if why not in self._overlap_paused:  # (each reason once: it may hold for every step)
                self._overlap_paused.add(why)
                log.info("engine.overlap_paused", reason=why, effect="a step waits for the one before it")
            await self._complete(*self._inflight)
        try:
            batch, aborted = self.scheduler.schedule()
            if batch is not None and self.tree_cache is not None:  # the load-backs its admissions queued
                batch.kv_loads = self.tree_cache.take_loads()
        except Exception as e:
            self._contain("scheduling", e, None)
            return
        for req in aborted:
            self._finished(req)
        prev = self._inflight
        if batch is None:
            if prev is not None:
                await self._complete(*prev)
                return
            self._wake.clear()
            if not self.scheduler.has_work:
                self.watchdog.idle()
                await self._wake.wait()
            return
        t0 = time.perf_counter()
        if self.overlap:
            self.watchdog.running(batch, on_loop=False)
            self._inflight = (batch, self._on_forward_thread(self.runner.run, batch), t0)
            if prev is not None:
                await self._complete(*prev)
            return
        inline = self._runs_inline(batch)
        self.watchdog.running(batch, on_loop=inline)
        done = asyncio.get_running_loop().create_future()
        try:
            done.set_result(self.runner.run(batch) if inline else await self._on_forward_thread(self.runner.run, batch))
        except RankFailure:
            raise
        except Exception as e:  # a failing forward fails its batch, not the engine
            done.set_exception(e)
        await self._complete(batch, done, t0, inline)

    async def _complete(self, batch: ScheduledBatch, forward: asyncio.Future, t0: float, inline: bool = False) -> None:
        """The results of ``batch`` (its forward's future) processed: tokens appended, streams told."""
        if self._inflight is not None and self._inflight[0] is batch:
            self._inflight = None
        try:
            result = await forward
            if result.pending is not None:  # its tokens still landing: awaited on the forward thread, behind the next launch
                result = await self._on_forward_thread(result.resolve)
        except RankFailure:
            raise
        except Exception as e:  # a failing forward fails its batch, not the engine, unless the KV it was to
            # load back was never sent (the prefix cache would serve those pages): then everything
            self._contain("forward", e, batch.reqs if batch.kv_loads is None or batch.kv_loads.issued else None)
            return
        elapsed = time.perf_counter() - t0
        if not batch.is_prefill:
            self._decode_row_s = elapsed / len(batch.reqs)
        for listener in self.step_listeners:
            _call_guarded(listener, batch, elapsed)
        try:
            updates = self.scheduler.process(batch, result)
        except Exception as e:
            self._contain("result processing", e, batch.reqs)
            return
        for req, _ in updates:
            req.notify()
            if req.finished:
                self._finished(req, notify=False)
        if inline or batch.is_prefill or self.overlap:  # (after a prefill: first tokens out before a decode holds
            await _drain_loop()  # the loop; overlap: the streams' Python before the next launch, not during it)

    def _runs_inline(self, batch: ScheduledBatch) -> bool:
        """Whether ``batch``'s forward runs on the event loop's thread instead of the forward
        thread: a CPU decode of at most ``inline_decode_rows`` rows, or one that the last decode's
        pace per row says takes at most ``inline_decode_s`` (a small model's large batch). Handing
        a step to the other thread and back costs two thread wake-ups, and the streams' work, run
        on the loop while the forward's threads hold every core, slowed each step (batch 1: ~6 %;
        a near-null model's 256 streams: ~30 %). After inline steps and prefills the loop runs
        until nothing is ready (``_drain_loop``): a prefill's first tokens reach their streams
        before the next (inline) decode holds the loop, which with ``--num-continuous-decode-steps``
        would otherwise add its whole burst to the TTFT. Prefills and long steps stay on the
        forward thread, so that the server is never blocked for long."""
        n = len(batch.reqs)
        return (not batch.is_prefill and (n <= self.inline_decode_rows or n * self._decode_row_s <= self.inline_decode_s)
                and not self._forward_jobs and not self.profiler.active)

    def _on_forward_thread(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """``fn(*args)`` handed to the forward thread now (its jobs run in the order handed), as a
        future to await: overlap scheduling relies on the order (a batch's launch before the wait
        for the one before it). While such a job (an embedding forward, a weight reload) is queued
        or running, no forward runs inline: forwards never overlap."""
        self._forward_jobs += 1
        fut = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        fut.add_done_callback(self._forward_job_done)
        return fut

    def _forward_job_done(self, _: asyncio.Future) -> None:
        self._forward_jobs -= 1

    def _contain(self, stage: str, error: Exception, reqs: list[Req] | None) -> None:
        """Fail ``reqs`` (None: everything the scheduler holds) after ``error`` in ``stage``."""
        message = f"internal error ({stage}): {type(error).__name__}: {error}"
        log.error("engine.step_failed", stage=stage, rids=None if reqs is None else [r.rid for r in reqs],
                  exc_info=error)
        if reqs is None:
            failed = self.scheduler.fail_all(message)
        else:
            try:
                self.scheduler.fail(reqs, message)
                failed = reqs
            except Exception:  # the batch cannot be unwound on its own: reset the scheduler
                log.exception("engine.fail_batch_failed", stage=stage)
                failed = list({id(r): r for r in [*reqs, *self.scheduler.fail_all(message)]}.values())
        for req in failed:
            self._finished(req)

    def _on_rank_failure(self, message: str) -> None:
        """The tensor-parallel group failed (called from its watcher or the forward thread)."""
        loop = self._loop_ref
        if loop is None or loop.is_closed():
            self.fatal_error = self.fatal_error or message  # nothing running: the next submit raises
        else:
            loop.call_soon_threadsafe(self._fatal, message)

    def _fatal(self, message: str) -> None:
        """Stop for good: fail every queued and running request with ``message``, tell the
        ``fatal_listeners`` (``core serve`` exits non-zero). Runs on the loop thread."""
        if self._stopped:
            return
        self._stopped, self.fatal_error = True, message
        self.watchdog.stop()
        log.error("engine.stopped", error=message)
        task, self._task = self._task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        for req in self.scheduler.fail_all(message):
            self._finished(req)
        for listener in self.fatal_listeners:
            _call_guarded(listener, message)

    def _finished(self, req: Req, notify: bool = True) -> None:
        if notify:
            req.notify()
        ttft = None if req.first_token_time is None else req.first_token_time - req.arrival
        log.info("request.finished", rid=req.rid, prompt_tokens=len(req.prompt_ids), completion_tokens=len(req.output_ids),
                 ttft=None if ttft is None else round(ttft, 4), latency=round((req.finish_time or time.perf_counter()) - req.arrival, 4),
                 finish_reason=req.finish_reason)
        for listener in self.finish_listeners:
            _call_guarded(listener, req)

    @property
    def healthy(self) -> bool:
        """False once the engine has stopped for good: its scheduler loop died or a
        tensor-parallel rank failed (``fatal_error`` says why). What ``/health`` reports."""
        return self.fatal_error is None

    def _capture_cuda_graphs(self) -> CudaGraphRunner | None:
        """Decode (and verify) CUDA graphs for this model and backend, or None (eager), the reason logged."""
        args = self.args
        why = why_no_cuda_graph(self.device, self.attn_backend, self.attention_backend_name, args.disable_cuda_graph,
                                self.tp_group is not None)
        if why is not None:
            log.info("cuda_graph.off", reason=why)
            return None
        max_bs = min(args.cuda_graph_max_bs or DEFAULT_MAX_BS, self.scheduler.max_running)
        spec = self.scheduler.speculator  # verifies too, where the backend captures tree-masked extends
        t = spec.num_draft_tokens if spec is not None and spec.trees and getattr(
            self.attn_backend, "supports_cuda_graph_verify", False) else 0
        try:
            graphs = CudaGraphRunner(self.model, self.attn_backend, max_bs, self.table.table.shape[1], self.device,
                                     self.lora, t, spec.token_budget // t if t else 0).capture()
            if graphs.verify_sizes:  # (a larger batch decodes plainly: its verify would run eagerly)
                spec.max_verify_reqs = graphs.verify_sizes[-1]
            return graphs
        except Exception as e:  # e.g. a model that syncs with the host in its forward: run it eagerly
            log.warning("cuda_graph.capture_failed", error=f"{type(e).__name__}: {e}", exc_info=True)
            return None

    # ------------------------------------------------------------------ embeddings and classification
    @property
    def is_classifier(self) -> bool:
        return callable(getattr(self.model, "classify", None))

    async def encode(self, prompt_ids_list: list[list[int]]) -> list[list[float]]:
        """Pooled (normalised) final hidden states of each prompt, or a classification
        model's scores, from one prefill-only forward (``--is-embedding``)."""
        if not prompt_ids_list or any(len(p) == 0 for p in prompt_ids_list):
            raise InvalidRequest("input must not be empty", param="input")
        limit = self.model_config.context_len
        if any(len(p) > limit for p in prompt_ids_list):
            raise InvalidRequest(f"an input is longer than the context length {limit}", param="input")
        vocab = self.vocab_size
        if any(not 0 <= t < vocab for p in prompt_ids_list for t in p):
            raise InvalidRequest(f"token ids must be in [0, {vocab})", param="input")
        if self.is_classifier:
            pooling, normalize, head = "last", False, self.model.classify
        else:
            (pooling, normalize), head = pooling_config(self.model_config.path), None
        return await self._on_forward_thread(self.runner.encode, prompt_ids_list, self._scratch_backend,
                                             pooling, normalize, head)

    def _scratch_backend(self, num_slots: int):
        """A fresh attention backend over a private ``num_slots`` KV cache (for encode)."""
        k0 = self.kv_cache.k[0]
        layers, (hkv, d) = len(self.kv_cache.k), k0.shape[1:]
        kv = allocate_kv_cache(layers, num_slots, 1, hkv, d, k0.dtype, self.device)
        heads = self.model_config.text_config.num_attention_heads
        return build_attention_backend(self.plugins, self.attention_backend_name,
                                       AttentionConfig(layers, heads, hkv, d, self.model_config.dtype, self.device, kv))

    # ------------------------------------------------------------------ weights
    async def update_weights_from_disk(self, model_path: str, flush_cache: bool = True,
                                       torch_empty_cache: bool = False, load_format: str = "auto") -> tuple[bool, str]:
        """Reload weights of the same architecture from ``model_path`` (SGLang's
        ``/update_weights_from_disk``); on failure the old weights stay in place. Returns
        (success, message).

        As SGLang's (whose update takes a writer lock every request holds a reader of), the
        update waits for the queued and running requests to finish under the old weights, and
        requests submitted meanwhile are held until it is done. So the swap and, with
        ``flush_cache``, the emptying of the prefix cache happen with nothing running: no request
        mixes KV of both weights or reuses a prefix cached under the old ones. ``flush_cache``
        False keeps the cache (the caller knows the prefixes are still valid). ``torch_empty_cache``
        returns the old weights' freed CUDA memory to the driver (nothing to do off CUDA);
        ``load_format`` names the checkpoint format to read (``--load-format``'s values). Shielded: a caller that goes away does not leave the swap done without its flush."""
        return await asyncio.shield(update_weights(self, model_path, flush_cache, torch_empty_cache, load_format))

    async def pause_generation(self, mode: str = "abort") -> None:  # SGLang's (core.engine.pause)
        await pause.pause(self, mode)

    async def continue_generation(self, torch_empty_cache: bool = False) -> None:
        pause.resume(self, torch_empty_cache)

    async def shutdown(self) -> None:
        """Abort whatever is queued or running, stop the scheduler and the worker thread."""
        self.watchdog.stop()
        if self._gil_short:
            self._gil_short = False
            gil_switch.restore()
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        pending = [*self.scheduler.waiting, *self.scheduler.running]
        held, self._held = self._held or [], None
        self.scheduler.waiting.clear()
        self.scheduler.fail(pending, "engine shut down")
        for req in held:  # never reached the scheduler
            req.finish_reason, req.finish_time = {"type": "abort", "message": "engine shut down"}, time.perf_counter()
        for req in [*pending, *held]:
            self._finished(req)
        self._executor.shutdown(wait=True)
        if self.tp_group is not None:
            self.tp_group.stop()
        self.grammar.shutdown()
        self.weight_sync.close()
        getattr(self.tree_cache, "close", bool)()  # (the storage tier's queued writes land: mem_cache)
        self.plugins.pm.hook.on_shutdown(engine=self)


async def _drain_loop(max_rounds: int = 64) -> None:
    """Let the event loop run what is ready (the streams' chunks, a request being parsed, a
    disconnect being noticed) before the next inline step blocks it again: each round of the loop
    moves such a chain one hop, so one round per step made a new request's first token or a
    /get_load wait ~3x longer under a running decode. Stops once nothing is ready (CPython's loop
    keeps its ready callbacks in ``_ready``; a loop without it gets one round)."""
    ready = getattr(asyncio.get_running_loop(), "_ready", None)
    for _ in range(max_rounds if ready is not None else 1):
        await asyncio.sleep(0)
        if not ready:
            return


def _call_guarded(listener: Callable[..., Any], *args: Any) -> None:
    """Observers must never raise; one that does is logged, and serving goes on."""
    try:
        listener(*args)
    except Exception:
        log.exception("engine.listener_failed", listener=getattr(listener, "__qualname__", repr(listener)))
