"""Per-request records: where ``--log-requests`` lines go and how they look (SGLang's
``--log-requests-format`` / ``--log-requests-target``), ``--enable-request-time-stats-logging``'s
line per finished request, ``--export-metrics-to-file``'s JSON line per finished request, and
SGLang's ``/configure_logging``, which changes the request log (and the log level) at run time."""

from __future__ import annotations

import collections
import json
import logging
import os
import socket
import sys
import time
from datetime import datetime
from logging.handlers import TimedRotatingFileHandler
from typing import TYPE_CHECKING, Any, Callable

import attrs
import msgspec
import structlog
from starlette.requests import Request
from starlette.responses import Response

from core.errors import InvalidRequest
from core.log import LEVELS, configure_logging as set_log_level
from core.server.http import read_body, state_of
from core.server.observability import LOG_FORMATS

if TYPE_CHECKING:
    from core.engine.request import Req
    from core.server.observability import Observability

log = structlog.get_logger("core.server.native")  # (the logger request lines always came from)

INTERNAL_RID_PREFIXES = ("HEALTH_CHECK_", "WARMUP_")
_TEXT = structlog.dev.ConsoleRenderer(colors=False)


def _stdout(line: str) -> None:
    sys.stdout.write(line + "\n")  # (whatever sys.stdout is now: a captured one may be replaced)
    sys.stdout.flush()


def _file_sink(directory: str) -> Callable[[str], None]:
    """``DIR/HOST_0.log``, rotated hourly with every old hour kept, as SGLang names and rotates it
    (rank 0: one server process writes it)."""
    path = os.path.join(os.path.abspath(directory), f"{socket.gethostname()}_0.log")
    logger = logging.getLogger(f"core.request_log.{path}")
    if not logger.handlers:
        handler = TimedRotatingFileHandler(path, when="H", backupCount=0, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger.info


class RequestLog:
    """The ``--log-requests`` writer. Without a target, text lines stay in the server's log (structlog,
    stderr, under ``--log-level``) and JSON lines go to stdout, SGLang's default target."""

    def __init__(self, fmt: str = "text", targets: tuple[str, ...] | None = None) -> None:
        self.json = fmt == "json"
        self._sinks: list[Callable[[str], None]] | None = None
        if targets or self.json:
            self._sinks = [_stdout if t.lower() == "stdout" else _file_sink(t) for t in targets or ("stdout",)]

    @classmethod
    def of(cls, obs: Observability) -> RequestLog:
        return cls(obs.log_requests_format, obs.log_requests_target)

    def emit(self, event: str, **fields: Any) -> None:
        """One line for ``event``; never raises (logging must not break serving)."""
        if self._sinks is None:
            log.info(event, **fields)
            return
        try:
            record = {"timestamp": datetime.now().isoformat(), "event": event, **fields}
            line = (json.dumps(record, ensure_ascii=False, default=str) if self.json
                    else _TEXT(None, "info", {**record, "level": "info"}))
            for sink in self._sinks:
                sink(line)
        except Exception:
            pass


def emit(state: Any, event: str, **fields: Any) -> None:
    """``state``'s request log (a state built without ``create_app`` has none: the server log)."""
    writer = getattr(state, "request_log", None)
    if writer is None:
        log.info(event, **fields)
    else:
        writer.emit(event, **fields)


# ---------------------------------------------------------------------------- finish listeners
def _internal(req: Req) -> bool:
    return req.rid.startswith(INTERNAL_RID_PREFIXES)


def time_stats_logger(req: Req) -> None:
    """``--enable-request-time-stats-logging``: SGLang's ReqTimeStats line. The queue runs from the
    request's arrival to its first forward (all of it for one that never ran), the forward from
    there to its finish; ``entry_time`` is the arrival as a Unix time."""
    if _internal(req):
        return
    end = req.finish_time or time.perf_counter()
    started = getattr(req, "forward_entry_time", None) or end
    log.info("request.time_stats", rid=req.rid, input_len=len(req.prompt_ids), cached_input_len=req.cached_tokens,
             output_len=len(req.output_ids), type="unified", queue_duration_ms=round((started - req.arrival) * 1e3, 2),
             forward_duration_ms=round((end - started) * 1e3, 2),
             entry_time=round(time.time() - (time.perf_counter() - req.arrival), 3))


@attrs.define
class MetricsFileExporter:
    """``--export-metrics-to-file``: per finished request, one JSON object (``request_parameters``,
    a JSON string of the request, then its meta_info) appended to
    ``DIR/sglang-request-metrics-YYYYMMDD_HH.log``, a file per hour, as SGLang writes them.
    ``skip``: request fields left out (``--log-requests-level`` 0 and 1 leave out the prompt)."""

    directory: str
    skip: frozenset[str] = frozenset()
    _hour: str = ""
    _file: Any = None

    def __call__(self, req: Req) -> None:
        if _internal(req):
            return
        try:
            params = {"rid": req.rid, "input_ids": req.prompt_ids,
                      "sampling_params": attrs.asdict(req.params, recurse=True),
                      "return_logprob": req.return_logprob, "logprob_start_len": req.logprob_start_len,
                      "top_logprobs_num": req.top_logprobs_num, "priority": req.priority}
            params = {k: v for k, v in params.items() if v is not None and k not in self.skip}
            record = {"request_parameters": json.dumps(params, default=str), **req.meta_info()}
            self._open(datetime.now().strftime("%Y%m%d_%H")).write(json.dumps(record, default=str) + "\n")
            self._file.flush()
        except Exception:  # an export must never break serving
            log.warning("export_metrics.write_failed", rid=req.rid, directory=self.directory, exc_info=True)

    def _open(self, hour: str) -> Any:
        if hour != self._hour or self._file is None:
            if self._file is not None:
                self._file.close()
            self._file = open(os.path.join(self.directory, f"sglang-request-metrics-{hour}.log"), "a", encoding="utf-8")
            self._hour = hour
        return self._file

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def export_skip(log_requests: bool, level: int) -> frozenset[str]:
    """SGLang's request fields its exporter leaves out: the request logger's skip list of the level."""
    if not log_requests or level >= 2:
        return frozenset()
    return frozenset({"input_ids"} | ({"sampling_params"} if level == 0 else set()))


class CrashDump:
    """``--crash-dump-folder`` (SGLang's): the requests of the last ``WINDOW_S`` seconds (id, prompt
    tokens, sampling parameters, arrival time), written to ``DIR/crash_dump_<time>.json`` with the
    error when the engine stops for good (a watchdog trip, a dead tensor-parallel rank or every
    data-parallel replica: its ``fatal_listeners``), so that the failure can be replayed."""

    WINDOW_S = 300.0

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.recent: collections.deque[dict[str, Any]] = collections.deque()  # oldest first

    def record(self, reqs: list[Req]) -> None:
        now = time.time()
        for r in reqs:
            params = {k: v for k, v in attrs.asdict(r.params, recurse=False).items()
                      if isinstance(v, (str, int, float, bool, list, dict)) or v is None}
            self.recent.append({"rid": r.rid, "time": now, "input_ids": list(r.prompt_ids), "sampling_params": params})
        self._forget(now)

    def _forget(self, now: float) -> None:
        while self.recent and self.recent[0]["time"] < now - self.WINDOW_S:
            self.recent.popleft()

    def dump(self, message: str) -> None:
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, f"crash_dump_{datetime.now().strftime('%Y%m%d_%H%M%S_%f')}.json")
        self._forget(time.time())
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"error": message, "requests": list(self.recent)}, f)
        log.error("server.crash_dump", path=path, requests=len(self.recent))


def use_crash_dump(state: Any, folder: str) -> None:
    """Keep the recent requests for a crash dump into ``folder`` from now on (start-up's flag, or
    ``/configure_logging``'s ``crash_dump_folder``)."""
    if state.crash_dump is None:
        state.crash_dump = CrashDump(folder)
        state.engine.fatal_listeners.append(lambda message: state.crash_dump.dump(message))
    state.crash_dump.folder = folder


def attach(state: Any) -> None:
    """The server's request log and its finish listeners, from ``state.args`` (``create_app``)."""
    args = state.args
    obs = args.observability
    state.request_log = RequestLog.of(obs)
    if obs.crash_dump_folder:
        use_crash_dump(state, obs.crash_dump_folder)
    if obs.request_time_stats:
        state.engine.finish_listeners.append(time_stats_logger)
    if obs.export_metrics_dir:
        skip = export_skip(args.log_requests, args.log_requests_level)
        state.engine.finish_listeners.append(MetricsFileExporter(obs.export_metrics_dir, skip))


class ConfigureLoggingReq(msgspec.Struct, forbid_unknown_fields=True):
    """SGLang's ``/configure_logging`` body: what changes (None: as it is)."""

    log_requests: bool | None = None
    log_requests_level: int | None = None
    log_requests_format: str | None = None
    log_level: str | None = None
    dump_requests_folder: str | None = None
    dump_requests_threshold: int | None = None
    crash_dump_folder: str | None = None
    dump_requests_exclude_meta_keys: list[str] | None = None


_NO_DUMPS = ("dump_requests_folder", "dump_requests_threshold", "dump_requests_exclude_meta_keys")


async def configure(request: Request) -> Response:
    """SGLang's ``/configure_logging``: ``--log-requests``, its level and format, ``--log-level`` (this
    process's) and ``--crash-dump-folder``, from now on. SGLang's per-request dumps (``dump_requests_*``)
    are not kept by this server: a 400 naming the field."""
    state = state_of(request)
    body = await read_body(request, ConfigureLoggingReq)
    for name in _NO_DUMPS:
        if getattr(body, name) is not None:
            raise InvalidRequest(f"{name} is not supported by this server (it keeps no request dumps)", param=name)
    if body.log_requests_level is not None and not 0 <= body.log_requests_level <= 3:
        raise InvalidRequest("log_requests_level must be 0, 1, 2 or 3", param="log_requests_level")
    if body.log_requests_format is not None and body.log_requests_format not in LOG_FORMATS:
        raise InvalidRequest(f"log_requests_format must be one of {', '.join(LOG_FORMATS)}", param="log_requests_format")
    if body.log_level is not None and body.log_level.lower() not in LEVELS:
        raise InvalidRequest(f"log_level must be one of {', '.join(LEVELS)}", param="log_level")
    args = state.args
    changes: dict[str, Any] = {k: v for k in ("log_requests", "log_requests_level") if (v := getattr(body, k)) is not None}
    if body.log_requests_format is not None:
        obs = changes["observability"] = attrs.evolve(args.observability, log_requests_format=body.log_requests_format)
        state.request_log = RequestLog.of(obs)
    state.args = attrs.evolve(args, **changes)
    if body.log_level is not None:
        set_log_level(body.log_level.lower())
    if body.crash_dump_folder:
        use_crash_dump(state, body.crash_dump_folder)
    log.info("logging.configured", **{k: v for k, v in msgspec.structs.asdict(body).items() if v is not None})
    return Response(status_code=200)
