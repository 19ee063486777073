"""``core bench serving``: an online load generator in the spirit of ``sglang.bench_serving``.

Sends random-length prompts (random token ids, so lengths are exact) to a running
server's streaming ``/generate`` (or ``/v1/completions`` with ``--backend openai``),
either as a Poisson process at ``--request-rate`` or all at once, optionally capped at
``--max-concurrency`` in flight, and reports request throughput, token throughputs,
and TTFT / ITL / end-to-end latency percentiles.

Wire it with ``add_bench_command(subparsers)`` (the same pattern as ``core serve``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from typing import Any, Sequence

import attrs


@attrs.define
class RequestResult:
    prompt_len: int
    output_len: int = 0
    success: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = attrs.field(factory=list)  # per-token gaps after the first token
    spec_verify_ct: int = 0  # speculative decoding (sglang backend): the server's verifies for it, 0: none


# ---------------------------------------------------------------------------- CLI
def add_bench_serving_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Target")
    g.add_argument("--backend", default="sglang", choices=["sglang", "openai"],
                   help="sglang: streaming /generate; openai: streaming /v1/completions")
    g.add_argument("--base-url", default=None, help="server URL (default http://HOST:PORT)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=30000)
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--model", default=None, help="model name for --backend openai (default: the served one)")
    g = p.add_argument_group("Workload")
    g.add_argument("--dataset-name", default="random", choices=["random"])
    g.add_argument("--num-prompts", type=int, default=100)
    g.add_argument("--random-input-len", type=int, default=256)
    g.add_argument("--random-output-len", type=int, default=64)
    g.add_argument("--random-range-ratio", type=float, default=0.5,
                   help="lengths are drawn uniformly from [ratio * len, len]")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (Poisson arrivals); inf sends all at once")
    g.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    g.add_argument("--seed", type=int, default=1)
    g.add_argument("--disable-ignore-eos", action="store_true", help="let EOS end outputs early")
    g.add_argument("--warmup-requests", type=int, default=1)
    g = p.add_argument_group("Output")
    g.add_argument("--output-file", default=None, help="append the result as one JSON line")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    g.add_argument("--profile", action="store_true",
                   help="trace the run with the server's torch profiler (/start_profile, /stop_profile); the trace's "
                        "file is printed (the server's $SGLANG_TORCH_PROFILER_DIR, else /tmp)")


def add_bench_command(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``core bench serving`` (call from ``core.cli.build_parser``)."""
    bench = subparsers.add_parser("bench", help="benchmarks")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    serving = sub.add_parser("serving", help="load-test a running server (like sglang.bench_serving)")
    add_bench_serving_args(serving)
    serving.set_defaults(func=cmd_bench_serving)


def cmd_bench_serving(ns: argparse.Namespace) -> int:
    from core.errors import CoreError

    if ns.num_prompts < 1:
        raise CoreError("--num-prompts must be >= 1")
    if not 0 <= ns.random_range_ratio <= 1:
        raise CoreError("--random-range-ratio must be in [0, 1]")
    if ns.request_rate <= 0:
        raise CoreError("--request-rate must be > 0 (inf: all at once)")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise CoreError("--max-concurrency must be >= 1")
    result = asyncio.run(run_benchmark(ns))
    sys.stdout.write(format_report(result) + "\n")
    if ns.output_file:
        with open(ns.output_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(result) + "\n")
    return 0 if result["completed"] > 0 else 1


# ---------------------------------------------------------------------------- workload
def sample_lengths(n: int, input_len: int, output_len: int, ratio: float, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    lo_in, lo_out = max(1, int(input_len * ratio)), max(1, int(output_len * ratio))
    return [(rng.randint(lo_in, max(lo_in, input_len)), rng.randint(lo_out, max(lo_out, output_len))) for _ in range(n)]


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    # avoid the lowest ids, which are usually special tokens
    lo = min(1000, vocab_size // 4)
    return [rng.randrange(lo, vocab_size) for _ in range(length)]


async def _arrivals(n: int, rate: float, seed: int):
    rng = random.Random(seed + 1)
    for i in range(n):
        yield i
        if math.isfinite(rate) and i < n - 1:
            await asyncio.sleep(rng.expovariate(rate))


# ---------------------------------------------------------------------------- one request
async def _send(client: Any, ns: argparse.Namespace, model: str | None, ids: list[int], out_len: int) -> RequestResult:
    res = RequestResult(prompt_len=len(ids))
    if ns.backend == "sglang":
        url = "/generate"
        body: dict[str, Any] = {"input_ids": ids, "stream": True,
                                "sampling_params": {"max_new_tokens": out_len, "temperature": 0.0,
                                                    "ignore_eos": not ns.disable_ignore_eos}}
    else:
        url = "/v1/completions"
        body = {"model": model, "prompt": ids, "max_tokens": out_len, "temperature": 0.0, "stream": True,
                "ignore_eos": not ns.disable_ignore_eos, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    last = t0
    n_tokens = 0
    try:
        async with client.stream("POST", url, json=body, timeout=ns.timeout) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    return res
                now = time.perf_counter()
                if ns.backend == "sglang":
                    count = chunk["meta_info"]["completion_tokens"]
                    res.spec_verify_ct = chunk["meta_info"].get("spec_verify_ct", 0)
                else:
                    usage = chunk.get("usage") or {}
                    if not chunk.get("choices"):
                        count = usage.get("completion_tokens", n_tokens)
                        n_tokens = max(n_tokens, count)
                        continue
                    count = usage.get("completion_tokens") or n_tokens + 1
                new = count - n_tokens
                if new <= 0:
                    continue
                if n_tokens == 0:  # (the first chunk sets the TTFT only, as sglang.bench_serving)
                    res.ttft = now - t0
                else:  # several tokens in one chunk: spread the gap evenly, as sglang.bench_serving does
                    res.itl += [(now - last) / new] * new
                last = now
                n_tokens = count
        res.latency = time.perf_counter() - t0
        res.output_len = n_tokens
        res.success = n_tokens > 0
        if not res.success:
            res.error = "no tokens received"
    except Exception as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


# ---------------------------------------------------------------------------- the run
def http_client(base: str, headers: dict[str, str], limit: int, timeout: float) -> Any:
    """The load generator's HTTP client (an async context manager): aiohttp where installed, as
    sglang.bench_serving uses (its client took ~40 % of httpx's CPU time a streamed event: 512
    streams of 256 tokens, 1.9 against 4.5-5.3 s), else httpx, which the server's stack brings."""
    try:
        import aiohttp
    except ImportError:
        aiohttp = None
    if aiohttp is None:
        import httpx

        limits = httpx.Limits(max_connections=limit + 4, max_keepalive_connections=limit + 4)
        return httpx.AsyncClient(base_url=base, headers=headers, limits=limits, timeout=timeout)
    return _AiohttpClient(aiohttp, base, headers, timeout)


class _AiohttpClient:
    """What ``_send`` and ``run_benchmark`` use of an ``httpx.AsyncClient`` (``get``, ``post``,
    ``stream``; responses' ``status_code``, ``json``, ``raise_for_status``, ``aread``,
    ``aiter_lines``), over an ``aiohttp.ClientSession`` without a connection cap."""

    def __init__(self, aiohttp: Any, base: str, headers: dict[str, str], timeout: float) -> None:
        self._aiohttp, self._base, self._headers, self._timeout = aiohttp, base, headers, timeout
        self._session: Any = None

    async def __aenter__(self) -> _AiohttpClient:
        aiohttp = self._aiohttp
        self._session = aiohttp.ClientSession(headers=self._headers, connector=aiohttp.TCPConnector(limit=0),
                                              timeout=self._limits(self._timeout),
                                              read_bufsize=1 << 22)  # (a cumulative event is one line: up to 4 MiB)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._session.close()

    def _limits(self, seconds: float) -> Any:
        """httpx's meaning of ``--timeout``: each connect and each read, not the whole stream."""
        return self._aiohttp.ClientTimeout(total=None, sock_connect=seconds, sock_read=seconds)

    async def get(self, url: str) -> _Response:
        async with self._session.get(self._base + url) as r:
            return _Response(r, await r.read())

    async def post(self, url: str, json: Any = None) -> _Response:
        async with self._session.post(self._base + url, json=json) as r:
            return _Response(r, await r.read())

    def stream(self, method: str, url: str, json: Any = None, timeout: float | None = None) -> _Stream:
        return _Stream(self._session.request(method, self._base + url, json=json,
                                             timeout=self._limits(timeout or self._timeout)))


class _Stream:
    """``httpx.AsyncClient.stream``'s context: the response, its body read as it comes."""

    def __init__(self, request: Any) -> None:
        self._request = request

    async def __aenter__(self) -> _Response:
        return _Response(await self._request.__aenter__(), None)

    async def __aexit__(self, *exc: Any) -> None:
        await self._request.__aexit__(*exc)


class _Response:
    def __init__(self, resp: Any, body: bytes | None) -> None:
        self._resp, self._body, self.status_code = resp, body, resp.status

    def json(self) -> Any:
        return json.loads(self._body)

    def raise_for_status(self) -> None:
        if self.status_code >= 400:
            raise RuntimeError(f"HTTP {self.status_code}: {(self._body or b'').decode(errors='replace')[:200]}")

    async def aread(self) -> bytes:
        return self._body if self._body is not None else await self._resp.read()

    async def aiter_lines(self) -> Any:
        async for line in self._resp.content:
            yield line.decode().rstrip("\r\n")


async def run_benchmark(ns: argparse.Namespace) -> dict[str, Any]:
    base = ns.base_url or f"http://{ns.host}:{ns.port}"
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    limit = ns.max_concurrency or ns.num_prompts
    async with http_client(base.rstrip("/"), headers, limit, ns.timeout) as client:
        info = (await client.get("/get_model_info")).json()
        vocab = int(info.get("vocab_size") or 32000)
        ctx = int(info.get("context_length") or 1 << 30)
        model = ns.model or info.get("served_model_name") or info.get("model_path")
        lengths = sample_lengths(ns.num_prompts, ns.random_input_len, ns.random_output_len, ns.random_range_ratio, ns.seed)
        lengths = [(min(i, ctx - 2), min(o, max(1, ctx - min(i, ctx - 2) - 1))) for i, o in lengths]
        rng = random.Random(ns.seed)
        prompts = [random_prompt(rng, i, vocab) for i, _ in lengths]

        for k in range(ns.warmup_requests):
            await _send(client, ns, model, prompts[k % len(prompts)][:16], 4)

        sem = asyncio.Semaphore(limit)

        async def limited(i: int) -> RequestResult:
            async with sem:
                return await _send(client, ns, model, prompts[i], lengths[i][1])

        if ns.profile:
            (await client.post("/start_profile")).raise_for_status()
        tasks = []
        t0 = time.perf_counter()
        async for i in _arrivals(ns.num_prompts, ns.request_rate, ns.seed):
            tasks.append(asyncio.create_task(limited(i)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        trace = None
        if ns.profile:
            resp = await client.post("/stop_profile")
            resp.raise_for_status()
            trace = resp.json().get("trace")
    out = summarize(results, duration, ns)
    if trace is not None:
        out["profile_trace"] = trace
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _stats(values: Sequence[float], prefix: str) -> dict[str, float]:
    ms = [v * 1000.0 for v in values]
    return {
        f"mean_{prefix}_ms": sum(ms) / len(ms) if ms else 0.0,
        f"p50_{prefix}_ms": percentile(ms, 50),
        f"p90_{prefix}_ms": percentile(ms, 90),
        f"p99_{prefix}_ms": percentile(ms, 99),
    }


def summarize(results: Sequence[RequestResult], duration: float, ns: argparse.Namespace) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    errors = sorted({r.error for r in results if not r.success})
    return {
        "backend": ns.backend,
        "request_rate": ns.request_rate if math.isfinite(ns.request_rate) else "inf",
        "max_concurrency": ns.max_concurrency,
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors[:5],
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "input_throughput": total_in / duration if duration > 0 else 0.0,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        # SGLang's accept length: generated tokens per verify forward, over requests the server speculated for
        "accept_length": (sum(r.output_len for r in ok if r.spec_verify_ct) / verifies
                          if (verifies := sum(r.spec_verify_ct for r in ok)) else None),
        **_stats([r.ttft for r in ok], "ttft"),
        **_stats([g for r in ok for g in r.itl], "itl"),
        **_stats([r.latency for r in ok], "e2e_latency"),
    }


def format_report(r: dict[str, Any]) -> str:
    rows: list[tuple[str, Any]] = [
        ("Backend", r["backend"]),
        ("Traffic request rate", r["request_rate"]),
        ("Max request concurrency", r["max_concurrency"] or "not set"),
        ("Successful requests", r["completed"]),
        ("Failed requests", r["failed"]),
        ("Benchmark duration (s)", f"{r['duration_s']:.2f}"),
        ("Total input tokens", r["total_input_tokens"]),
        ("Total generated tokens", r["total_output_tokens"]),
        ("Request throughput (req/s)", f"{r['request_throughput']:.2f}"),
        ("Input token throughput (tok/s)", f"{r['input_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{r['output_throughput']:.2f}"),
    ]
    if r.get("accept_length") is not None:
        rows.append(("Accept length", f"{r['accept_length']:.2f}"))
    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]
    lines += [f"{k:<44}{v:>16}" for k, v in rows]
    for title, key, short in (("Time to First Token", "ttft", "TTFT"), ("Inter-Token Latency", "itl", "ITL"),
                              ("End-to-End Latency", "e2e_latency", "E2E Latency")):
        lines.append("{s:{c}^60}".format(s=f" {title} ", c="-"))
        for stat, label in (("mean", "Mean"), ("p50", "P50"), ("p90", "P90"), ("p99", "P99")):
            lines.append(f"{f'{label} {short} (ms)':<44}{r[f'{stat}_{key}_ms']:>16.2f}")
    if r["errors"]:
        lines.append("{s:{c}^60}".format(s=" Errors ", c="-"))
        lines += [f"  {e}" for e in r["errors"]]
    if r.get("profile_trace"):
        lines.append(f"{'Profile trace':<20}{r['profile_trace']:>40}")
    lines.append("=" * 60)
    return "\n".join(lines)
