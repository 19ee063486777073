"""Data parallelism on CPU: ``--dp-size 2`` with one thread per replica against ``--dp-size 1``
with two threads, under the same offered load (not a timed test).

Both configurations see the same requests (--num-requests prompts of --input-len random
tokens, exactly --output-len tokens out, EOS ignored) arriving at the same Poisson times
(--rate requests/s, seeded; --rate 0 sends them all at once), through the offline engine's
``async_generate``. Reported per configuration: output tokens/s over the run (first arrival to
last completion), request latency p50 / p90 (arrival to completion) and the wall time.

    python bench/bench_dp.py                       # SmolLM2-135M (the embedded default)
    python bench/bench_dp.py --rate 0 --num-requests 64

Run it on a quiet machine: with two cores, anything else running skews both columns.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time


def rand_ids(n: int, vocab: int, rng: random.Random) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets (s) of ``n`` requests at a Poisson ``rate`` (all at 0 when rate is 0)."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        if rate > 0:
            t += rng.expovariate(rate)
    return out


def run_config(args, dp_size: int, threads: int) -> dict:
    from core import Engine

    opts = dict(dp_size=dp_size, cpu_threads=threads, log_level="warning", random_seed=0,
                max_total_tokens=args.max_total_tokens)
    if args.model_path:
        opts["model_path"] = args.model_path
    if args.dtype:
        opts["dtype"] = args.dtype
    eng = Engine(**opts)
    try:
        vocab = eng.engine.vocab_size
        rng = random.Random(args.seed)
        prompts = [rand_ids(args.input_len, vocab, rng) for _ in range(args.num_requests)]
        params = {"temperature": 0, "max_new_tokens": args.output_len, "ignore_eos": True}
        eng.generate(input_ids=[rand_ids(8, vocab, rng) for _ in range(2 * dp_size)], sampling_params={"max_new_tokens": 2})
        eng.engine.flush_cache()  # (every replica's) warm-up prompts out of the prefix cache
        offsets = arrivals(args.num_requests, args.rate, args.seed)

        async def one(i: int, t0: float) -> tuple[float, int]:
            await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
            start = time.perf_counter()
            out = await eng.async_generate(input_ids=prompts[i], sampling_params=params)
            return time.perf_counter() - start, len(out["output_ids"])

        async def main() -> tuple[list, float]:
            t0 = time.perf_counter()
            res = await asyncio.gather(*(one(i, t0) for i in range(args.num_requests)))
            return res, time.perf_counter() - t0

        res, wall = asyncio.run(main())
    finally:
        eng.shutdown()
    lat = sorted(r[0] for r in res)
    return {"tok_s": sum(r[1] for r in res) / wall, "p50": statistics.median(lat),
            "p90": lat[int(0.9 * (len(lat) - 1))], "wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rate", type=float, default=3.0, help="Poisson arrivals per second (0: all at once)")
    ap.add_argument("--max-total-tokens", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rate = f"Poisson {args.rate:g} req/s" if args.rate > 0 else "all at once"
    print(f"== {args.num_requests} requests, {args.input_len} in / {args.output_len} out, {rate}")
    print("| configuration | output tok/s | latency p50 (s) | latency p90 (s) | wall (s) |")
    print("|---|---:|---:|---:|---:|")
    for dp, threads in ((1, 2), (2, 1)):
        r = run_config(args, dp, threads)
        print(f"| --dp-size {dp}, --cpu-threads {threads} | {r['tok_s']:.1f} | "
              f"{r['p50']:.2f} | {r['p90']:.2f} | {r['wall']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
