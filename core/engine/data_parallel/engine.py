"""Data parallelism: ``--dp-size N`` engine replicas behind one front end.

``DataParallelEngine`` stands where an ``AsyncEngine`` stands (the HTTP server and the
offline ``Engine`` use either): it tokenizes, validates and builds requests here
(``RequestFrontEnd``), picks a replica per request (``core.engine.data_parallel.router``), sends it to
that replica's process (``core.engine.data_parallel.replica``, a whole engine, itself ``--tp-size``
ranks) and mirrors what the replica streams back into the request, so streaming, metrics
(finish and step listeners run here) and the request log work as with one engine. Loads
(``load``, ``num_waiting``...) are the replicas' latest reports, summed.

A replica whose process dies is taken out of rotation; its unfinished requests fail with a
message naming it, the others keep serving, and ``replicas()`` (``/health``) reports it.
When none is left the engine stops (``fatal_listeners``: ``core serve`` exits non-zero).
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import threading
import time
from typing import Any, Callable

import attrs
import structlog

from core.engine import gc_watch
from core.engine.distributed.collectives import process_context
from core.engine.config import EngineArgs, lora_requested
from core.engine.data_parallel.replica import RL_OPS, ReqDelta, ReqSpec, replica_main
from core.engine.data_parallel.router import Router
from core.engine.device import gpu_index, placed_device
from core.engine.frontend import RequestFrontEnd
from core.engine.grammar import GrammarManager, json_whitespace_options
from core.engine.lora.replicated import ReplicatedAdapters
from core.engine.mem_cache.kv_cache import PageAllocator
from core.engine.model_loader.loader import load_model_config, with_tokenizer_eos
from core.engine.request import Req
from core.errors import CoreError, InvalidRequest, ModelLoadError, Unavailable
from core.plugins import PluginManager, load_plugins

log = structlog.get_logger("core.engine.data_parallel.engine")

STARTUP_POLL_S = 0.2
STOP_GRACE_S = 10.0


@attrs.define
class Replica:
    """The front end's view of one replica process."""

    index: int
    process: Any
    conn: Any
    info: dict = attrs.field(factory=dict)  # what it reported when ready
    load: dict = attrs.field(factory=dict)  # its latest load report (AsyncEngine.load keys)
    inflight: dict[str, Req] = attrs.field(factory=dict)  # rid -> unfinished request it runs
    alive: bool = True
    error: str | None = None  # why it is out of rotation
    routed: int = 0  # requests sent to it so far


@attrs.define
class _StepView:
    """What step listeners read of a replica's step (``ScheduledBatch``'s reqs / is_prefill / steps_run)."""

    reqs: list[Req]
    is_prefill: bool
    steps_run: int = 1


class DataParallelEngine(RequestFrontEnd):
    """An engine over ``args.dp_size`` replica processes (see the module docstring)."""

    def __init__(self, args: EngineArgs, plugins: PluginManager | None = None, model_config: Any = None) -> None:
        import torch

        self.args = args
        self.plugins = plugins or load_plugins(args.plugins, strict=args.strict_plugins)
        self.device = torch.device("cpu")  # the front end holds no model
        self.model_config = model_config or _model_config(args)
        if _serves_images(args, self.plugins, self.model_config):  # (replicas' images)
            raise CoreError(f"--dp-size > 1 with the vision-language model {self.model_config.architecture} is not "
                            "supported yet; serve it with --dp-size 1")
        self.tokenizer = None if args.skip_tokenizer_init else _load_tokenizer(args, self.model_config.path)
        self.model_config = with_tokenizer_eos(self.model_config, self.tokenizer)
        self.vocab_size = self.model_config.text_config.vocab_size
        self.grammar = GrammarManager(self.plugins, args.grammar_backend, self.tokenizer, self.vocab_size,
                                      self.model_config.eos_ids, json_whitespace_options(args))
        self.router = Router(args.dp_size, args.load_balance_method)
        self.lora = ReplicatedAdapters(args, self._call_all, self._adapters_in_flight) if lora_requested(args) else None
        self.step_listeners: list[Callable[[Any, float], None]] = []
        self.finish_listeners: list[Callable[[Req], None]] = []
        self.fatal_listeners: list[Callable[[str], None]] = []
        self.fatal_error: str | None = None
        self.log = log
        self._calls: dict[int, tuple[asyncio.Future, int]] = {}  # call id -> (its answer, the replica asked)
        self._call_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._early: list[tuple[int, Any]] = []  # messages that arrived before a loop was known
        self._lock = threading.Lock()
        self._closing = False
        self.replicas = self._start()
        first = self.replicas[0].info
        self.allocator = PageAllocator(first["capacity_pages"] + 1, first["page_size"])  # for make_requests' size check
        self.max_total_tokens = first["max_total_tokens"]
        self.max_running_requests = first["max_running_requests"]
        self.is_classifier = first["is_classifier"]
        # what /get_server_info reports as resolved: one replica's own (several each draw their seed)
        self.random_seed = first["random_seed"] if args.dp_size == 1 else None
        self.chunked_prefill_size = first["chunked_prefill_size"]
        self.profiler = _ReplicaProfiler(self)
        if args.dp_size == 1:  # (an engine in its own process: a trainer's weight updates reach it; not replicas)
            self.weight_sync, self.memory_saver = _OneReplica(self, "weight_sync"), _OneReplica(self, "memory_saver")
        for r in self.replicas:
            threading.Thread(target=self._read, args=(r,), name=f"core-dp-read{r.index}", daemon=True).start()
        log.info("dp.ready", replicas=args.dp_size, load_balance_method=args.load_balance_method,
                 pids=[r.info["pid"] for r in self.replicas])

    # ------------------------------------------------------------------ start-up
    def _start(self) -> list[Replica]:
        ctx = process_context()
        replicas = []
        for i in range(self.args.dp_size):
            mine, theirs = ctx.Pipe()
            # not a daemon: a replica may start its own tensor-parallel ranks; it exits when the pipe closes
            p = ctx.Process(target=replica_main, args=(i, replica_args(self.args, i), theirs), name=f"core-dp-replica{i}")
            p.start()
            theirs.close()
            replicas.append(Replica(i, p, mine))
            _STARTED.append((p, mine))
        try:
            for r in replicas:
                r.info = self._wait_ready(r)
                r.load = r.info["load"]
        except BaseException:
            for r in replicas:
                _kill(r.process)
            raise
        return replicas

    @staticmethod
    def _wait_ready(r: Replica) -> dict:
        while not r.conn.poll(STARTUP_POLL_S):
            if not r.process.is_alive():
                raise ModelLoadError(f"data-parallel replica {r.index} exited with code {r.process.exitcode} while starting")
        try:
            kind, payload = r.conn.recv()
        except EOFError:
            raise ModelLoadError(f"data-parallel replica {r.index} exited while starting") from None
        if kind != "ready":
            raise ModelLoadError(f"data-parallel replica {r.index} failed to start: {payload}")
        return payload

    # ------------------------------------------------------------------ requests (loop thread)
    def submit(self, reqs: list[Req]) -> None:
        """Route each request to a live replica and send it; raises Unavailable when none is left."""
        if self.fatal_error is not None:
            raise Unavailable(f"the engine has stopped: {self.fatal_error}")
        self._bind_loop()
        if any(r.grammar is None and r.constraint is not None for r in reqs):
            asyncio.get_running_loop().create_task(self._submit_after_compile(reqs))
            return
        batches: dict[int, list[ReqSpec]] = {}
        for req in reqs:
            adapter = self.lora.name_of(req.lora_id) if req.lora_id else None
            if req.lora_id and adapter is None:  # unloaded since it was named: as AsyncEngine's admission does
                self._finish(req, {"type": "abort", "message": "its LoRA adapter was unloaded before it started"})
                continue
            i = req.routed_dp_rank
            if i is None:
                i = self.router.pick(req.prompt_ids, [len(r.inflight) for r in self.replicas])
            elif i not in self.router.live:  # (it died since the request was checked)
                self._finish(req, {"type": "abort", "message": f"DP rank {i} is not active"})
                continue
            self.replicas[i].inflight[req.rid] = req
            self.replicas[i].routed += 1
            spec = ReqSpec(req.rid, req.prompt_ids, attrs.evolve(req.params, n=1, seed=_copy_seed(req)),
                           req.return_logprob, req.logprob_start_len, req.top_logprobs_num, req.priority, adapter,
                           detokenize=not _text_here(req), token_ids_logprob=req.token_ids_logprob)
            batches.setdefault(i, []).append(spec)
        for i, specs in batches.items():
            self._send(self.replicas[i], ("submit", specs))

    async def _submit_after_compile(self, reqs: list[Req]) -> None:
        try:
            await self.prepare_grammars(reqs)
        except InvalidRequest as e:
            for r in reqs:
                self._finish(r, {"type": "abort", "message": e.message})
            return
        self.submit(reqs)

    def abort(self, rid: str) -> bool:
        """Abort a request (every sequence of its group) on whichever replica runs it; each replica
        gets the exact rids of its sequences."""
        found = False
        for r in self._live():
            for k in [k for k, req in r.inflight.items() if req.answers_to(rid)]:
                self._send(r, ("abort", k))
                found = True
        return found

    def abort_all(self, reason: str = "aborted by the server") -> int:
        n = 0
        for r in self.replicas:
            if r.alive and r.inflight:
                n += len(r.inflight)
                self._send(r, ("abort_all", reason))
        return n

    async def freeze_gc(self) -> int:
        """``AsyncEngine.freeze_gc`` in this process and every live replica; the objects frozen here."""
        await asyncio.gather(*(self._call(r, "freeze_gc") for r in self._live()))
        return gc_watch.freeze("data-parallel front end")

    def flush_cache(self) -> bool:
        if self.has_work():
            return False
        for r in self._live():
            self._send(r, ("flush",))
        return True

    # ------------------------------------------------------------------ load queries
    @property
    def healthy(self) -> bool:
        """False once no replica is left (``fatal_error`` says so); a dead replica alone is not fatal."""
        return self.fatal_error is None

    def _live(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive]

    def has_work(self) -> bool:
        return any(r.inflight for r in self.replicas)

    def has_request(self, rid: str) -> bool:
        return any(req.answers_to(rid) for r in self.replicas for req in r.inflight.values())

    def num_running(self) -> int:
        return sum(min(r.load.get("num_running_reqs", 0), len(r.inflight)) for r in self._live())

    def num_waiting(self) -> int:
        return sum(len(r.inflight) for r in self.replicas) - self.num_running()

    def load(self) -> dict[str, Any]:
        """``AsyncEngine.load()`` keys summed over the live replicas (token usage over their
        pooled capacity, the cache hit rate over all their prompt tokens), plus ``replicas`` (``replica_loads``)."""
        loads = [r.load for r in self._live()] or [{}]
        total = {k: sum(l.get(k, 0) for l in loads) for k in ("num_running_reqs", "num_waiting_reqs", "num_total_reqs",
                                                             "num_used_tokens", "num_free_tokens", "max_total_num_tokens",
                                                             "max_running_requests", "cache_hit_tokens",
                                                             "cache_query_tokens")}
        cap = total["max_total_num_tokens"]
        total["token_usage"] = round(total["num_used_tokens"] / cap, 6) if cap else 0.0
        queries = total["cache_query_tokens"]
        total["cache_hit_rate"] = total["cache_hit_tokens"] / queries if queries else 0.0
        return total

    def tier_stats(self) -> dict[str, Any] | None:
        """The live replicas' HiCache tier counters (their latest reports) summed, as the metrics read
        ``HiRadixCache.tier_stats``; None when no replica has the tier."""
        stats = [r.load["tier_stats"] for r in self._live() if "tier_stats" in r.load]
        return {k: sum(s[k] for s in stats) for k in stats[0]} if stats else None

    def replica_loads(self) -> list[dict[str, Any]]:
        """Each replica's latest load report, with ``dp_rank``, ``alive``, ``pid``, ``routed_requests``
        (sent to it so far) and, for a dead one, ``error``."""
        out = []
        for r in self.replicas:
            item = {"dp_rank": r.index, "alive": r.alive, "pid": r.info.get("pid"), "routed_requests": r.routed, **r.load}
            if r.error:
                item["error"] = r.error
            out.append(item)
        return out

    # ------------------------------------------------------------------ replica -> front end
    def _bind_loop(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            with self._lock:
                early, self._early = self._early, []
            for index, msg in early:
                self._on_message(index, msg)

    def _read(self, r: Replica) -> None:
        """Reader thread of one replica's pipe: messages go to the loop; EOF means it died."""
        while True:
            try:
                msg = r.conn.recv()
            except (EOFError, OSError):
                msg = None
            with self._lock:
                loop = self._loop
                if loop is None:
                    self._early.append((r.index, msg))
            if loop is not None:
                try:
                    loop.call_soon_threadsafe(self._on_message, r.index, msg)
                except RuntimeError:  # the loop is closed: shutting down
                    return
            if msg is None:
                return

    def _on_message(self, index: int, msg: tuple | None) -> None:
        r = self.replicas[index]
        if msg is None:
            return self._replica_died(r)
        kind = msg[0]
        if kind == "events":
            r.load = msg[2]
            for event in msg[1]:
                try:
                    if event[0] == "step":
                        self._on_step(r, event)
                    else:
                        self._on_delta(r, event[1], ReqDelta(*event[2]))
                except Exception as e:  # (a listener, the text): that request fails, the others go on
                    log.error("dp.event_failed", replica=r.index, kind=event[0], exc_info=True)
                    if event[0] == "delta" and (req := r.inflight.get(event[1])) is not None:
                        self._send(r, ("abort", req.rid))
                        self._finish(req, {"type": "abort", "message": f"internal error (front end): "
                                                                      f"{type(e).__name__}: {e}"})
        elif kind == "reply":
            fut, _ = self._calls.pop(msg[1], (None, None))
            if fut is not None and not fut.done():
                fut.set_result(msg[3]) if msg[2] else fut.set_exception(msg[3])

    def _on_step(self, r: Replica, event: tuple) -> None:
        _, is_prefill, duration, rids, steps_run = event
        reqs = [r.inflight[rid] for rid in rids if rid in r.inflight]
        for req in reqs:
            req.kv_len = req.seq_len  # the mirror: every token computed (listeners skip partial prefill chunks)
            req.forward_entry_time = req.forward_entry_time or time.perf_counter() - duration
        if reqs:
            for listener in self.step_listeners:
                listener(_StepView(reqs, is_prefill, steps_run), duration)

    def _on_delta(self, r: Replica, rid: str, d: ReqDelta) -> None:
        req = r.inflight.get(rid)
        if req is None:
            return
        if d.output_ids and req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        req.output_ids.extend(d.output_ids)
        req.text += self._text(req, d) if _text_here(req) else d.text
        req.output_logprobs.extend(d.output_logprobs)
        req.output_top_logprobs.extend(d.output_top_logprobs)
        req.output_token_ids_logprobs.extend(d.output_token_ids_logprobs)
        if d.input_logprobs is not None:
            req.input_logprobs, req.input_top_logprobs, req.input_token_ids_logprobs = d.input_logprobs
        req.cached_tokens = d.cached_tokens
        req.spec_verify_ct, req.spec_num_proposed_drafts, req.spec_num_correct_drafts = d.spec
        req.kv_len = req.seq_len
        if d.finish_reason is not None:
            self._finish(req, d.finish_reason)
        else:
            req.notify()

    def _text(self, req: Req, d: ReqDelta) -> str:
        """The text of a delta's tokens, as the engine's result processing makes it
        (``Scheduler._check_finish``): a stop token's own text only with ``no_stop_trim``, the
        held-back tail flushed when the request stopped or hit its length (not when aborted)."""
        p, detok, eos = req.params, req.detokenizer, self.model_config.eos_ids
        out = [detok.add([t]) for t in d.output_ids
               if p.no_stop_trim or not ((t in eos and not p.ignore_eos) or t in p.stop_token_ids)]
        if d.finish_reason is not None and d.finish_reason.get("type") in ("stop", "length") and detok.matched_stop is None:
            out.append(detok.flush())
        return "".join(out)

    def _finish(self, req: Req, reason: dict) -> None:
        req.finish_reason, req.finish_time = reason, time.perf_counter()
        for r in self.replicas:
            if r.inflight.get(req.rid) is req:
                del r.inflight[req.rid]
        req.notify()
        for listener in self.finish_listeners:
            listener(req)

    def _replica_died(self, r: Replica) -> None:
        if not r.alive or self._closing:
            return
        r.process.join(1.0)
        r.alive, r.error = False, f"data-parallel replica {r.index} died (exit code {r.process.exitcode})"
        self.router.remove(r.index)
        log.error("dp.replica_died", replica=r.index, exit_code=r.process.exitcode, failed_requests=len(r.inflight))
        for req in list(r.inflight.values()):
            self._finish(req, {"type": "abort", "message": f"{r.error}; the request did not finish"})
        for call_id in [k for k, (_, index) in self._calls.items() if index == r.index]:  # (never answered)
            fut, _ = self._calls.pop(call_id)
            if not fut.done():
                fut.set_exception(Unavailable(f"{r.error}; the call did not finish"))
        if not self._live() and self.fatal_error is None:
            self.fatal_error = "every data-parallel replica died"
            for listener in self.fatal_listeners:
                listener(self.fatal_error)

    # ------------------------------------------------------------------ calls (encode, weights)
    def _send(self, r: Replica, msg: tuple) -> None:
        try:
            r.conn.send(msg)
        except (OSError, ValueError):  # its reader thread reports the death
            pass

    async def _call(self, r: Replica, what: str, *args: Any) -> Any:
        self._bind_loop()
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        if not r.alive:
            raise Unavailable(r.error or f"data-parallel replica {r.index} is not serving")
        self._calls[call_id] = fut, r.index
        self._send(r, ("call", call_id, what, *args))
        return await fut

    async def _call_all(self, what: str, *args: Any) -> list[Any]:
        """``_call`` on every live replica at once: each one's reply, or the exception it raised."""
        return await asyncio.gather(*(self._call(r, what, *args) for r in self._live()), return_exceptions=True)

    def _adapters_in_flight(self) -> set[int]:
        """The adapter uids that requests still running on some replica named."""
        return {req.lora_id for r in self.replicas for req in r.inflight.values() if req.lora_id}

    async def encode(self, prompt_ids_list: list[list[int]]) -> list[list[float]]:
        if not self._live():
            raise Unavailable("no data-parallel replica is alive")
        return await self._call(self.replicas[self.router.next()], "encode", prompt_ids_list)

    async def update_weights_from_disk(self, model_path: str, flush_cache: bool = True,
                                       torch_empty_cache: bool = False, load_format: str = "auto") -> tuple[bool, str]:
        """Every live replica reloads (each waits for its own requests and flushes its own prefix
        cache, see ``AsyncEngine.update_weights_from_disk``); success only when all did (their
        messages otherwise)."""
        results = await asyncio.gather(*(self._call(r, "update_weights", model_path, flush_cache, torch_empty_cache,
                                                    load_format)
                                         for r in self._live()))
        failed = [f"replica {r.index}: {msg}" for r, (ok, msg) in zip(self._live(), results) if not ok]
        return (False, "; ".join(failed)) if failed else results[0]

    async def weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """Each live replica's values of parameter ``name`` (``model_loader.weights_by_name``)."""
        return list(await asyncio.gather(*(self._call(r, "weights_by_name", name, truncate_size) for r in self._live())))

    async def pause_generation(self, mode: str = "abort") -> None:
        """SGLang's /pause_generation on every live replica (``core.engine.pause``)."""
        from core.engine.pause import check_mode

        check_mode(mode)  # (here: before any replica pauses)
        await asyncio.gather(*(self._call(r, "pause", mode) for r in self._live()))

    async def continue_generation(self, torch_empty_cache: bool = False) -> None:
        await asyncio.gather(*(self._call(r, "resume", torch_empty_cache) for r in self._live()))

    async def clear_hicache_storage(self) -> bool:
        """Every live replica drops its HiCache storage tier's pages; False when none has one."""
        return any(_answers(await self._call_all("clear_storage")))

    async def shutdown(self) -> None:
        """Stop every replica (killing stragglers); unfinished requests fail."""
        self._closing = True
        for r in self._live():
            self._send(r, ("stop",))
        loop = asyncio.get_running_loop()
        for r in self.replicas:
            await loop.run_in_executor(None, r.process.join, STOP_GRACE_S)
            _kill(r.process)
            for req in list(r.inflight.values()):
                self._finish(req, {"type": "abort", "message": "engine shut down"})
            r.alive = False
            r.conn.close()
        self.grammar.shutdown()


class _ReplicaProfiler:
    """``/start_profile`` and ``/stop_profile`` over the replicas (``AsyncEngine.profiler``'s calls):
    each traces its own steps to its own file; the answer names them all."""

    def __init__(self, engine: DataParallelEngine) -> None:
        self.engine = engine

    async def start(self, *args: Any) -> str:
        results = await self.engine._call_all("start_profile", *args)
        if any(isinstance(x, BaseException) for x in results) and not all(isinstance(x, BaseException) for x in results):
            await self.engine._call_all("stop_profile")  # (the ones that started: all or none runs)
        return _paths(results)

    async def stop(self) -> str:
        return _paths(await self.engine._call_all("stop_profile"))


class _OneReplica:
    """An engine in its own process (``--dp-size 1`` behind the front end): its ``weight_sync`` or
    ``memory_saver`` coroutines, each run there (``Replica._call``, "rl"), tensors as they came."""

    def __init__(self, engine: DataParallelEngine, target: str) -> None:
        self.engine, self.target = engine, target

    def __getattr__(self, op: str) -> Any:
        if op not in RL_OPS:
            raise AttributeError(op)

        async def call(*args: Any) -> Any:
            return await self.engine._call(self.engine.replicas[0], "rl", self.target, op, *args)

        return call


def replica_args(args: EngineArgs, index: int) -> EngineArgs:
    """Replica ``index``'s arguments: one replica's (the front end evicts adapters itself,
    ``ReplicatedAdapters``), on CUDA its own GPUs as SGLang places them (``gpu_index``: after the
    ranks of the replicas before it), named in its ``--device`` (its ``--base-gpu-id`` then 0)."""
    one = attrs.evolve(args, dp_size=1, max_loaded_loras=None)
    device = placed_device(args)
    if device.type != "cuda":
        return one
    first = gpu_index(device.index, args.gpu_id_step, index, args.tp_size // max(1, args.nnodes), 0)
    return attrs.evolve(one, device=f"cuda:{first}", base_gpu_id=0)


def _paths(results: list[Any]) -> str:
    return ", ".join(_answers(results))


def _answers(results: list[Any]) -> list[Any]:
    """``_call_all``'s answers, the first replica's failure raised."""
    for e in results:
        if isinstance(e, BaseException):
            raise e
    return results


def _model_config(args: EngineArgs) -> Any:
    """The front end's view of the model (it holds none: on the CPU)."""
    import torch

    return load_model_config(args.model_path, args.dtype, torch.device("cpu"), args.context_length,
                             args.served_model_name, args.json_model_override_args)


def _serves_images(args: EngineArgs, plugins: PluginManager, model_config: Any) -> bool:
    """Whether the engine would serve the model's image inputs (a vision-language model)."""
    return args.enable_multimodal is not False and model_config.architecture in plugins.names("multimodal_processor")


def _text_here(req: Req) -> bool:
    """Whether the front end turns ``req``'s tokens into text (``ReqSpec.detokenize`` False): it
    has a tokenizer and nothing for the engine to match in the text (stop strings, patterns)."""
    return req.detokenizer is not None and not req.params.stop and not req.params.stop_regex


def _copy_seed(req: Req) -> int | None:
    """The seed of this copy (``make_requests`` gives copy i of an n > 1 request ``seed + i``)."""
    seed = req.params.seed
    if seed is None or req.params.n == 1:
        return seed
    tail = req.rid.rsplit("-", 1)[-1]
    return seed + int(tail) if tail.isdigit() else seed


def _load_tokenizer(args: EngineArgs, path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(args.tokenizer_path or path)
    except Exception as e:
        raise ModelLoadError(f"cannot load tokenizer from {args.tokenizer_path or path}: {e}") from e


# Replica processes are not daemons, so multiprocessing joins them at interpreter exit; an engine
# never shut down (a failed test, an exception in the caller) would then hang the exit forever.
_STARTED: list[tuple[Any, Any]] = []


@atexit.register
def _reap_replicas() -> None:
    """Runs before multiprocessing's own exit join (atexit is last-in, first-out)."""
    for process, conn in _STARTED:
        conn.close()
        if process.is_alive():
            process.join(2)
        _kill(process)


def _kill(process) -> None:
    if process.is_alive():
        process.kill()
        process.join(5)


def create_engine(args: EngineArgs, plugins: PluginManager | None = None, own_process: bool = False):
    """The engine ``args`` ask for: an ``AsyncEngine``, or a ``DataParallelEngine`` with ``--dp-size`` > 1.

    ``own_process`` (``core serve`` on CUDA, ``--enable-frontend-multiprocessing``): with ``--dp-size 1``
    too, the engine runs in a process of its own behind this process's front end, as SGLang's
    scheduler and vLLM's engine core do, so that the HTTP server's Python (parsing, streaming
    events) never holds the interpreter lock the scheduler and the kernel launches need. A
    vision-language model, which replicas do not serve yet, and a multi-node engine stay here."""
    if not isinstance(args.dp_size, int) or args.dp_size < 1:
        raise CoreError(f"--dp-size must be >= 1, got {args.dp_size}")
    if args.dp_size == 1:
        from core.engine.async_engine import AsyncEngine

        if own_process and args.nnodes == 1:
            plugins = plugins or load_plugins(args.plugins, strict=args.strict_plugins)
            if not _serves_images(args, plugins, mc := _model_config(args)):
                log.info("engine.own_process", reason="the HTTP server's Python does not share the engine's GIL",
                         disable_with="--disable-frontend-multiprocessing")
                return DataParallelEngine(args, plugins, mc)
        return AsyncEngine(args, plugins)
    if args.nnodes > 1:
        raise CoreError("--dp-size > 1 with --nnodes > 1 is not supported yet (replicas run on one machine)")
    return DataParallelEngine(args, plugins)
