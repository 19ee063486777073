"""SGLang's native endpoints: /generate, health, model and server info, loads, cache flush,
request abort, weight updates and /metrics. Bodies and errors as SGLang's ``http_server``."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, Callable

import msgspec
import structlog
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from core.engine.frontend import batch_rids, check_total, per_item, token_ids_per_item
from core.engine.request import Req
from core.engine.sampling_params import SamplingParams, under_preferred
from core.errors import InvalidRequest
from core.server.generate_output import output_of, stream_body
from core.server.http import (
    EventStream,
    abort_on_disconnect,
    json_response,
    prepare_off_loop,
    read_body,
    read_body_ignoring_unknown,
    read_optional_body,
    state_of,
)
from core.server.limits import check_sampling_limits, check_sequences
from core.server.lora import adapters_per_item, lora_kwargs
from core.server.metrics import CONTENT_TYPE
from core.server.multimodal import generate_images, images_kwargs, needs_thread
from core.server.request_log import emit as emit_request_log
from core.server.state import ServerState
from core.server.weights import run_update

log = structlog.get_logger("core.server.native")

VERSION = "0.1.0"
HEALTH_GENERATE_TIMEOUT_S = 20.0
LOG_TRUNCATE = 2048


# ---------------------------------------------------------------------------- /generate
class GenerateReqInput(msgspec.Struct):
    """SGLang's GenerateReqInput. Unknown top-level fields are ignored and logged once per name,
    as SGLang ignores them (sglang-router adds its own, such as ``model``)."""

    text: str | list[str] | None = None
    input_ids: list[int | list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    log_metrics: bool = True  # honoured: false keeps the request out of the /metrics counters
    priority: Any = None
    no_logs: bool = False  # honoured: the request is not written to the --log-requests log
    lora_path: str | list[str | None] | None = None  # adapter name(s), one per prompt (core.server.lora)
    image_data: Any = None  # one prompt's image(s), or a list aligned with the batch (core.server.multimodal)
    modalities: Any = None  # SGLang's "image" / "multi-images" (others are refused)
    # routing and tracing hints that do not change the output
    routing_key: Any = None
    conversation_id: Any = None
    custom_labels: Any = None
    external_trace_header: Any = None
    received_time: Any = None
    # the last layer's hidden states in meta_info (core.engine.hidden_states): true, "last", or a list aligned with a batch
    return_hidden_states: Any = None
    # SGLang's CustomLogitProcessor.to_str() (or a list aligned with a batch): core.engine.logit_processor
    custom_logit_processor: Any = None
    # token ids whose logprobs return_logprob reports at each position (a list of lists: one per prompt)
    token_ids_logprob: Any = None
    routed_dp_rank: Any = None  # the data-parallel replica to run on (data_parallel_rank: SGLang's old name)
    data_parallel_rank: Any = None
    # SGLang fields for features core does not have: accepted only when unset (null, false, empty)
    video_data: Any = None
    audio_data: Any = None
    input_embeds: Any = None
    lora_id: Any = None  # SGLang's internal adapter id (lora_path names the adapter)
    session_params: Any = None
    session_id: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    bootstrap_pair_key: Any = None
    decode_tp_size: Any = None
    disagg_prefill_dp_rank: Any = None
    mm_hashes: Any = None
    mm_content_hashes: Any = None
    use_audio_in_video: Any = None
    video_config: Any = None
    watermark: Any = None
    return_sampling_mask: Any = None
    sampling_logprobs_mode: Any = None
    return_flat_raw_top_logprobs: Any = None
    return_flat_raw_output_top_logprobs: Any = None
    return_routed_experts: Any = None
    return_indexer_topk: Any = None
    positional_embed_overrides: Any = None
    background: Any = None
    require_reasoning: Any = None
    max_thinking_tokens: Any = None
    extra_key: Any = None
    cache_salt: Any = None
    return_bytes: Any = None
    return_entropy: Any = None
    return_prompt_token_ids: Any = None
    mm_processor_kwargs: Any = None
    images_config: Any = None
    multi_item_delimiter_indices: Any = None
    token_indices_to_pool: Any = None
    kv_hints: Any = None


# every field from video_data on
_UNSUPPORTED_GENERATE_FIELDS = GenerateReqInput.__struct_fields__[
    GenerateReqInput.__struct_fields__.index("video_data"):]

# SGLang sampling parameters of features core does not have: accepted only when unset
# (beam_width 1 is plain sampling)
_UNSUPPORTED_SAMPLING_KEYS = {"watermark": (None, {}), "beam_width": (None, 1)}


def _sampling_params(d: dict | None, preferred: dict | None = None) -> tuple[SamplingParams, int | None]:
    """SamplingParams from a request dict (None values mean 'default'; ``preferred``:
    ``--preferred-sampling-params``, under the request's own keys, as SGLang merges them), plus a
    per-request stream_interval."""
    if d is not None and not isinstance(d, dict):
        raise InvalidRequest("sampling_params must be an object", param="sampling_params")
    d = under_preferred(preferred, d)
    for key, unset in _UNSUPPORTED_SAMPLING_KEYS.items():
        if key in d and d.pop(key) not in unset:
            raise InvalidRequest(f"sampling parameter {key} is not supported by this server", param=key)
    interval = d.pop("stream_interval", None)
    if interval is not None and (not isinstance(interval, int) or isinstance(interval, bool) or interval < 1):
        raise InvalidRequest("stream_interval must be an integer >= 1", param="stream_interval")
    params = SamplingParams.from_dict(d)
    check_sampling_limits(params)
    return params, interval


def _check_total(state: ServerState, ids: list[int], sp: Any) -> None:
    """SGLang's rule (``check_total``), unless --allow-auto-truncate cuts max_new_tokens to fit."""
    if not state.args.allow_auto_truncate:
        check_total(len(ids), sp.get("max_new_tokens") if isinstance(sp, dict) else None, state.context_len)


def build_generate_requests(state: ServerState, obj: GenerateReqInput) -> tuple[list[Req], bool, int | None]:
    """Validate a /generate body and build its engine requests (nothing is submitted)."""
    engine = state.engine
    for name in _UNSUPPORTED_GENERATE_FIELDS:
        v = getattr(obj, name)
        if v not in (None, False, [], {}):
            raise InvalidRequest(f"{name} is not supported by this server", param=name)
    if obj.text is not None and obj.input_ids is not None:
        raise InvalidRequest("send either text or input_ids, not both", param="text")
    if obj.text is None and obj.input_ids is None:
        raise InvalidRequest("either text or input_ids is required", param="text")
    if obj.text is not None:
        batch = isinstance(obj.text, list)
        prompts: list = obj.text if batch else [obj.text]
        if batch and not prompts:
            raise InvalidRequest("text is an empty list", param="text")
        for p in prompts:
            if p == "":
                raise InvalidRequest("text is empty", param="text")
        is_ids = False
    else:
        ids = obj.input_ids
        batch = bool(ids) and isinstance(ids[0], list)
        if batch and not all(isinstance(x, list) for x in ids):
            raise InvalidRequest("input_ids must be a list of ints or a list of lists of ints", param="input_ids")
        if not batch and not all(isinstance(x, int) for x in ids):
            raise InvalidRequest("input_ids must be a list of ints or a list of lists of ints", param="input_ids")
        prompts = ids if batch else [ids]
        if not prompts or any(len(p) == 0 for p in prompts):
            raise InvalidRequest("input_ids is empty", param="input_ids")
        is_ids = True
    n = len(prompts)
    sps = per_item(obj.sampling_params, n, "sampling_params", {})
    rids = batch_rids(obj.rid, n, batch)
    lps = per_item(obj.return_logprob, n, "return_logprob", False)
    starts = per_item(obj.logprob_start_len, n, "logprob_start_len", -1)
    tops = per_item(obj.top_logprobs_num, n, "top_logprobs_num", 0)
    prios = per_item(obj.priority, n, "priority", None)
    hiddens = per_item(obj.return_hidden_states, n, "return_hidden_states", False)
    procs = per_item(obj.custom_logit_processor, n, "custom_logit_processor", None)
    asked = token_ids_per_item(obj.token_ids_logprob, n)
    dp_rank = obj.data_parallel_rank if obj.routed_dp_rank is None else obj.routed_dp_rank  # (the first: SGLang's old name)
    loras = adapters_per_item(engine, obj.lora_path, n)
    images = generate_images(state, obj.image_data, obj.modalities, n, batch)
    parsed = [_sampling_params(sp, state.args.preferred_sampling_params) for sp in sps]
    # a scoring request (return_logprob, no new tokens) without logprob_start_len gets the whole
    # prompt's logprobs: SGLang would return none, which leaves such a request nothing to read
    # (SGLang's own frontend reads them for select's unconditional_likelihood_normalized)
    starts = [0 if lp and start in (None, -1) and params.max_new_tokens == 0 else start
              for lp, start, (params, _) in zip(lps, starts, parsed)]
    check_sequences(sum(params.n if isinstance(params.n, int) else 1 for params, _ in parsed), "text")
    reqs: list[Req] = []
    interval = None
    for i, p in enumerate(prompts):
        params, iv = parsed[i]
        interval = iv if iv is not None else interval
        token_ids = state.tokenize(None if is_ids else p, p if is_ids else None, "text")
        token_ids = state.fit_prompt(token_ids)
        _check_total(state, token_ids, sps[i])
        rid = rids[i]  # a rid that is running, or given twice, is refused by ServerState.submit
        group = obj.rid if batch and isinstance(obj.rid, str) else None  # /abort_request {rid} reaches every item
        reqs += engine.make_requests(token_ids, params, rid or uuid.uuid4().hex, bool(lps[i]), starts[i], tops[i],
                                     priority=prios[i], group=group, **lora_kwargs(loras[i]),
                                     **images_kwargs(images[i]), return_hidden_states=hiddens[i],
                                     custom_logit_processor=procs[i], token_ids_logprob=asked[i],
                                     routed_dp_rank=dp_rank)
    for r in reqs:
        r.log_metrics = obj.log_metrics
    return reqs, batch, interval


def _log_received(state: ServerState, reqs: list[Req], body: Any) -> None:
    if not state.args.log_requests:
        return
    if getattr(body, "no_logs", False):
        state.unlogged.update(reqs)
        return
    level = state.args.log_requests_level
    fields: dict[str, Any] = {"rids": [r.rid for r in reqs], "prompt_tokens": [len(r.prompt_ids) for r in reqs]}
    if level >= 1:
        fields["sampling_params"] = getattr(body, "sampling_params", None)
    if level >= 2:
        text = getattr(body, "text", None)
        if text is None:
            text = getattr(body, "input_ids", None)
        fields["input"] = _clip(text, level)
    emit_request_log(state, "request.received", **fields)


def _clip(v: Any, level: int) -> Any:
    if level >= 3 or v is None:
        return v
    s = v if isinstance(v, str) else json.dumps(v)
    return s if len(s) <= LOG_TRUNCATE else s[:LOG_TRUNCATE] + f"...(+{len(s) - LOG_TRUNCATE} chars)"


def request_logger(state: ServerState) -> Callable[[Req], None]:
    """A finish listener that logs each request's output (``--log-requests``, at its level now:
    ``/configure_logging`` changes both)."""

    def on_finish(req: Req) -> None:
        if not state.args.log_requests or req.rid.startswith(("HEALTH_CHECK_", "WARMUP_")) or req in state.unlogged:
            return
        level = state.args.log_requests_level
        try:
            fields: dict[str, Any] = {"rid": req.rid, "completion_tokens": len(req.output_ids),
                                      "finish_reason": req.finish_reason}
            if level >= 2:
                fields["output"] = _clip(req.text if req.detokenizer is not None else list(req.output_ids), level)
            emit_request_log(state, "request.output", **fields)
        except Exception:  # logging must never break serving
            pass

    return on_finish


async def generate(request: Request) -> Response:
    state = state_of(request)
    obj = await read_body_ignoring_unknown(request, GenerateReqInput, "generate.unknown_field_ignored")
    reqs, batch, req_interval = await (asyncio.to_thread(build_generate_requests, state, obj)  # images: off the loop
                                       if needs_thread(obj.image_data) else
                                       prepare_off_loop(request, build_generate_requests, state, obj))
    await state.engine.prepare_grammars(reqs)  # constrained requests: compile off the loop (400 if invalid)
    state.submit(reqs)
    _log_received(state, reqs, obj)
    engine = state.engine
    with_text = obj.return_text_in_logprobs

    def abort_unfinished() -> None:
        for r in reqs:
            if not r.finished:
                engine.abort(r.rid)

    if obj.stream:
        return EventStream(stream_body(state, reqs, with_text, req_interval or max(1, state.args.stream_interval)))

    try:
        async with abort_on_disconnect(request, abort_unfinished):
            await asyncio.gather(*(engine.drain(r) for r in reqs))
    finally:
        abort_unfinished()
    outs = [output_of(state, r, with_text) for r in reqs]
    return json_response(outs if batch or len(reqs) > 1 else outs[0])


# ---------------------------------------------------------------------------- other native endpoints
async def health(request: Request) -> Response:
    """200 while serving; 503 before the warm-up, while draining and once the engine has failed
    (a watchdog trip), so a load balancer stops sending requests. Never waits on the engine."""
    state = state_of(request)
    ok = state.ready and not state.shutting_down and state.healthy
    replicas = getattr(state.engine, "replica_loads", None)
    if replicas is not None and state.engine.args.dp_size > 1:  # which replicas serve (a dead one is out of
        # rotation, with why); one engine in its own process answers as one in this process
        keys = ("dp_rank", "alive", "pid", "error")
        return json_response({"dp_replicas": [{k: r[k] for k in keys if k in r} for r in replicas()]},
                             status=200 if ok else 503)
    return Response(status_code=200 if ok else 503)


async def ping(request: Request) -> Response:
    """SageMaker's health check (SGLang's ``/ping``), and SGLang's readiness probe ``/ready``: 200 while
    serving, else 503, with no body."""
    state = state_of(request)
    return Response(status_code=200 if state.ready and not state.shutting_down and state.healthy else 503)


async def health_generate(request: Request) -> Response:
    state = state_of(request)
    if not state.ready or state.shutting_down or not state.healthy:
        return Response(status_code=503)
    ok = await run_internal_generate(state, "HEALTH_CHECK_", max_new_tokens=1, timeout=HEALTH_GENERATE_TIMEOUT_S)
    return Response(status_code=200 if ok else 503)


async def run_internal_generate(state: ServerState, prefix: str, max_new_tokens: int, timeout: float) -> bool:
    """A tiny greedy generate that bypasses the queue limit and the metrics; True if it produced a token
    (an embedding server: one embedding, as SGLang's health check encodes there)."""
    engine = state.engine
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    if engine.tokenizer is not None:
        ids = engine.tokenize("The capital of France is", None)
    else:
        ids = [0, 1, 2, 3]
    if engine.args.is_embedding:
        try:
            return bool(await asyncio.wait_for(engine.encode([ids[:8]]), timeout))
        except asyncio.TimeoutError:
            return False
    reqs = engine.make_requests(ids[: max(1, engine.model_config.context_len - max_new_tokens - 1)], params,
                                rid=f"{prefix}{uuid.uuid4().hex}")
    engine.submit(reqs)
    try:
        await asyncio.wait_for(asyncio.gather(*(engine.drain(r) for r in reqs)), timeout)
    except asyncio.TimeoutError:
        return False
    finally:
        for r in reqs:
            if not r.finished:
                engine.abort(r.rid)
    return all(r.output_ids and (r.finish_reason or {}).get("type") != "abort" for r in reqs)


async def get_model_info(request: Request) -> Response:
    state = state_of(request)
    mc = state.engine.model_config
    hf = mc.hf_config
    return json_response({
        "model_path": state.model_path,
        "tokenizer_path": state.args.tokenizer_path or state.model_path,
        "is_generation": not state.engine.args.is_embedding,  # --is-embedding serves /encode, /classify only
        "preferred_sampling_params": state.args.preferred_sampling_params,
        "weight_version": state.weight_version,
        "served_model_name": state.served_model_name,
        "load_format": state.engine.args.load_format,
        "reasoning_parser": state.args.reasoning_parser,
        "tool_call_parser": state.args.tool_call_parser,
        "has_image_understanding": getattr(state.engine, "multimodal", None) is not None,
        "has_audio_understanding": False,
        "model_type": getattr(hf, "model_type", None),
        "architectures": getattr(hf, "architectures", None) or [mc.architecture],
        "architecture": mc.architecture,
        "context_length": mc.context_len,
        "vocab_size": state.engine.vocab_size,
        "dtype": str(mc.dtype).removeprefix("torch."),
    })


def _resolved(engine: Any) -> dict[str, Any]:
    """The flags the engine resolved when left unset, by their values (SGLang's resolved server args)."""
    values = {"random_seed": getattr(engine, "random_seed", None),
              "chunked_prefill_size": getattr(engine, "chunked_prefill_size", None),
              "max_total_tokens": engine.max_total_tokens, "page_size": engine.allocator.page_size}
    return {k: v for k, v in values.items() if v is not None}


async def get_server_info(request: Request) -> Response:
    state = state_of(request)
    engine = state.engine
    load = engine.load()
    # one entry per data-parallel replica (their latest reports); throughput is the whole server's
    per_replica = engine.replica_loads() if hasattr(engine, "replica_loads") and engine.args.dp_size > 1 else [load]
    return json_response({
        **state.args.flags,
        **_resolved(engine),
        "served_model_name": state.served_model_name,
        "model_path": state.model_path,
        "max_total_num_tokens": engine.max_total_tokens,
        "max_req_input_len": engine.model_config.context_len - 1,
        "context_length": engine.model_config.context_len,
        "max_running_requests": engine.max_running_requests,
        "internal_states": [{
            "last_gen_throughput": state.metrics.throughput() if state.metrics.enabled else 0.0,
            **state.metrics.spec_report(),
            **{k: one[k] for k in ("dp_rank", "alive", "num_running_reqs", "num_waiting_reqs", "token_usage",
                                   "cache_hit_rate") if k in one},
        } for one in per_replica],
        "version": VERSION,
        "uptime_s": round(time.time() - state.started_at, 3),
    })


async def loads(request: Request) -> Response:
    state = state_of(request)
    engine = state.engine
    if hasattr(engine, "replica_loads"):  # --dp-size > 1: each live replica's latest report, and their sum
        loads = [{"dp_rank": r["dp_rank"], **_load_keys(r)} for r in engine.replica_loads() if r["alive"]]
        aggregate = _load_keys(engine.load())
    else:
        loads = [{"dp_rank": 0, **_load_keys(engine.load())}]
        aggregate = {k: v for k, v in loads[0].items() if k != "dp_rank"}
    return json_response({"timestamp": time.time(), "version": VERSION, "loads": loads, "aggregate": aggregate})


async def get_load(request: Request) -> Response:
    """SGLang's ``/get_load``: a list with one load per data-parallel rank (``dp_rank``,
    ``num_reqs`` running and waiting, ``num_waiting_reqs``, ``num_tokens`` held in the KV cache),
    the shape sglang-router's load-aware policies parse. ``/v1/loads`` has the detailed form."""
    engine = state_of(request).engine
    if hasattr(engine, "replica_loads"):  # --dp-size > 1: each live replica's latest report
        ranks = [r for r in engine.replica_loads() if r["alive"]]
    else:
        ranks = [{"dp_rank": 0, **engine.load()}]
    return json_response([{"dp_rank": r["dp_rank"], "num_reqs": r.get("num_total_reqs", 0),
                           "num_waiting_reqs": r.get("num_waiting_reqs", 0), "num_tokens": r.get("num_used_tokens", 0)}
                          for r in ranks])


async def flush_cache(request: Request) -> Response:
    state = state_of(request)
    if state.engine.has_work():
        return PlainTextResponse("Cache not flushed: there are running or waiting requests; retry when the server is idle.\n",
                                 status_code=400)
    if not state.engine.flush_cache():  # a request arrived in between
        return PlainTextResponse("Cache not flushed: there are running or waiting requests; retry when the server is idle.\n",
                                 status_code=400)
    return PlainTextResponse("Cache flushed.\n")


async def freeze_gc(request: Request) -> Response:
    """SGLang's /freeze_gc: what the server holds now leaves later garbage-collector passes (it
    freezes once ready too; after a warm-up of the user's own, this freezes what that built)."""
    await state_of(request).engine.freeze_gc()
    return PlainTextResponse("Garbage collection frozen.\n")


async def clear_hicache_storage_backend(request: Request) -> Response:
    """SGLang's /clear_hicache_storage_backend (and POST /hicache/storage-backend/clear): drop the
    HiCache storage tier's pages (``/flush_cache`` empties it too); 400 without one."""
    engine = state_of(request).engine
    if (clear_replicas := getattr(engine, "clear_hicache_storage", None)) is not None:  # (in other processes)
        cleared = await clear_replicas()
    else:
        clear = getattr(getattr(engine, "tree_cache", None), "clear_storage", None)
        cleared = clear is not None and await asyncio.to_thread(clear)  # (waits for the queued writes first)
    if not cleared:
        return PlainTextResponse("No HiCache storage backend to clear: start with --enable-hierarchical-cache "
                                 "--hicache-storage-backend file.\n", status_code=400)
    return JSONResponse("Hierarchical cache storage backend cleared.")


class AbortReq(msgspec.Struct, forbid_unknown_fields=True):
    """SGLang's AbortReq. ``abort_message`` is the error an ``abort_all`` gives its requests; a
    custom ``finished_reason`` (and a message for one ``rid``) is refused when set, not ignored."""

    rid: str = ""
    abort_all: bool = False
    finished_reason: Any = None
    abort_message: Any = None


async def abort_request(request: Request) -> Response:
    state = state_of(request)
    obj = await read_body(request, AbortReq)
    engine = state.engine
    if obj.finished_reason is not None:
        raise InvalidRequest("finished_reason is not supported: an aborted request finishes as 'abort'",
                             param="finished_reason")
    if obj.abort_message is not None and not obj.abort_all:
        raise InvalidRequest("abort_message is only supported with abort_all", param="abort_message")
    if obj.abort_all:
        engine.abort_all(obj.abort_message if isinstance(obj.abort_message, str) else "request aborted")
    elif obj.rid:
        engine.abort(obj.rid)
    else:
        raise InvalidRequest("rid is required unless abort_all is true", param="rid")
    return Response(status_code=200)


class UpdateWeightFromDiskReqInput(msgspec.Struct, forbid_unknown_fields=True):
    """SGLang's UpdateWeightFromDiskReqInput. ``flush_cache`` and ``torch_empty_cache`` are honoured
    (see ``AsyncEngine.update_weights_from_disk``); CUDA graphs are always recaptured (the new
    weights are a new module, the old graphs would read the old ones), which honours
    ``recapture_cuda_graph`` either way; the fields of features this server lacks
    (``_UNSUPPORTED_UPDATE_FIELDS``) are refused when set, not ignored."""

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True


# field -> why it cannot be honoured (keep_pause is: an update never ends a /pause_generation, as in SGLang)
_UNSUPPORTED_UPDATE_FIELDS = {
    "is_async": "asynchronous weight updates are not supported; the update completes before the response",
    "token_step": "outputs are not tagged with trainer steps by this server",
}

_UPDATE_DEFAULTS = UpdateWeightFromDiskReqInput(model_path="")


async def update_weights_from_disk(request: Request) -> Response:
    state = state_of(request)
    obj = await read_body(request, UpdateWeightFromDiskReqInput)
    if obj.load_format not in (None, "auto", "safetensors", "pt", "gguf"):
        raise InvalidRequest(f"load_format {obj.load_format!r} is not supported", param="load_format")
    for name, why in _UNSUPPORTED_UPDATE_FIELDS.items():
        if getattr(obj, name) != getattr(_UPDATE_DEFAULTS, name):
            raise InvalidRequest(f"{name} is not supported: {why}", param=name)
    success, message = await run_update(state, obj, lambda: state.engine.update_weights_from_disk(
        obj.model_path, flush_cache=obj.flush_cache, torch_empty_cache=obj.torch_empty_cache,
        load_format=obj.load_format or "auto"))
    if success:
        state.model_path = obj.model_path
    return json_response({"success": success, "message": message, "num_paused_requests": 0},
                         status=200 if success else 400)


class GetWeightsByNameReqInput(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    truncate_size: int = 100


async def get_weights_by_name(request: Request) -> Response:
    """SGLang's /get_weights_by_name: the parameter's first ``truncate_size`` rows (a list per
    data-parallel replica with --dp-size > 1, as SGLang's)."""
    from core.engine.model_loader.weights_by_name import weights_by_name

    state = state_of(request)
    obj = await read_body(request, GetWeightsByNameReqInput)
    engine = state.engine
    if hasattr(engine, "model"):  # (an engine in this process)
        return json_response(await asyncio.to_thread(weights_by_name, engine.model, obj.name, obj.truncate_size))
    values = await engine.weights_by_name(obj.name, obj.truncate_size)
    return json_response(values[0] if engine.args.dp_size <= 1 else values)


class PauseGenerationReqInput(msgspec.Struct, forbid_unknown_fields=True):
    """SGLang's: ``abort``, ``retract`` or ``in_place`` (core.engine.pause)."""

    mode: str = "abort"


class ContinueGenerationReqInput(msgspec.Struct, forbid_unknown_fields=True):
    torch_empty_cache: bool = True  # (CUDA's cached blocks back to the driver first)


async def pause_generation(request: Request) -> Response:
    """SGLang's /pause_generation: answers once no step runs (``core.engine.pause``)."""
    obj = await read_optional_body(request, PauseGenerationReqInput)
    await state_of(request).engine.pause_generation(obj.mode)
    return json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: Request) -> Response:
    obj = await read_optional_body(request, ContinueGenerationReqInput)
    await state_of(request).engine.continue_generation(obj.torch_empty_cache)
    return json_response({"message": "Generation continued successfully.", "status": "ok"})


class UpdateWeightVersionReqInput(msgspec.Struct, forbid_unknown_fields=True):
    """SGLang's UpdateWeightVersionReqInput: a new version string for the weights being served."""

    new_version: str
    abort_all_requests: bool = True


async def update_weight_version(request: Request) -> Response:
    """SGLang's /update_weight_version: relabel the served weights (nothing is reloaded); by
    default the running requests are aborted first, as SGLang does."""
    state = state_of(request)
    obj = await read_body(request, UpdateWeightVersionReqInput)
    if obj.abort_all_requests:
        state.engine.abort_all("aborted to update the weight version")
    state.weight_version = obj.new_version
    log.info("server.weight_version", weight_version=obj.new_version)
    return json_response({"success": True, "message": f"Weight version updated to {obj.new_version}",
                          "new_version": obj.new_version})


async def metrics_endpoint(request: Request) -> Response:
    state = state_of(request)
    if not state.metrics.enabled:
        raise HTTPException(404)
    return Response(state.metrics.render(state.ready), media_type=CONTENT_TYPE)


_LOAD_KEYS = ("num_running_reqs", "num_waiting_reqs", "num_total_reqs", "num_used_tokens", "num_free_tokens",
              "max_total_num_tokens", "token_usage", "max_running_requests")


def _load_keys(load: dict) -> dict:
    """SGLang's /get_load keys of ``AsyncEngine.load()``."""
    return {k: load[k] for k in _LOAD_KEYS}
