"""SGLang's observability flags (core/server/observability.py, core/server/request_log.py): the
histogram bucket flags as /metrics exposes them, ``--log-requests-format`` / ``--log-requests-target``,
``--enable-request-time-stats-logging``, ``--export-metrics-to-file`` and the accepted
``--uvicorn-access-log-exclude-prefixes``. The servers run in-process over a tiny model; bad values
are start-up errors of ``core serve`` itself."""

from __future__ import annotations

import json
import socket
from datetime import datetime
from pathlib import Path
from typing import Any, Awaitable, Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from core.engine.sglang_flags import SGLANG_FLAGS_LACKING
from tests.conftest import greedy
from tests.server_utils import serve_in_process

PROMPT = [5, 6, 7, 8, 9, 10, 11]


def _serve(model: Path, flags: list[str], requests: Callable[[httpx.AsyncClient], Awaitable[Any]]) -> Any:
    """Parse and check ``flags`` as ``core serve`` does, then run ``requests`` against the app."""
    from core.cli import build_parser
    from core.server.args import ServerArgs, validate_serve_args

    ns = build_parser().parse_args(["serve", "--model-path", str(model), *flags])
    validate_serve_args(ns)
    args = ServerArgs.from_namespace(ns)

    return serve_in_process({"model_path": str(model)}, args, requests, timeout=60)


async def _generate(c: httpx.AsyncClient, rid: str, n: int = 3, **body: Any) -> dict:
    r = await c.post("/generate", json={"input_ids": PROMPT, "sampling_params": greedy(n), "rid": rid, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _histograms(text: str) -> dict[str, dict[str, float]]:
    """name -> {le: cumulative count} (plus "_count" and "_sum") of every histogram."""
    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.type != "histogram":
            continue
        h = out.setdefault(fam.name, {})
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                h[s.labels["le"]] = s.value
            elif s.name.endswith(("_count", "_sum")):
                h[s.name[len(fam.name):]] = s.value
    return out


def _bounds(h: dict[str, float]) -> list[float]:
    """A histogram's bucket bounds, in exposition order (the last is +Inf)."""
    return [float(le) for le in h if not le.startswith("_")]


# ---------------------------------------------------------------------------- bucket flags
def test_bucket_flags_set_exactly_the_histograms_bounds(tiny_llama) -> None:
    path, _ = tiny_llama()
    flags = ["--enable-metrics", "--bucket-time-to-first-token", "0.05", "0.5", "5",
             "--bucket-inter-token-latency", "0.001", "0.1", "--bucket-e2e-request-latency", "1", "30",
             "--prompt-tokens-buckets", "tse", "6", "2", "4", "--generation-tokens-buckets", "custom", "8", "2", "4"]

    async def requests(c: httpx.AsyncClient) -> str:
        await _generate(c, "b1", 3)
        await _generate(c, "b2", 3)  # (its prompt is cached: the uncached histogram sees fewer tokens)
        return (await c.get("/metrics")).text

    hists = _histograms(_serve(path, flags, requests))
    want = {"sglang:time_to_first_token_seconds": [0.05, 0.5, 5],
            "sglang:inter_token_latency_seconds": [0.001, 0.1],
            "sglang:time_per_output_token_seconds": [0.001, 0.1],
            "sglang:e2e_request_latency_seconds": [1, 30],
            # tse 6 2 4: 6 and 6 +- 2, 6 +- 4 (SGLang's two-sided exponential rule)
            "sglang:prompt_tokens_histogram": [2, 4, 6, 8, 10],
            "sglang:uncached_prompt_tokens_histogram": [2, 4, 6, 8, 10],
            "sglang:generation_tokens_histogram": [2, 4, 8]}  # custom: sorted
    for name, bounds in want.items():
        assert _bounds(hists[name]) == [*bounds, float("inf")], (name, hists[name])
    prompt = hists["sglang:prompt_tokens_histogram"]
    assert prompt["_count"] == 2 and prompt["_sum"] == 2 * len(PROMPT)
    assert prompt["6.0"] == 0 and prompt["8.0"] == 2  # 7 prompt tokens each
    gen = hists["sglang:generation_tokens_histogram"]
    assert gen["_sum"] == 6 and gen["2.0"] == 0 and gen["4.0"] == 2
    uncached = hists["sglang:uncached_prompt_tokens_histogram"]
    assert uncached["_count"] == 2 and uncached["_sum"] < 2 * len(PROMPT)
    assert hists["sglang:time_to_first_token_seconds"]["_count"] == 2


def test_token_histograms_default_to_sglangs_bounds(tiny_llama) -> None:
    from core.server.metrics import TOKEN_BUCKETS

    path, _ = tiny_llama()

    async def requests(c: httpx.AsyncClient) -> str:
        await _generate(c, "d1", 2)
        return (await c.get("/metrics")).text

    hists = _histograms(_serve(path, ["--enable-metrics", "--prompt-tokens-buckets", "default"], requests))
    for name in ("sglang:prompt_tokens_histogram", "sglang:generation_tokens_histogram"):
        assert _bounds(hists[name]) == [*TOKEN_BUCKETS, float("inf")]
        assert hists[name]["_count"] == 1


@pytest.mark.parametrize("flags, message", [
    (["--bucket-time-to-first-token", "1", "0.5"], "--bucket-time-to-first-token: bucket bounds must be strictly "
                                                   "increasing, got 1 0.5 (e.g. --bucket-time-to-first-token 0.5 1)"),
    (["--bucket-e2e-request-latency", "1", "1"], "--bucket-e2e-request-latency: bucket bounds must be strictly"),
    (["--bucket-inter-token-latency", "nan"], "--bucket-inter-token-latency: bucket bounds must be numbers"),
    (["--prompt-tokens-buckets", "linear", "1"], "--prompt-tokens-buckets takes 'default', 'tse MIDDLE BASE COUNT' "
                                                 "or 'custom V1 V2 ...'; got the rule 'linear'"),
    (["--prompt-tokens-buckets", "tse", "1000", "2"], "'tse' takes a number MIDDLE, a number BASE and an integer COUNT"),
    (["--generation-tokens-buckets", "tse", "1000", "1", "8"], "--generation-tokens-buckets tse: MIDDLE must be > 0, "
                                                               "BASE > 1 and COUNT > 0"),
    (["--generation-tokens-buckets", "custom", "5", "5"], "custom: values must be distinct numbers >= 0"),
    (["--generation-tokens-buckets", "custom", "-1"], "custom: values must be distinct numbers >= 0"),
    (["--generation-tokens-buckets", "custom"], "'custom' needs at least one value"),
    (["--prompt-tokens-buckets", "default", "5"], "'default' takes no values"),
    (["--export-metrics-to-file"], "--export-metrics-to-file needs --export-metrics-to-file-dir DIR"),
])
def test_bad_values_stop_start_up_naming_the_flag(tiny_llama, capsys, flags: list[str], message: str) -> None:
    from core.cli import main

    path, _ = tiny_llama()
    assert main(["serve", "--model-path", str(path), "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("core serve: error: ") and message in err and "Traceback" not in err, err


def test_an_unusable_log_or_export_directory_stops_start_up(tiny_llama, tmp_path, capsys) -> None:
    from core.cli import main

    path, _ = tiny_llama()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for flags in (["--log-requests", "--log-requests-target", str(blocker / "logs")],
                  ["--export-metrics-to-file", "--export-metrics-to-file-dir", str(blocker / "out")]):
        assert main(["serve", "--model-path", str(path), "--device", "cpu", *flags]) == 2
        err = capsys.readouterr().err
        assert f"{flags[-2]} {flags[-1]}: cannot create the directory" in err and "Traceback" not in err, err


# ---------------------------------------------------------------------------- request logs
def _log_file(folder: Path) -> Path:
    return folder / f"{socket.gethostname()}_0.log"


def test_json_request_logs_go_to_every_target(tiny_llama, tmp_path, capsys) -> None:
    path, _ = tiny_llama()
    logs = tmp_path / "req-logs"  # (made at start-up)
    flags = ["--log-requests", "--log-requests-format", "json", "--log-requests-target", str(logs), "stdout"]

    async def requests(c: httpx.AsyncClient) -> None:
        await c.post("/generate", json={"text": "Hello there", "sampling_params": greedy(3), "rid": "json-rid"})
        r = await c.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text

    _serve(path, flags, requests)
    file_lines = _log_file(logs).read_text().splitlines()
    stdout_lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    assert file_lines == stdout_lines and len(file_lines) == 4  # received and output, for each request
    records = [json.loads(ln) for ln in file_lines]
    got = next(r for r in records if r["event"] == "request.received" and r.get("rids") == ["json-rid"])
    assert got["input"] == "Hello there" and got["prompt_tokens"] == [len("Hello there")]
    assert got["sampling_params"]["max_new_tokens"] == 3
    datetime.fromisoformat(got["timestamp"])
    out = next(r for r in records if r["event"] == "request.output" and r["rid"] == "json-rid")
    assert out["completion_tokens"] == 3 and out["finish_reason"]["type"] == "length" and isinstance(out["output"], str)
    assert any(r["event"] == "request.received" and r.get("endpoint") == "completion" for r in records), records


def test_text_request_logs_go_to_a_directory_target(tiny_llama, tmp_path) -> None:
    path, _ = tiny_llama()
    logs = tmp_path / "text-logs"

    async def requests(c: httpx.AsyncClient) -> None:
        await _generate(c, "text-rid", 2)

    with capture_logs() as server_log:
        _serve(path, ["--log-requests", "--log-requests-target", str(logs)], requests)
    lines = _log_file(logs).read_text().splitlines()
    assert len(lines) == 2 and all("text-rid" in ln for ln in lines), lines
    assert "request.received" in lines[0] and "request.output" in lines[1]
    with pytest.raises(ValueError):
        json.loads(lines[0])
    # with a target, the lines go there instead of the server's log
    assert not [e for e in server_log if e["event"] in ("request.received", "request.output")]


def test_without_a_target_text_lines_stay_in_the_server_log(tiny_llama) -> None:
    path, _ = tiny_llama()

    async def requests(c: httpx.AsyncClient) -> None:
        await _generate(c, "plain-rid", 2)

    with capture_logs() as server_log:
        _serve(path, ["--log-requests", "--log-requests-level", "0"], requests)
    events = [e for e in server_log if e["event"] in ("request.received", "request.output")]
    assert [e["event"] for e in events] == ["request.received", "request.output"], events
    assert events[0]["rids"] == ["plain-rid"] and "input" not in events[0]  # level 0: metadata only


def test_configure_logging_turns_the_request_log_on_and_off_at_run_time(tiny_llama, monkeypatch, capsys) -> None:
    """SGLang's ``/configure_logging``: ``log_requests`` and ``log_requests_level`` apply to the next
    requests, ``log_requests_format`` switches the lines to JSON, ``log_level`` sets the server's
    level; request dumps are refused (400 naming the field), as are bad values."""
    import core.server.request_log as request_log

    path, _ = tiny_llama()
    levels: list[str] = []
    monkeypatch.setattr(request_log, "set_log_level", levels.append)

    async def requests(c: httpx.AsyncClient) -> list:
        await _generate(c, "before", 2)
        on = await c.post("/configure_logging", json={"log_requests": True, "log_requests_level": 0})
        await _generate(c, "level-0", 2)
        json_on = await c.post("/configure_logging", json={"log_requests_level": 2, "log_requests_format": "json",
                                                           "log_level": "WARNING"})
        await _generate(c, "json-2", 2)
        off = await c.post("/configure_logging", json={"log_requests": False})
        await _generate(c, "after", 2)
        bad = [await c.post("/configure_logging", json=b) for b in (
            {"dump_requests_folder": "/tmp/x"}, {"dump_requests_threshold": 5}, {"log_requests_level": 9},
            {"log_requests_format": "xml"}, {"log_level": "loud"}, {"nonsense": 1})]
        return [on.status_code, json_on.status_code, off.status_code], bad

    with capture_logs() as server_log:
        codes, bad = _serve(path, [], requests)
    assert codes == [200, 200, 200] and levels == ["warning"]
    text = [e for e in server_log if e["event"] in ("request.received", "request.output")]
    assert [(e["event"], e.get("rid") or e["rids"][0]) for e in text] == [("request.received", "level-0"),
                                                                          ("request.output", "level-0")]
    assert "input" not in text[0] and "output" not in text[1]  # level 0: metadata only
    lines = [json.loads(ln) for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    assert [(r["event"], r.get("rid") or r["rids"][0]) for r in lines] == [("request.received", "json-2"),
                                                                           ("request.output", "json-2")]
    assert json.loads(lines[0]["input"]) == PROMPT and isinstance(lines[1]["output"], str)  # level 2: input, output
    assert [r.status_code for r in bad] == [400] * 6
    assert [r.json()["error"].get("param") for r in bad[:5]] == ["dump_requests_folder", "dump_requests_threshold",
                                                                 "log_requests_level", "log_requests_format", "log_level"]


# ---------------------------------------------------------------------------- per-request records
def test_request_time_stats_are_logged_per_finished_request(tiny_llama) -> None:
    path, _ = tiny_llama()

    async def requests(c: httpx.AsyncClient) -> None:
        await _generate(c, "ts-rid", 4)

    with capture_logs() as on:
        _serve(path, ["--enable-request-time-stats-logging"], requests)
    (stats,) = [e for e in on if e["event"] == "request.time_stats"]
    assert (stats["rid"], stats["input_len"], stats["output_len"], stats["type"]) == ("ts-rid", len(PROMPT), 4, "unified")
    assert stats["queue_duration_ms"] >= 0 and stats["forward_duration_ms"] > 0 and stats["cached_input_len"] == 0
    assert abs(stats["entry_time"] - datetime.now().timestamp()) < 600
    with capture_logs() as off:
        _serve(path, [], requests)
    assert not [e for e in off if e["event"] == "request.time_stats"]


def test_export_metrics_to_file_writes_a_json_line_per_request(tiny_llama, tmp_path) -> None:
    path, _ = tiny_llama()
    out = tmp_path / "metrics-out"

    async def requests(c: httpx.AsyncClient) -> None:
        await _generate(c, "exp-1", 2)
        await _generate(c, "exp-2", 3)

    hour = datetime.now().strftime("%Y%m%d_%H")
    _serve(path, ["--export-metrics-to-file", "--export-metrics-to-file-dir", str(out)], requests)
    files = sorted(out.iterdir())
    assert [f.name for f in files] in ([f"sglang-request-metrics-{hour}.log"],
                                       [f"sglang-request-metrics-{datetime.now().strftime('%Y%m%d_%H')}.log"])
    records = [json.loads(ln) for ln in files[0].read_text().splitlines()]
    assert [r["id"] for r in records] == ["exp-1", "exp-2"]  # (the warm-up and health checks are not exported)
    assert [r["completion_tokens"] for r in records] == [2, 3] and all(r["prompt_tokens"] == len(PROMPT) for r in records)
    assert all(r["e2e_latency"] > 0 and r["finish_reason"]["type"] == "length" for r in records)
    params = json.loads(records[1]["request_parameters"])
    assert params["rid"] == "exp-2" and params["input_ids"] == PROMPT and params["sampling_params"]["max_new_tokens"] == 3


# ---------------------------------------------------------------------------- parsing
def test_sglang_launch_commands_with_these_flags_are_accepted() -> None:
    from core.cli import build_parser

    flags = ("--bucket-time-to-first-token", "--bucket-inter-token-latency", "--bucket-e2e-request-latency",
             "--prompt-tokens-buckets", "--generation-tokens-buckets", "--log-requests-format",
             "--log-requests-target", "--enable-request-time-stats-logging", "--export-metrics-to-file",
             "--export-metrics-to-file-dir", "--uvicorn-access-log-exclude-prefixes")
    assert not SGLANG_FLAGS_LACKING.intersection(flags)
    ns = build_parser().parse_args(["serve", "--model-path", "m", "--uvicorn-access-log-exclude-prefixes", "/metrics",
                                    "/health", "--log-requests-format", "json"])
    assert ns.uvicorn_access_log_exclude_prefixes == ["/metrics", "/health"] and ns.log_requests_format == "json"
    ns = build_parser().parse_args(["serve", "--model-path", "m", "--uvicorn-access-log-exclude-prefixes"])
    assert ns.uvicorn_access_log_exclude_prefixes == []  # (nargs="*", as SGLang)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model-path", "m", "--log-requests-format", "yaml"])


def test_log_level_http_sets_the_http_servers_level() -> None:
    """SGLang's --log-level-http: hypercorn's level (its uvicorn's there), --log-level without it."""
    from core.cli import build_parser
    from core.server.args import ServerArgs
    from core.server.launch import hypercorn_log_level

    def level(*argv: str) -> str:
        return hypercorn_log_level(ServerArgs.from_namespace(build_parser().parse_args(["serve", *argv])))

    assert level() == "INFO" and level("--log-level", "debug") == "DEBUG" and level("--log-level", "error") == "WARNING"
    assert level("--log-level-http", "error") == "ERROR"
    assert level("--log-level", "error", "--log-level-http", "debug") == "DEBUG"
