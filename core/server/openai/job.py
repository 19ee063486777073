"""What chat and completions share: validation, sampling parameters, the context check, and
:class:`Job`, one API request turned into engine requests (choice ``i`` is sequence ``i % n``
of prompt ``i // n``) with its outputs, usage and the end every stream shares."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from typing import Any, AsyncIterator, Mapping

import msgspec
import structlog

from core.engine.sampling_params import SamplingParams, seed_named
from core.errors import InvalidRequest
from core.server.http import SSE_DONE, ApiError, log_ignored_field, read_body, sse_error
from core.server.limits import MAX_N, MAX_SEQUENCES, check_sampling_limits  # noqa: F401 (MAX_SEQUENCES: re-exported)
from core.server.lora import lora_kwargs, request_adapters
from core.server.openai.chat_template import REASONING_EFFORTS
from core.server.openai.logprobs import vocab_of
from core.server.openai.protocol import (
    IGNORED_FIELDS, NOOP_FIELDS, CompletionTokensDetails, PromptTokensDetails, UsageInfo,
)
from core.server.request_log import emit as emit_request_log

log = structlog.get_logger("core.server.openai")

MAX_TOP_LOGPROBS = 20
MAX_TEMPERATURE = 2.0
JSON_OBJECT = '{"type": "object"}'


def check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequest(message, param=param)


def check_fields(body: Mapping[str, Any], typ: type, noop: Mapping[str, tuple[Any, ...]] | None = None) -> None:
    """The unknown-field policy (``core.server.openai.protocol``) over a request body's top-level
    keys, for the request Struct ``typ`` (its no-op fields ``noop``, by default ``NOOP_FIELDS``'s).
    Values are ``msgspec.Raw`` (an HTTP body) or plain JSON values (a batch line); only those of
    the no-op fields are read."""
    known = typ.__struct_encode_fields__
    noop = NOOP_FIELDS[typ] if noop is None else noop
    for name, value in body.items():
        if name in known:
            continue
        if name in IGNORED_FIELDS:
            log_ignored_field("request.field_ignored", name)
        elif name in noop:
            if isinstance(value, msgspec.Raw):
                value = msgspec.json.decode(value)
            shown = " or ".join(json.dumps(v) for v in noop[name])
            check(value in noop[name], f"{name} is not supported by this server (accepted only as {shown})", name)
        else:
            raise InvalidRequest(f"unknown field {name!r}: this server does not support it", param=name)


async def read_checked(request: Any, typ: type, noop: Mapping[str, tuple[Any, ...]] | None = None) -> Any:
    """The body as ``typ``, then the unknown-field policy over its top-level keys (values left raw)."""
    r = await read_body(request, typ)
    check_fields(msgspec.json.decode(await request.body(), type=dict[str, msgspec.Raw]), typ, noop)
    return r


_REGEX_META = frozenset("\\.^$|?*+()[]{}")


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of ``choices`` (vLLM's ``choice``). Only the metacharacters are
    escaped (``re.escape`` escapes more, such as spaces), so xgrammar's and llguidance's regex
    dialects both read every choice as a literal."""
    return "(" + "|".join("".join("\\" + c if c in _REGEX_META else c for c in s) for s in choices) + ")"


# vLLM's constraint keys (of structured_outputs; guided_<key> at the top level) -> our kinds
_VLLM_KINDS = {"json": "json_schema", "regex": "regex", "choice": "regex", "grammar": "ebnf",
               "json_object": "json_schema", "structural_tag": "structural_tag"}


def _vllm_constraint(param: str, key: str, value: Any) -> tuple[str, str, str] | None:
    """One vLLM constraint field as (kind, spec, param); None when unset (``json_object`` false too)."""
    if value is None or value is False:
        return None
    if key == "choice":
        check(bool(value), f"{param} must list at least one choice", param)
        spec = choice_regex(value)
    elif key == "json_object":
        spec = JSON_OBJECT
    else:
        spec = value if isinstance(value, str) else json.dumps(value)
    return _VLLM_KINDS[key], spec, param


def vllm_json_options(r: Any) -> tuple[dict[str, Any], bool]:
    """vLLM's per-request JSON options: (the grammar backend's whitespace keywords, whether additional
    properties are disallowed): ``guided_whitespace_pattern``, and ``structured_outputs``'
    ``whitespace_pattern``, ``disable_any_whitespace`` and ``disable_additional_properties``."""
    so = r.structured_outputs
    opts: dict[str, Any] = {}
    pattern = r.guided_whitespace_pattern if so is None or so.whitespace_pattern is None else so.whitespace_pattern
    if pattern is not None:
        check(isinstance(pattern, str) and _compiles(pattern), f"whitespace_pattern {pattern!r} is not a regular "
              "expression", "structured_outputs.whitespace_pattern" if so is not None and so.whitespace_pattern
              is not None else "guided_whitespace_pattern")
        opts["whitespace_pattern"] = pattern
    if so is not None and so.disable_any_whitespace:
        opts["any_whitespace"] = False
    return opts, bool(so is not None and so.disable_additional_properties)


def _compiles(pattern: str) -> bool:
    try:
        re.compile(pattern)
    except re.error:
        return False
    return True


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that does not set it
    (vLLM's ``disable_additional_properties``)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _vllm_constraints(r: Any) -> list[tuple[str, str, str]]:
    """vLLM's structured output as (kind, spec, param): ``structured_outputs`` (vLLM >= 0.10) and the
    older top-level ``guided_*`` and ``structural_tag`` (their options: :func:`vllm_json_options`)."""
    found = [_vllm_constraint(f"guided_{key}", key, getattr(r, f"guided_{key}"))
             for key in ("json", "regex", "choice", "grammar", "json_object")]
    found.append(_vllm_constraint("structural_tag", "structural_tag", r.structural_tag))
    so = r.structured_outputs
    if so is not None:
        if so.backend is not None:
            log_ignored_field("request.field_ignored", "structured_outputs.backend")
        own = [_vllm_constraint(f"structured_outputs.{key}", key, getattr(so, key)) for key in _VLLM_KINDS]
        check(any(own), "structured_outputs needs one of " + ", ".join(_VLLM_KINDS), "structured_outputs")
        found += own
    return [c for c in found if c is not None]


def request_constraint(r: Any) -> dict[str, Any]:
    """Structured output of a request as SamplingParams fields: response_format (json_schema,
    json_object, structural_tag), SGLang's extra_body regex / json_schema / ebnf, or vLLM's fields
    (:func:`_vllm_constraints`). At most one; the same constraint asked twice counts once (guidance
    sends vLLM's old and new field together). vLLM's JSON options shape a JSON schema constraint
    (``json_options``, and the schema's objects closed); on another they are ignored, as vLLM does."""
    found = [(name, getattr(r, name), name) for name in ("regex", "json_schema", "ebnf")
             if getattr(r, name) is not None]
    rf = r.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_schema":
            js = rf.get("json_schema")
            schema = js.get("schema", js.get("schema_")) if isinstance(js, dict) else None
            check(isinstance(schema, (dict, bool)), "response_format json_schema needs json_schema.schema (an object)",
                  "response_format")
            found.append(("json_schema", json.dumps(schema), "response_format"))
        elif kind == "json_object":
            found.append(("json_schema", JSON_OBJECT, "response_format"))
        elif kind == "structural_tag":
            found.append(("structural_tag", json.dumps(rf), "response_format"))
        else:
            check(kind in (None, "text"), f"response_format type {kind!r} is not supported; use text, json_object, "
                  "json_schema or structural_tag", "response_format")
    distinct: dict[tuple[str, str], str] = {}
    for kind, spec, param in found + _vllm_constraints(r):
        distinct.setdefault((kind, spec), param)
    if len(distinct) > 1:
        params = list(distinct.values())
        raise InvalidRequest(f"only one constraint per request is allowed, got {', '.join(params)}", param=params[1])
    out: dict[str, Any] = {kind: spec for kind, spec in distinct}
    opts, closed = vllm_json_options(r)
    if "json_schema" in out and (opts or closed):
        if closed:
            out["json_schema"] = json.dumps(closed_objects(json.loads(out["json_schema"])))
        out["json_options"] = opts or None
    elif opts or closed:
        log_ignored_field("request.field_ignored", "structured_outputs options (no JSON constraint)")
    return out


def effort_template_kwargs(effort: str | None, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """A reasoning effort into chat template kwargs, SGLang's mapping (chat's ``reasoning_effort``
    and the Responses API's ``reasoning.effort``): ``none`` switches the templates' thinking off,
    another effort reaches the template as ``reasoning_effort``; explicit kwargs win."""
    kwargs = dict(kwargs or {})
    if effort == "none":
        return {"thinking": False, "enable_thinking": False, **kwargs}
    if effort is not None:
        kwargs.setdefault("reasoning_effort", effort)
    return kwargs


def apply_reasoning_effort(r: Any, defaults: dict[str, Any] | None = None) -> None:
    """A chat request's ``reasoning_effort`` into its template kwargs, as the Responses API does; then
    ``defaults`` (``--default-chat-template-kwargs``) under them, per key, as SGLang merges them (so
    the reasoning parser and the thinking budget read the merged kwargs). A default
    ``reasoning_effort`` stands for the request's when it sets none, and gives way to its own."""
    if defaults:
        defaults = dict(defaults)
        default_effort = defaults.pop("reasoning_effort", None)
        if r.reasoning_effort is None and "reasoning_effort" not in (r.chat_template_kwargs or {}):
            r.reasoning_effort = default_effort
    effort = getattr(r, "reasoning_effort", None)
    if effort is not None:
        check(effort in REASONING_EFFORTS, f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, "
              f"got {effort!r}", "reasoning_effort")
        r.chat_template_kwargs = effort_template_kwargs(effort, r.chat_template_kwargs)
    if defaults:
        r.chat_template_kwargs = {**defaults, **(r.chat_template_kwargs or {})}


def common_checks(r: Any, template_defaults: dict[str, Any] | None = None) -> tuple[int, dict[str, str]]:
    """Validation shared by chat and completions (vLLM's fields mapped on the way); returns (n, the
    request's constraint). ``template_defaults``: a chat's ``--default-chat-template-kwargs``."""
    n = 1 if r.n is None else r.n
    check(1 <= n <= MAX_N, f"n must be between 1 and {MAX_N}, got {n}", "n")
    if r.temperature is not None:
        check(0 <= r.temperature <= MAX_TEMPERATURE, f"temperature must be between 0 and {MAX_TEMPERATURE:g}, "
              f"got {r.temperature}", "temperature")
    constraint = request_constraint(r)
    apply_reasoning_effort(r, template_defaults)
    if r.min_tokens is not None:
        check(r.min_tokens >= 0, f"min_tokens must be >= 0, got {r.min_tokens}", "min_tokens")
    return n, constraint


def check_min_tokens(r: Any, max_tokens: int | None, name: str = "max_tokens") -> None:
    """min_tokens above an explicit max_tokens is a 400, as on /generate (vLLM and SGLang refuse it too)."""
    if r.min_tokens is not None and max_tokens is not None:
        check(r.min_tokens <= max_tokens, f"min_tokens must be <= {name}, got {r.min_tokens} > {max_tokens}", "min_tokens")


def sampling_params(r: Any, max_new: int, n: int, constraint: dict[str, str],
                    defaults: dict[str, Any] | None = None, preferred: dict[str, Any] | None = None) -> SamplingParams:
    """The request's sampling parameters. What the request leaves unset takes ``preferred``
    (``--preferred-sampling-params``; ``max_new_tokens`` caps the room a request without
    ``max_tokens`` has); an omitted temperature, top_p, top_k, min_p or repetition_penalty
    then takes ``defaults`` (chat: the model's generation_config.json under
    ``--sampling-defaults model``, as SGLang), else OpenAI's."""
    pre = seed_named(preferred or {})
    d = {**(defaults or {}), **pre}
    if "max_new_tokens" in pre and getattr(r, "max_completion_tokens", None) is None and r.max_tokens is None:  # (chat)
        max_new = min(max_new, pre["max_new_tokens"])
    src = r.stop if r.stop is not None else pre.get("stop")
    stop = [src] if isinstance(src, str) else list(src or [])

    def pick(name: str, off: Any, field: str | None = None) -> Any:
        value = getattr(r, field or name)
        return d.get(name, off) if value is None else value

    top_k = pick("top_k", -1)
    params = SamplingParams(
        max_new_tokens=max_new,
        min_new_tokens=min(pick("min_new_tokens", 0, "min_tokens"), max_new),
        temperature=pick("temperature", 1.0),
        top_p=pick("top_p", 1.0),
        top_k=-1 if top_k == 0 else top_k,
        min_p=pick("min_p", 0.0),
        frequency_penalty=pick("frequency_penalty", 0.0),
        presence_penalty=pick("presence_penalty", 0.0),
        repetition_penalty=pick("repetition_penalty", 1.0),
        stop=[s for s in stop if s],  # OpenAI clients sometimes send "" entries
        stop_token_ids=list(pick("stop_token_ids", None) or []),
        ignore_eos=bool(pick("ignore_eos", False)),
        skip_special_tokens=pick("skip_special_tokens", True) is not False,
        spaces_between_special_tokens=pick("spaces_between_special_tokens", True) is not False,
        no_stop_trim=bool(pick("no_stop_trim", False) or r.include_stop_str_in_output),
        n=n,
        seed=pick("seed", None),
        logit_bias=r.logit_bias or None,
        custom_params=getattr(r, "custom_params", None),
        **constraint,
    )
    check_sampling_limits(params)
    return params


def fit_context(state: Any, ids: list[int], max_tokens: int | None, param: str) -> tuple[list[int], int]:
    """Check the prompt and ``max_tokens`` against the context; returns (ids, max_new_tokens).
    With ``--allow-auto-truncate`` the prompt is cut as on every endpoint (``ServerState.fit_prompt``:
    its head is kept) and ``max_tokens`` is cut to what still fits; without it either overflow is a 400."""
    engine = state.engine
    ctx = engine.model_config.context_len
    auto = state.args.allow_auto_truncate
    if max_tokens is not None:
        check(max_tokens >= 0, f"max_tokens must be >= 0, got {max_tokens}", "max_tokens")
    if not ids:
        raise InvalidRequest("the prompt is empty", param=param)
    if len(ids) >= ctx and not auto:
        raise InvalidRequest(f"This model's maximum context length is {ctx} tokens. However, your prompt has {len(ids)} "
                             f"tokens. Please reduce the length of the prompt.", param=param)
    ids = state.fit_prompt(ids)
    room = ctx - len(ids)
    if max_tokens is None:
        # unlimited: until the context is full, bounded by what one request may hold in the KV pool
        return ids, max(0, min(room, engine.max_total_tokens - len(ids)))
    if max_tokens > room:
        if not auto:
            raise InvalidRequest(f"This model's maximum context length is {ctx} tokens. However, you requested "
                                 f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the completion). "
                                 f"Please reduce the length of the prompt or max_tokens.", param="max_tokens")
        return ids, room
    return ids, max_tokens


def engine_error(e: InvalidRequest) -> InvalidRequest:
    """An engine error in the OpenAI API's words (max_tokens, not max_new_tokens)."""
    names = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "input_ids": "prompt", "text": "prompt",
             "image_data": "messages"}
    if e.param in names:
        msg = e.message
        for old, new in names.items():
            msg = msg.replace(old, new)
        return InvalidRequest(msg, param=names[e.param])
    return e


def finish_of(out: dict) -> tuple[str | None, Any]:
    """(finish_reason type or None while running, the matched stop)."""
    fr = out["meta_info"]["finish_reason"]
    if not fr:
        return None, None
    return fr.get("type"), fr.get("matched")


def weight_version_metadata(state: Any) -> dict[str, Any] | None:
    """SGLang's ``metadata`` of a non-streaming response: the weight version serving it."""
    version = getattr(state, "weight_version", None)  # (a test's stub state may have none)
    return None if version is None else {"weight_version": version}


def raise_if_aborted(out: dict | None) -> None:
    if out is None:
        raise ApiError(500, "the request ended without output")
    fr = out["meta_info"]["finish_reason"]
    if fr and fr.get("type") == "abort":
        msg = fr.get("message") or "request aborted"
        status = 503 if "shut down" in msg else 500
        raise ApiError(status, f"the request was aborted: {msg}")


class Job:
    """One API request turned into engine requests, from submission to the last output."""

    def __init__(self, state: Any, kind: str, r: Any, rid: str | None) -> None:
        self.state, self.kind, self.r = state, kind, r
        self.engine = state.engine
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        self.id = rid or r.rid or r.request_id or prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = r.model or state.served_model_name
        self.stream = bool(r.stream)
        opts = r.stream_options
        # --stream-response-default-include-usage: the usage chunk even where stream_options says false (SGLang's "or")
        self.include_usage = self.stream and bool((opts is not None and opts.include_usage)
                                                  or state.args.stream_response_default_include_usage)
        # vLLM's continuous_usage_stats: with include_usage, every chunk carries the usage so far
        self.continuous_usage = self.include_usage and bool(opts is not None and opts.continuous_usage_stats)
        self.cache_report = state.args.enable_cache_report
        self.interval = max(1, state.args.stream_interval)
        self.n = 1
        self.reqs: list[Any] = []
        self.logprobs = False
        self.top = 0
        self.adapters: list[str | None] = []  # the LoRA adapter of each prompt (core.server.lora)
        # (the reasoning's end tag, its start tag or ()) where the output reasons first (chat): usage counts it
        self.reasoning_ids: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    @property
    def vocab(self) -> Any:
        return vocab_of(self.engine)

    # ---- building
    def select_adapters(self, num_prompts: int) -> None:
        """Each prompt's LoRA adapter, from ``model`` or ``lora_path`` (400 for one not loaded)."""
        self.adapters = request_adapters(self.state, self.r.model, self.r.lora_path, num_prompts)

    def add_prompt(self, ids: list[int], params: SamplingParams, p: int, start_len: int = -1,
                   images: list | None = None) -> None:
        """``images``: the prompt's decoded images (its ``ids`` hold their placeholders)."""
        rid = self.id if p < 0 else f"{self.id}-{p}"
        adapter = self.adapters[max(p, 0)] if self.adapters else None
        try:
            self.reqs += self.engine.make_requests(ids, params, rid, self.logprobs, start_len, self.top,
                                                   priority=self.r.priority, group=self.id, **lora_kwargs(adapter),
                                                   **({"images": images} if images else {}),
                                                   return_hidden_states=getattr(self.r, "return_hidden_states", False),
                                                   custom_logit_processor=getattr(self.r, "custom_logit_processor", None),
                                                   routed_dp_rank=getattr(self.r, "routed_dp_rank", None))
        except InvalidRequest as e:
            raise engine_error(e) from None

    async def start(self) -> None:
        """Compile the grammars of constrained requests off the loop (an invalid one is a 400),
        then submit through the admission check (queue full or shutting down: 503)."""
        try:
            await self.engine.prepare_grammars(self.reqs)
        except InvalidRequest as e:
            raise engine_error(e) from None
        self.state.submit(self.reqs)
        if self.state.args.log_requests:
            emit_request_log(self.state, "request.received", rids=[r.rid for r in self.reqs], endpoint=self.kind,
                             prompt_tokens=[len(r.prompt_ids) for r in self.reqs[:: self.n]])

    # ---- results
    def usage(self, outs: list[dict | None]) -> UsageInfo:
        """Usage so far (``outs``: each request's latest output, None before its first): every prompt
        counts from the start (a continuous-usage stream's first chunks too, as vLLM's), once per prompt."""
        prompt = completion = cached = reasoning = 0
        for i, (req, out) in enumerate(zip(self.reqs, outs)):
            if i % self.n == 0:
                prompt += len(req.prompt_ids)
            if out is None:
                continue
            meta = out["meta_info"]
            completion += meta["completion_tokens"]
            if i % self.n == 0:
                cached += meta.get("cached_tokens", 0) or 0
            if self.reasoning_ids is not None:
                reasoning += reasoning_tokens(out["output_ids"], *self.reasoning_ids)
        usage = UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                          reasoning_tokens=reasoning)
        if reasoning:
            usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=reasoning)
        if self.cache_report:
            usage.prompt_tokens_details = PromptTokensDetails(cached_tokens=cached)
        return usage

    async def final_outputs(self) -> list[dict]:
        try:
            await asyncio.gather(*(self.engine.drain(r) for r in self.reqs))  # one wake-up each, at the finish
        finally:
            self.abort()
        outs = [self.engine.output(r) for r in self.reqs]
        for out in outs:
            raise_if_aborted(out)
        return outs

    def abort(self) -> None:
        for req in self.reqs:
            if not req.finished:
                self.engine.abort(req.rid)

    async def merged(self) -> AsyncIterator[tuple[int, dict]]:
        """(choice index, cumulative output) as each sequence advances; an aborted sequence raises ApiError."""
        async for i, out in self.engine.stream_many(self.reqs):
            raise_if_aborted(out)
            yield i, out

    async def guarded(self, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The end every OpenAI stream shares: ``[DONE]`` after the events, errors reported
        in-band (the status line is already sent), engine requests aborted on close."""
        try:
            async for event in events:
                yield event
            yield SSE_DONE
        except ApiError as e:  # an aborted sequence (shutdown, engine failure)
            yield sse_error(e)
            yield SSE_DONE
        except Exception as e:
            log.exception("openai.stream_failed", id=self.id)
            yield sse_error(e)
            yield SSE_DONE
        finally:
            await events.aclose()
            self.abort()


def reasoning_tokens(ids: list[int], end_ids: tuple[int, ...], start_ids: tuple[int, ...]) -> int:
    """The output's reasoning tokens, as SGLang counts them: from the first token (or the start tag,
    which an output that may answer at once must open with) through the end tag; all of them while
    the reasoning is still open."""
    if start_ids and tuple(ids[: len(start_ids)]) != start_ids:
        return 0
    n = len(end_ids)
    return next((i + n for i in range(len(start_ids), len(ids) - n + 1) if tuple(ids[i : i + n]) == end_ids), len(ids))
