"""Soak test of a running server (not a timed test): N concurrent clients for a set time.

Each client loops until the time is up, each request drawn at random: native /generate or
OpenAI chat / completions, streaming or not, sometimes constrained (a JSON schema or a regex),
sometimes abandoned early (a stream closed after a few events, a plain request cancelled
mid-flight: the server must abort it and free its KV). At the end it waits for the server
to go idle, flushes the prefix cache and checks that no KV token is still in use, and reports:

* completed / failed / aborted (by the client, on purpose) / rejected (503) requests,
* p50 / p99 end-to-end latency of the completed ones,
* KV tokens in use after /flush_cache (must be 0: anything else is a leak),
* the server's RSS at the start, its peak and at the end (growth must stay bounded).

    core serve --cpu-threads 2 &
    python bench/soak.py --clients 500 --duration 600

The server's RSS needs its pid: ``--server-pid``, else the process listening on the port
(found with psutil). Exit status 1 if KV leaked or the server stopped answering.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from typing import Any

import attrs
import httpx

WORDS = ("the river city light stone north quiet market bridge winter garden story paper signal orange "
         "engine window field silver morning harbor question answer travel music letter forest").split()
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
REGEX = "(yes|no|maybe), [a-z]{2,8}\\."
KINDS = ("native", "native_stream", "chat", "chat_stream", "completion", "completion_stream")


@attrs.define
class Tally:
    completed: int = 0
    failed: int = 0
    aborted: int = 0  # dropped by the client on purpose
    rejected: int = 0  # 503: overload or shutdown
    latencies: list[float] = attrs.field(factory=list)
    errors: dict[str, int] = attrs.field(factory=dict)
    by_kind: dict[str, int] = attrs.field(factory=dict)

    def fail(self, why: str) -> None:
        self.failed += 1
        key = why[:120]
        self.errors[key] = self.errors.get(key, 0) + 1


# ---------------------------------------------------------------------------- one request
def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 64)))


def _request(rng: random.Random, kind: str, max_new: int, constrained: bool) -> tuple[str, dict]:
    n = rng.randint(2, max_new)
    stream = kind.endswith("_stream")
    shape = rng.choice(("schema", "regex")) if constrained else None
    if kind.startswith("native"):
        sp: dict[str, Any] = {"max_new_tokens": n, "temperature": rng.choice((0.0, 0.7))}
        if shape == "schema":
            sp["json_schema"] = json.dumps(SCHEMA)
        elif shape == "regex":
            sp["regex"] = REGEX
        return "/generate", {"text": _prompt(rng), "sampling_params": sp, "stream": stream}
    body: dict[str, Any] = {"max_tokens": n, "temperature": rng.choice((0.0, 0.7)), "stream": stream}
    if shape == "schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    elif shape == "regex":
        body["regex"] = REGEX
    if kind.startswith("chat"):
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": _prompt(rng)}]}
    return "/v1/completions", {**body, "prompt": _prompt(rng)}


async def _one(client: httpx.AsyncClient, rng: random.Random, args: argparse.Namespace, tally: Tally) -> None:
    kind = rng.choice(KINDS)
    constrained = rng.random() < args.constrained_rate
    disconnect = rng.random() < args.disconnect_rate
    path, body = _request(rng, kind, args.max_new_tokens, constrained)
    tally.by_kind[kind] = tally.by_kind.get(kind, 0) + 1
    t0 = time.perf_counter()
    try:
        if body["stream"]:
            outcome = await _stream(client, path, body, rng.randint(1, 4) if disconnect else None)
        elif disconnect:
            try:
                await asyncio.wait_for(client.post(path, json=body), rng.uniform(0.05, 1.0))
                outcome = "ok"
            except asyncio.TimeoutError:
                outcome = "aborted"
        else:
            outcome = _check_plain(await client.post(path, json=body))
    except httpx.HTTPError as e:
        outcome = f"transport: {type(e).__name__}: {e}"
    if outcome == "ok":
        tally.completed += 1
        tally.latencies.append(time.perf_counter() - t0)
    elif outcome == "aborted":
        tally.aborted += 1
    elif outcome == "rejected":
        tally.rejected += 1
    else:
        tally.fail(f"{kind}: {outcome}")


def _check_plain(resp: httpx.Response) -> str:
    if resp.status_code == 503:
        return "rejected"
    if resp.status_code != 200:
        return f"HTTP {resp.status_code}: {resp.text[:200]}"
    body = resp.json()
    reason = body.get("meta_info", {}).get("finish_reason") if "meta_info" in body else None
    if reason and reason.get("type") == "abort":
        return f"aborted by the server: {reason.get('message')}"
    return "ok"


async def _stream(client: httpx.AsyncClient, path: str, body: dict, close_after: int | None) -> str:
    async with client.stream("POST", path, json=body) as resp:
        if resp.status_code == 503:
            return "rejected"
        if resp.status_code != 200:
            return f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
        events = 0
        done = False
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                return f"in-band error: {event['error'].get('message')}"
            reason = event.get("meta_info", {}).get("finish_reason") if "meta_info" in event else None
            if reason and reason.get("type") == "abort":
                return f"aborted by the server: {reason.get('message')}"
            events += 1
            if close_after is not None and events >= close_after:
                return "aborted"  # leaving the block closes the connection mid-stream
        return "ok" if done else "stream ended without [DONE]"


async def _client(client: httpx.AsyncClient, seed: int, deadline: float, args: argparse.Namespace, tally: Tally) -> None:
    rng = random.Random(seed)
    await asyncio.sleep(rng.uniform(0, min(5.0, args.duration / 10)))  # spread the start
    while time.monotonic() < deadline:
        await _one(client, rng, args, tally)


# ---------------------------------------------------------------------------- the server's side
def _server_pid(args: argparse.Namespace) -> int | None:
    if args.server_pid:
        return args.server_pid
    import psutil

    port = httpx.URL(args.base_url).port
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                return conn.pid
    except (psutil.AccessDenied, PermissionError):
        pass
    return None


def _rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return None


async def _watch_rss(pid: int | None, peak: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        rss = _rss_mib(pid)
        if rss is not None:
            peak[0] = max(peak[0], rss)
        try:
            await asyncio.wait_for(stop.wait(), 2.0)
        except asyncio.TimeoutError:
            pass


async def _settle(client: httpx.AsyncClient, timeout: float) -> dict:
    """Wait for the server to go idle, flush the prefix cache; the load after the flush."""
    deadline = time.monotonic() + timeout
    while True:
        load = (await client.get("/v1/loads")).json()["aggregate"]
        if load["num_total_reqs"] == 0 and (await client.post("/flush_cache")).status_code == 200:
            return (await client.get("/v1/loads")).json()["aggregate"]
        if time.monotonic() > deadline:
            return load
        await asyncio.sleep(0.5)


# ---------------------------------------------------------------------------- main
async def run(args: argparse.Namespace) -> int:
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout, limits=limits, headers=headers) as client:
        if (await client.get("/health")).status_code != 200:
            sys.stderr.write(f"{args.base_url}/health is not 200: start the server first\n")
            return 2
        pid = _server_pid(args)
        rss_start = _rss_mib(pid)
        peak = [rss_start or 0.0]
        stop = asyncio.Event()
        watcher = asyncio.create_task(_watch_rss(pid, peak, stop))
        tally = Tally()
        t0 = time.monotonic()
        deadline = t0 + args.duration
        await asyncio.gather(*(_client(client, args.seed * 100_003 + i, deadline, args, tally)
                               for i in range(args.clients)))
        wall = time.monotonic() - t0
        try:
            alive = (await client.get("/health")).status_code == 200
            after = await _settle(client, 120.0)
        except httpx.HTTPError as e:
            alive, after = False, {"num_used_tokens": None, "error": str(e)}
        stop.set()
        await watcher
        rss_end = _rss_mib(pid)
    lat = sorted(tally.latencies)
    result = {
        "clients": args.clients, "duration_s": round(wall, 1), "completed": tally.completed, "failed": tally.failed,
        "aborted_by_client": tally.aborted, "rejected_503": tally.rejected,
        "latency_p50_s": round(statistics.median(lat), 3) if lat else None,
        "latency_p99_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3) if lat else None,
        "kv_tokens_in_use_after_flush": after.get("num_used_tokens"), "server_alive": alive,
        "server_pid": pid, "rss_start_mib": _round(rss_start), "rss_peak_mib": _round(peak[0] or None),
        "rss_end_mib": _round(rss_end), "requests_by_kind": tally.by_kind, "errors": tally.errors,
    }
    _report(result)
    if args.output_file:
        with open(args.output_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(result) + "\n")
    return 0 if alive and after.get("num_used_tokens") == 0 else 1


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


def _report(r: dict) -> None:
    out = sys.stdout.write
    out(f"soak: {r['clients']} clients for {r['duration_s']} s\n")
    out(f"  completed {r['completed']}, failed {r['failed']}, aborted by the client {r['aborted_by_client']}, "
        f"rejected (503) {r['rejected_503']}\n")
    out(f"  latency of completed requests: p50 {r['latency_p50_s']} s, p99 {r['latency_p99_s']} s\n")
    out(f"  KV tokens in use after /flush_cache: {r['kv_tokens_in_use_after_flush']} (must be 0); "
        f"server alive: {r['server_alive']}\n")
    out(f"  server RSS (pid {r['server_pid']}): start {r['rss_start_mib']} MiB, peak {r['rss_peak_mib']} MiB, "
        f"end {r['rss_end_mib']} MiB\n")
    out(f"  requests by kind: {r['requests_by_kind']}\n")
    for why, count in sorted(r["errors"].items(), key=lambda kv: -kv[1])[:10]:
        out(f"  failure x{count}: {why}\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--clients", type=int, default=500, help="concurrent clients (default 500)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="each request asks for 2..this many tokens")
    p.add_argument("--disconnect-rate", type=float, default=0.1, help="share of requests the client drops early")
    p.add_argument("--constrained-rate", type=float, default=0.1, help="share of requests with a JSON schema or regex")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout in seconds")
    p.add_argument("--server-pid", type=int, default=None, help="the server's pid, for its RSS (default: found by port)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-file", default=None, help="append the result as one JSON line")
    args = p.parse_args(argv)
    if args.clients < 1 or args.duration <= 0 or args.max_new_tokens < 2:
        p.error("--clients >= 1, --duration > 0 and --max-new-tokens >= 2 are required")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
