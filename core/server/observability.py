"""SGLang's observability flags of ``core serve``: the Prometheus histogram buckets, where and how
``--log-requests`` writes, per-request time stats and metrics files, and the access-log filter.

Parsed and checked here, before the model loads (a bad value is a ``CoreError`` naming the flag and
the fix), into one plain ``Observability`` record that ``ServerArgs`` carries."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

import attrs
import structlog

from core.errors import CoreError

log = structlog.get_logger("core.server.observability")

BUCKET_RULES = ("default", "tse", "custom")
LOG_FORMATS = ("text", "json")


@attrs.frozen
class Observability:
    """The checked values; a bucket field is None for the metric's default bounds."""

    ttft_buckets: tuple[float, ...] | None = None
    itl_buckets: tuple[float, ...] | None = None  # (inter-token latency and time per output token, as SGLang)
    e2e_buckets: tuple[float, ...] | None = None
    prompt_tokens_buckets: tuple[float, ...] | None = None  # (prompt and uncached prompt token histograms)
    generation_tokens_buckets: tuple[float, ...] | None = None
    log_requests_format: str = "text"
    log_requests_target: tuple[str, ...] | None = None  # "stdout" and/or directories; None: the server log
    request_time_stats: bool = False
    export_metrics_dir: str | None = None  # --export-metrics-to-file's directory, None when off
    crash_dump_folder: str | None = None  # --crash-dump-folder (core.server.request_log.CrashDump)

    def buckets(self) -> dict[str, tuple[float, ...]]:
        """The configured bounds by ``core.server.metrics.Metrics`` histogram attribute."""
        pairs = (("ttft", self.ttft_buckets), ("itl", self.itl_buckets), ("tpot", self.itl_buckets),
                 ("e2e", self.e2e_buckets), ("prompt_tokens_hist", self.prompt_tokens_buckets),
                 ("uncached_prompt_tokens_hist", self.prompt_tokens_buckets),
                 ("generation_tokens_hist", self.generation_tokens_buckets))
        return {name: b for name, b in pairs if b is not None}


def add_observability_args(g: argparse._ArgumentGroup) -> None:
    """SGLang's flags, with its names, value shapes and defaults (into its "Logging" section)."""
    for flag, what in (("--bucket-time-to-first-token", "sglang:time_to_first_token_seconds"),
                       ("--bucket-inter-token-latency", "sglang:inter_token_latency_seconds and "
                                                        "sglang:time_per_output_token_seconds"),
                       ("--bucket-e2e-request-latency", "sglang:e2e_request_latency_seconds")):
        g.add_argument(flag, type=float, nargs="+", default=None, metavar="SECONDS",
                       help=f"the bucket upper bounds of {what}, increasing (default: SGLang's)")
    for flag, what in (("--prompt-tokens-buckets", "sglang:prompt_tokens_histogram and "
                                                   "sglang:uncached_prompt_tokens_histogram"),
                       ("--generation-tokens-buckets", "sglang:generation_tokens_histogram")):
        g.add_argument(flag, nargs="+", default=None, metavar="RULE",
                       help=f"the buckets of {what}: 'default', 'tse MIDDLE BASE COUNT' (bounds MIDDLE +- BASE^i, "
                            "i = 1..ceil(COUNT/2)) or 'custom V1 V2 ...'")
    g.add_argument("--log-requests-format", default="text", choices=LOG_FORMATS,
                   help="--log-requests lines as text, or as one JSON object per line")
    g.add_argument("--log-requests-target", nargs="+", default=None, metavar="TARGET",
                   help="where --log-requests writes: 'stdout' and/or directories (a file HOST_0.log in each, "
                        "rotated hourly); default: the server's log (stderr) for text, stdout for json")
    g.add_argument("--enable-request-time-stats-logging", action="store_true",
                   help="log each finished request's queue and forward durations (request.time_stats)")
    g.add_argument("--export-metrics-to-file", action="store_true",
                   help="write each finished request's parameters and meta_info, one JSON line, to "
                        "--export-metrics-to-file-dir/sglang-request-metrics-YYYYMMDD_HH.log")
    g.add_argument("--export-metrics-to-file-dir", default=None, metavar="DIR",
                   help="the directory of --export-metrics-to-file (created if missing)")
    g.add_argument("--crash-dump-folder", default=None, metavar="DIR",
                   help="when the engine stops for good (a watchdog trip, a dead rank or replica), write the "
                        "requests of the last 5 minutes there as JSON, for a reproduction (created if missing)")
    g.add_argument("--uvicorn-access-log-exclude-prefixes", nargs="*", default=[], metavar="PREFIX",
                   help="accepted for SGLang launch commands: this server writes no HTTP access log, "
                        "so no path is ever logged")


def check_observability(ns: argparse.Namespace) -> None:
    """Start-up's check (``observability_of``), with a warning for each flag that, as in SGLang, does
    nothing without another."""
    observability_of(ns)
    unused = [flag for flag, dest, needs, off in (
        ("--export-metrics-to-file-dir", "export_metrics_to_file_dir", "export_metrics_to_file", None),
        ("--log-requests-target", "log_requests_target", "log_requests", None),
        ("--log-requests-format", "log_requests_format", "log_requests", "text"))
        if getattr(ns, dest, off) not in (None, off) and not getattr(ns, needs, False)]
    for flag in unused:
        log.warning("server.flag_without_effect", flag=flag, needs="--export-metrics-to-file" if "export" in flag
                    else "--log-requests")


def observability_of(ns: argparse.Namespace) -> Observability:
    """The checked record of ``ns`` (flags a namespace lacks take their defaults)."""
    get = lambda name, default=None: getattr(ns, name, default)  # noqa: E731
    export = bool(get("export_metrics_to_file"))
    export_dir = get("export_metrics_to_file_dir")
    if export and not export_dir:
        raise CoreError("--export-metrics-to-file needs --export-metrics-to-file-dir DIR (where the files go)")
    targets = get("log_requests_target")
    for t in targets or ():
        if t.lower() != "stdout":
            _writable_dir("--log-requests-target", t)
    if export_dir:
        _writable_dir("--export-metrics-to-file-dir", export_dir)
    if crash := get("crash_dump_folder"):
        _writable_dir("--crash-dump-folder", crash)
    return Observability(
        ttft_buckets=_bounds("--bucket-time-to-first-token", get("bucket_time_to_first_token")),
        itl_buckets=_bounds("--bucket-inter-token-latency", get("bucket_inter_token_latency")),
        e2e_buckets=_bounds("--bucket-e2e-request-latency", get("bucket_e2e_request_latency")),
        prompt_tokens_buckets=bucket_rule("--prompt-tokens-buckets", get("prompt_tokens_buckets")),
        generation_tokens_buckets=bucket_rule("--generation-tokens-buckets", get("generation_tokens_buckets")),
        log_requests_format=get("log_requests_format", "text"),
        log_requests_target=tuple(targets) if targets else None,
        request_time_stats=bool(get("enable_request_time_stats_logging")),
        export_metrics_dir=export_dir if export else None, crash_dump_folder=crash or None)


def _bounds(flag: str, values: Any) -> tuple[float, ...] | None:
    """Explicit bucket bounds: finite and strictly increasing (prometheus-client needs them sorted;
    SGLang passes them on as given and fails at start-up with a traceback)."""
    if values is None:
        return None
    bounds = tuple(float(v) for v in values)
    if any(math.isnan(b) for b in bounds) or any(math.isinf(b) and b < 0 for b in bounds):
        raise CoreError(f"{flag}: bucket bounds must be numbers, got {_words(values)}")
    if any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise CoreError(f"{flag}: bucket bounds must be strictly increasing, got {_words(values)} "
                        f"(e.g. {flag} {_words(sorted(set(bounds)))})")
    return bounds


def bucket_rule(flag: str, rule: list[str] | None) -> tuple[float, ...] | None:
    """SGLang's token-histogram bucket rule: ``default`` (None here), ``tse MIDDLE BASE COUNT``
    (MIDDLE and MIDDLE +- BASE**i for i = 1..ceil(COUNT / 2), floored at 0) or ``custom V...``
    (the values, sorted)."""
    if not rule:
        return None
    kind, params = rule[0], rule[1:]
    usage = f"{flag} takes 'default', 'tse MIDDLE BASE COUNT' or 'custom V1 V2 ...'"
    if kind not in BUCKET_RULES:
        raise CoreError(f"{usage}; got the rule {kind!r}")
    if kind == "default":
        if params:
            raise CoreError(f"{usage}; 'default' takes no values, got {_words(params)}")
        return None
    if kind == "tse":
        try:
            middle, base, count = float(params[0]), float(params[1]), int(params[2])
        except (ValueError, IndexError):
            middle = base = count = None  # type: ignore[assignment]
        if len(params) != 3 or middle is None:
            raise CoreError(f"{usage}; 'tse' takes a number MIDDLE, a number BASE and an integer COUNT, "
                            f"got {_words(params) or 'none'}")
        if not (middle > 0 and base > 1 and count > 0):
            raise CoreError(f"{flag} tse: MIDDLE must be > 0, BASE > 1 and COUNT > 0, got {_words(params)}")
        sides = [base ** i for i in range(1, math.ceil(count / 2) + 1)]
        return tuple(sorted({middle, *(middle + d for d in sides), *(max(0.0, middle - d) for d in sides)}))
    try:
        values = [float(v) for v in params]
    except ValueError:
        raise CoreError(f"{flag} custom: bucket values must be numbers, got {_words(params)}") from None
    if not values:
        raise CoreError(f"{usage}; 'custom' needs at least one value")
    if len(set(values)) != len(values) or any(not v >= 0 for v in values):
        raise CoreError(f"{flag} custom: values must be distinct numbers >= 0, got {_words(params)}")
    return tuple(sorted(values))


def _writable_dir(flag: str, path: str) -> None:
    """Create ``path`` now, so an unusable directory stops start-up rather than the first request's log."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise CoreError(f"{flag} {path}: cannot create the directory ({e.strerror or e}); give a writable one") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise CoreError(f"{flag} {path}: the directory is not writable; give a writable one")


def _words(values: Any) -> str:
    return " ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)
