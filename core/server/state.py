"""What every handler shares: the engine, the typed server args, the metrics, readiness,
admission control and the one ``--allow-auto-truncate`` rule. Stored as ``app.state.core``."""

from __future__ import annotations

import time

import attrs
import structlog

from core.engine.async_engine import AsyncEngine
from core.engine.request import Req
from core.errors import CoreError
from core.server.args import ServerArgs
from core.server.metrics import Metrics

log = structlog.get_logger("core.server.state")


class ServiceUnavailable(CoreError):
    """The server cannot take the request now (queue full, shutting down): HTTP 503."""


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
    weight_version: str = "default"
    started_at: float = attrs.field(factory=time.time)

    @property
    def context_len(self) -> int:
        return self.engine.model_config.context_len

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
        """Raise ServiceUnavailable when shutting down or when ``num_reqs`` more would overflow
        ``--max-queued-requests``. Call right before ``engine.submit``."""
        if self.shutting_down:
            raise ServiceUnavailable("the server is shutting down")
        limit = self.args.max_queued_requests
        waiting = self.engine.num_waiting()
        if limit is not None and waiting + num_reqs > limit:
            raise ServiceUnavailable(f"the request queue is full ({waiting} waiting, --max-queued-requests {limit}); "
                                     "retry later")

    def submit(self, reqs: list[Req]) -> None:
        """Admission check, then hand the requests to the engine."""
        self.check_admission(len(reqs))
        self.engine.submit(reqs)


def build_state(engine: AsyncEngine, args: ServerArgs) -> ServerState:
    """The state of a server over ``engine``; an unknown ``--tool-call-parser`` or
    ``--reasoning-parser`` stops start-up, listing the registered names."""
    for kind, name in (("tool_parser", args.tool_call_parser), ("reasoning_parser", args.reasoning_parser)):
        if name:
            engine.plugins.get(kind, name)
    served = engine.model_config.served_name
    metrics = Metrics(served, enabled=args.enable_metrics)
    metrics.attach(engine)
    return ServerState(engine=engine, args=args, metrics=metrics, served_model_name=served,
                       model_path=args.model_path or engine.model_config.source)
