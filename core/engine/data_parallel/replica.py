"""One data-parallel replica: a whole ``AsyncEngine`` (itself possibly tensor-parallel) in its
own process and event loop, driven over a pipe by ``core.engine.data_parallel.engine``.

The front end sends requests as plain specs (it already tokenized and validated them); the
replica runs them and streams back, per step, what changed in each request (new token ids,
text, logprobs, cached tokens, finish reason) plus its load. It exits when the front end
goes away (the pipe closes), when told to stop, or, non-zero, when its engine fails.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from typing import Any, NamedTuple

import attrs
import structlog

from core.engine import gc_watch
from core.engine.config import EngineArgs
from core.engine.device import configure_cpu_runtime
from core.engine.model_loader.weights_by_name import weights_by_name
from core.engine.request import Req
from core.engine.sampling_params import SamplingParams

log = structlog.get_logger("core.engine.data_parallel.replica")
# the WeightSync / MemorySaver coroutines a front end may run in its one replica (DataParallelEngine._OneReplica)
RL_OPS = frozenset({"update_from_tensor", "update_from_distributed", "init_group", "destroy_group", "begin", "end",
                    "release", "resume"})


@attrs.frozen
class ReqSpec:
    """One sequence to run, as the front end built it (``n`` copies arrive as n specs, n=1 each)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    priority: int | None
    lora: str | None = None  # the LoRA adapter's name (each replica has its own uids)
    # False: the front end turns the tokens into text (``DataParallelEngine._on_delta``), off the
    # engine's step path (SGLang's detokenizer runs in a process of its own); True where the engine
    # needs the text itself: stop strings and patterns are matched where the tokens are made
    detokenize: bool = True
    token_ids_logprob: list[int] | None = None  # SGLang's: these tokens' logprobs at each position


class ReqDelta(NamedTuple):
    """What a request gained since the last delta sent for it. It travels as a plain tuple
    (``tuple(delta)``; ``ReqDelta(*t)`` on arrival): 256 of them a step pickled and unpickled in
    ~130 us, where as attrs instances they took ~900."""

    output_ids: list[int]
    text: str
    output_logprobs: list[float]
    output_top_logprobs: list[Any]
    output_token_ids_logprobs: list[Any]
    input_logprobs: tuple[list, list, list] | None  # (logprobs, top, token_ids_logprob's) of the prompt, sent once
    cached_tokens: int
    finish_reason: dict | None
    spec: tuple[int, int, int] = (0, 0, 0)  # speculative decoding's counts: verifies, drafts proposed, kept


def replica_main(index: int, args: EngineArgs, conn) -> None:
    """Entry point of a replica process (spawned)."""
    from core.engine.async_engine import AsyncEngine
    from core.engine.distributed.collectives import describe
    from core.log import configure_logging

    configure_logging(args.log_level)
    configure_cpu_runtime(args.cpu_threads)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        engine = AsyncEngine(args)
    except BaseException as e:  # noqa: BLE001 - reported to the front end, which names the replica
        conn.send(("error", describe(e)))
        sys.stderr.flush()
        os._exit(1)
    conn.send(("ready", {"max_total_tokens": engine.max_total_tokens, "page_size": engine.allocator.page_size,
                         "capacity_pages": engine.allocator.capacity, "max_running_requests": engine.max_running_requests,
                         "is_classifier": engine.is_classifier, "load": engine.load(), "pid": os.getpid(),
                         "random_seed": engine.random_seed, "chunked_prefill_size": engine.chunked_prefill_size}))
    gc_watch.freeze(f"data-parallel replica {index}")  # the model and modules: out of later collector passes
    # a hung step cannot be joined (as under core serve, which sets the same): the replica ends its own
    # process, the front end fails what it ran, takes it out of rotation, and stops with the last one
    engine.watchdog.exit_code = 1
    code = loop.run_until_complete(_Replica(index, engine, conn, loop).run())
    sys.stderr.flush()
    os._exit(code)


class _Replica:
    def __init__(self, index: int, engine, conn, loop: asyncio.AbstractEventLoop) -> None:
        self.index, self.engine, self.conn, self.loop = index, engine, conn, loop
        self.outbox: list[tuple] = []
        self.flush_scheduled = False
        # the requests notified since the last flush (in order), and what each has been sent so far:
        # [output ids, text chars, logprobs, prompt logprobs sent]
        self.dirty: dict[Req, None] = {}
        self.sent: dict[Req, list] = {}
        self.done: asyncio.Future = loop.create_future()
        engine.step_listeners.append(self._on_step)
        engine.fatal_listeners.append(lambda message: loop.call_later(0.2, self._finish, 1))

    async def run(self) -> int:
        threading.Thread(target=self._read, name="core-dp-reader", daemon=True).start()
        code = await self.done
        try:
            await self.engine.shutdown()
        except Exception:  # noqa: BLE001 - exiting anyway
            log.exception("dp.replica_shutdown_failed", replica=self.index)
        return code

    def _finish(self, code: int) -> None:
        if not self.done.done():
            self.done.set_result(code)

    def _read(self) -> None:
        """Pipe reader thread: hands each message to the loop; a closed pipe (front end gone) stops."""
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                self.loop.call_soon_threadsafe(self._finish, 0)
                return
            self.loop.call_soon_threadsafe(self._handle, msg)
            if msg[0] == "stop":
                return

    # ------------------------------------------------------------------ front end -> replica
    def _handle(self, msg: tuple) -> None:
        kind, engine = msg[0], self.engine
        if kind == "submit":
            self._submit(msg[1])
        elif kind == "abort":
            engine.abort(msg[1])
        elif kind == "abort_all":
            engine.abort_all(msg[1])
        elif kind == "flush":
            engine.flush_cache()
        elif kind == "call":
            asyncio.ensure_future(self._call(msg[1], msg[2], msg[3:]))
        elif kind == "stop":
            self._finish(0)

    def _submit(self, specs: list[ReqSpec]) -> None:
        engine, reqs = self.engine, []
        for s in specs:
            try:
                reqs += engine.make_requests(s.prompt_ids, s.params, s.rid, s.return_logprob, s.logprob_start_len,
                                             s.top_logprobs_num, priority=s.priority, lora_path=s.lora,
                                             detokenize=s.detokenize, token_ids_logprob=s.token_ids_logprob)
            except Exception as e:  # validated by the front end already; report rather than crash
                self._send_now(_aborted(s.rid, str(e)))
        for r in reqs:
            self.sent[r] = [0, 0, 0, False]
            r.watcher = self._on_update
        try:
            engine.submit(reqs)
        except Exception as e:  # the engine has stopped
            for r in reqs:
                r.watcher = None
                self.sent.pop(r, None)
                self.dirty.pop(r, None)
                self._send_now(_aborted(r.rid, str(e)))

    async def _call(self, call_id: int, what: str, args: tuple) -> None:
        try:
            if what == "encode":
                value = await self.engine.encode(*args)
            elif what == "update_weights":
                value = await self.engine.update_weights_from_disk(*args)
            elif what == "freeze_gc":
                value = await self.engine.freeze_gc()
            elif what == "weights_by_name":
                value = weights_by_name(self.engine.model, *args)
            elif what == "pause":
                value = await self.engine.pause_generation(*args)
            elif what == "resume":
                value = await self.engine.continue_generation(*args)
            elif what == "load_lora":
                value = await self.engine.load_lora_adapter(*args)
            elif what == "unload_lora":
                value = await self.engine.unload_lora_adapter(*args)
            elif what == "start_profile":
                value = await self.engine.profiler.start(*args)
            elif what == "stop_profile":
                value = await self.engine.profiler.stop()
            elif what == "rl" and args[1] in RL_OPS:  # a trainer's weights, the memory saver (weight_sync)
                value = await getattr(getattr(self.engine, args[0]), args[1])(*args[2:])
            elif what == "clear_storage":  # (waits for the queued writes first)
                clear = getattr(self.engine.tree_cache, "clear_storage", None)
                value = clear is not None and await asyncio.to_thread(clear)
            else:
                raise ValueError(f"unknown call {what!r}")
            self.conn.send(("reply", call_id, True, value))
        except Exception as e:  # noqa: BLE001 - the caller re-raises it
            self.conn.send(("reply", call_id, False, e))

    # ------------------------------------------------------------------ replica -> front end
    def _on_step(self, batch, duration: float) -> None:
        sampling = [r.rid for r in batch.reqs if r.kv_len >= r.seq_len]
        if sampling:
            self.outbox.append(("step", batch.is_prefill, duration, sampling, batch.steps_run))

    def _on_update(self, req: Req) -> None:
        """A request's ``notify`` (after each step it took, at its finish): its delta is built at
        the next flush, so steps taken before it coalesce; no task or wake-up per request."""
        self.dirty[req] = None
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _deltas(self) -> None:
        """What each notified request gained since it was last sent, into the outbox."""
        dirty, self.dirty = self.dirty, {}
        for req in dirty:
            sent = self.sent.get(req)
            if sent is None:
                continue
            n_ids, n_text, n_lp, input_sent = sent
            inputs = None
            if not input_sent and req.input_logprobs:
                inputs = (list(req.input_logprobs), list(req.input_top_logprobs), list(req.input_token_ids_logprobs))
                sent[3] = True
            delta = ReqDelta(req.output_ids[n_ids:], req.text[n_text:], req.output_logprobs[n_lp:],
                             req.output_top_logprobs[n_lp:], req.output_token_ids_logprobs[n_lp:], inputs,
                             req.cached_tokens, req.finish_reason,
                             (req.spec_verify_ct, req.spec_num_proposed_drafts, req.spec_num_correct_drafts))
            sent[0], sent[1], sent[2] = len(req.output_ids), len(req.text), len(req.output_logprobs)
            self.outbox.append(("delta", req.rid, tuple(delta)))
            if req.finished:
                req.watcher = None
                del self.sent[req]

    def _flush(self) -> None:
        self.flush_scheduled = False
        self._deltas()
        events, self.outbox = self.outbox, []
        self._send_raw(("events", events, self._load()))

    def _send_now(self, event: tuple) -> None:
        self._send_raw(("events", [event], self._load()))

    def _load(self) -> dict:
        """The engine's load, with its HiCache tier's counters (the front end's /metrics) where it has the tier."""
        load = self.engine.load()
        if (stats := getattr(self.engine.tree_cache, "tier_stats", None)) is not None:
            load["tier_stats"] = stats()
        return load

    def _send_raw(self, msg: tuple) -> None:
        try:
            self.conn.send(msg)
        except (OSError, ValueError):  # the front end is gone
            self._finish(0)


def _aborted(rid: str, message: str) -> tuple:
    """The delta event of a request that failed here before it ran."""
    return "delta", rid, tuple(ReqDelta([], "", [], [], None, 0, {"type": "abort", "message": message}))
