"""What every handler shares: the engine, the typed server args, the metrics, readiness,
admission control and the one ``--allow-auto-truncate`` rule. Stored as ``app.state.core``."""

from __future__ import annotations

import time
import weakref
from typing import Any

import attrs
import structlog

from core.engine.async_engine import AsyncEngine
from core.engine.request import Req
from core.errors import CoreError, InvalidRequest
from core.server.args import ServerArgs
from core.server.limits import NORMALIZATION_SLACK, max_token_chars, text_token_floor
from core.server.metrics import Metrics

log = structlog.get_logger("core.server.state")

QUEUE_FULL_RETRY_AFTER_S = 1  # Retry-After of a 503 for a full queue: a step or two frees room
SHUTDOWN_RETRY_AFTER_S = 5  # ... while shutting down or failed: a supervisor restarts the server meanwhile


class ServiceUnavailable(CoreError):
    """The server cannot take the request now (queue full, shutting down, engine failed): HTTP 503
    with ``Retry-After: retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def truncate_prompt(ids: list[int], max_len: int) -> list[int]:
    """``--allow-auto-truncate``, SGLang's rule on every endpoint: an input longer than the most
    the endpoint accepts (``context_len - 1`` tokens for generation, leaving room for one new
    token; ``context_len`` for embeddings) keeps its head, the first ``max_len`` tokens, and
    loses its tail."""
    return ids if len(ids) <= max_len else ids[:max_len]


@attrs.define
class ServerState:
    """Everything a handler needs."""

    engine: AsyncEngine
    args: ServerArgs
    metrics: Metrics
    served_model_name: str
    ready: bool = False
    shutting_down: bool = False
    model_path: str | None = None  # what /get_model_info reports (changes with /update_weights_from_disk)
    weight_version: str = "default"  # --weight-version; /update_weights_from_disk, /update_weight_version change it
    started_at: float = attrs.field(factory=time.time)
    # requests sent with SGLang's no_logs: --log-requests writes neither their input nor their output
    unlogged: weakref.WeakSet[Req] = attrs.field(factory=weakref.WeakSet)
    request_log: Any = None  # core.server.request_log.RequestLog (create_app's; None: the server log)
    completion_template: Any = None  # --completion-template (core.server.openai.completion_template), loaded once
    crash_dump: Any = None  # --crash-dump-folder: core.server.request_log.CrashDump, which submit feeds

    _token_chars: int | None = attrs.field(default=None, init=False, repr=False)

    @property
    def context_len(self) -> int:
        return self.engine.model_config.context_len

    @property
    def chat_sampling_defaults(self) -> dict[str, Any]:
        """What a chat request's omitted sampling values take (``--sampling-defaults``; {}: OpenAI's)."""
        if self.args.sampling_defaults != "model":
            return {}
        return getattr(self.engine.model_config, "sampling_defaults", None) or {}  # (a test's stub engine has none)

    @property
    def healthy(self) -> bool:
        """The engine can still serve: no watchdog trip, no failed scheduler loop."""
        return engine_failure(self.engine) is None

    def tokenize(self, prompt: str | None, input_ids: list[int] | None, param: str = "text",
                 max_len: int | None = None) -> list[int]:
        """``engine.tokenize`` behind the cheap length check of :meth:`prefit_text`."""
        if input_ids is None and isinstance(prompt, str):
            prompt = self.prefit_text(prompt, param, max_len)
        return self.engine.tokenize(prompt, input_ids)

    def prefit_text(self, text: str, param: str, max_len: int | None = None) -> str:
        """A text prompt before tokenization: one too long to fit ``max_len`` tokens (default
        ``context_len - 1``) whatever it tokenizes to (``limits.text_token_floor``) is a 400
        without tokenizing it; with ``--allow-auto-truncate`` only a head that surely holds
        ``max_len`` tokens, with a wide margin, is tokenized."""
        limit = self.context_len - 1 if max_len is None else max_len
        if self._token_chars is None:
            tok = self.engine.tokenizer
            self._token_chars = max_token_chars(tok) if tok is not None else 0
        floor = text_token_floor(len(text), self._token_chars)
        if floor <= limit:
            return text
        if not self.args.allow_auto_truncate:
            raise InvalidRequest(f"the prompt is {len(text)} characters long, at least {floor} tokens, but the context "
                                 f"length is {self.context_len} tokens", param=param)
        return text[: 2 * (limit + 64) * self._token_chars * NORMALIZATION_SLACK]

    def fit_prompt(self, ids: list[int], max_len: int | None = None) -> list[int]:
        """The input after ``--allow-auto-truncate`` (see :func:`truncate_prompt`; ``max_len``
        defaults to a generation prompt's ``context_len - 1``). Unchanged without the flag:
        the caller rejects an input that does not fit."""
        limit = self.context_len - 1 if max_len is None else max_len
        if not self.args.allow_auto_truncate or len(ids) <= limit:
            return ids
        log.warning("request.input_truncated", input_tokens=len(ids), kept=limit, context_length=self.context_len)
        return truncate_prompt(ids, limit)

    def check_admission(self, num_reqs: int) -> None:
        """Raise ServiceUnavailable when shutting down, when the engine has failed, or when
        ``num_reqs`` more would overflow ``--max-queued-requests`` (requests wait there while
        the running batch or the KV pool has no room). Call right before ``engine.submit``."""
        if self.shutting_down:
            raise ServiceUnavailable("the server is shutting down", retry_after=SHUTDOWN_RETRY_AFTER_S)
        failure = engine_failure(self.engine)
        if failure is not None:
            raise ServiceUnavailable(f"the engine has failed: {failure}", retry_after=SHUTDOWN_RETRY_AFTER_S)
        limit = self.args.max_queued_requests
        if limit is not None and num_reqs > limit:  # never admissible: retrying cannot help
            raise InvalidRequest(f"the request has {num_reqs} sequences, more than --max-queued-requests {limit} can "
                                 "ever hold", param="n")
        waiting = self.engine.num_waiting()
        if limit is not None and waiting + num_reqs > limit:
            raise ServiceUnavailable(f"the request queue is full ({waiting} waiting, --max-queued-requests {limit}); "
                                     "retry later", retry_after=QUEUE_FULL_RETRY_AFTER_S)

    def submit(self, reqs: list[Req]) -> None:
        """Admission and duplicate-id checks, then hand the requests to the engine. Nothing awaits
        between the checks and the hand-off, so two requests with one id cannot both pass."""
        self.check_admission(len(reqs))
        rids = [r.rid for r in reqs]
        if len(set(rids)) < len(rids):
            twice = next(x for x in rids if rids.count(x) > 1)
            raise InvalidRequest(f"the rid {twice!r} is given to more than one prompt of this request", param="rid")
        for ident in dict.fromkeys(x for r in reqs for x in (r.rid, r.group) if x):
            if self.engine.has_request(ident):  # an abort by this id would reach the running one too
                raise InvalidRequest(f"a request with id {ident!r} is already running", param="rid")
        if self.crash_dump is not None:
            self.crash_dump.record(reqs)
        self.engine.submit(reqs)


def engine_failure(engine: object) -> str | None:
    """Why the engine can no longer serve (a watchdog trip, a dead scheduler loop or rank), or None."""
    if getattr(engine, "healthy", True):
        return None
    return str(getattr(engine, "fatal_error", None) or "the engine has stopped")


def build_state(engine: AsyncEngine, args: ServerArgs) -> ServerState:
    """The state of a server over ``engine``; an unknown ``--tool-call-parser`` or
    ``--reasoning-parser`` stops start-up, listing the registered names, as does an
    ``--hf-chat-template-name`` the tokenizer lacks."""
    from core.server.openai.chat_template import pick_named_template
    from core.server.openai.completion_template import load_completion_template

    for kind, name in (("tool_parser", args.tool_call_parser), ("reasoning_parser", args.reasoning_parser)):
        if name:
            engine.plugins.get(kind, name)
    pick_named_template(getattr(engine, "tokenizer", None), args.hf_chat_template_name, bool(args.chat_template))
    served = engine.model_config.served_name
    metrics = Metrics(served, enabled=args.enable_metrics, buckets=args.observability.buckets())
    metrics.attach(engine)
    state = ServerState(engine=engine, args=args, metrics=metrics, served_model_name=served,
                        model_path=args.model_path or engine.model_config.source, weight_version=args.weight_version,
                        completion_template=load_completion_template(args.completion_template))
    if defaults := state.chat_sampling_defaults:
        log.info("server.chat_sampling_defaults", source="generation_config.json", **defaults)
    return state
