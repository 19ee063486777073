"""Garbage-collector stalls while decoding, before and after ``Engine.freeze_gc()`` (issue 42).

One engine: a warm-up, a run (the workload ``--rounds`` times) with the start-up heap still under
the collector (the offline ``Engine`` default), then ``freeze_gc()`` (what ``core serve`` does once
ready) and the run again. Per run: the collector's passes by generation with their longest and
total time, the longest gap between two decode steps, and TPOT p50 / mean of the streams.

    python bench/bench_gc.py --cpu-threads 2                      # near-null model, 256 streams
    python bench/bench_gc.py --model-path bench/shapes/null-tiny --streams 256 --output-len 256
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import statistics
import time

import core  # noqa: F401  (before torch: its OpenMP settings)
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="bench/shapes/null-tiny")
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--cpu-threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=12, help="the workload this many times per run (a full pass is rare)")
    args = ap.parse_args()
    from core import Engine
    from core.engine.device import cpu_model_name

    n = args.streams
    eng = Engine(model_path=args.model_path, load_format="dummy", skip_tokenizer_init=True, log_level="warning",
                 max_running_requests=n, max_total_tokens=n * (args.input_len + args.output_len) + 64,
                 cpu_threads=args.cpu_threads)
    passes: dict[int, list[float]] = {}
    start = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            start[0] = time.perf_counter()
        else:
            passes.setdefault(info["generation"], []).append(time.perf_counter() - start[0])

    steps: list[float] = []
    eng.engine.step_listeners.append(lambda b, s: None if b.is_prefill else steps.append(time.perf_counter()))
    rng = random.Random(0)

    def run() -> list[float]:
        prompts = [[rng.randrange(3, 1000) for _ in range(args.input_len)] for _ in range(n)]
        tpots: list[float] = []

        async def one(p: list[int]) -> None:
            first, k = 0.0, 0
            params = {"max_new_tokens": args.output_len, "ignore_eos": True, "temperature": 0}
            async for chunk in await eng.engine.generate(input_ids=p, sampling_params=params, stream=True):
                if k == 0:
                    first = time.perf_counter()
                k = len(chunk["output_ids"])
            tpots.append((time.perf_counter() - first) / max(1, k - 1))

        async def all_() -> None:
            await asyncio.gather(*(one(p) for p in prompts))

        asyncio.run_coroutine_threadsafe(all_(), eng._loop).result()
        return tpots

    run()  # warm-up
    gc.callbacks.append(on_gc)
    rows = []
    for label in ("start-up heap collected", "after freeze_gc()"):
        if label.startswith("after"):
            eng.freeze_gc()
        passes.clear()
        tpots, gaps = [], []
        for _ in range(args.rounds):
            steps.clear()
            tpots += run()
            gaps += [b - a for a, b in zip(steps, steps[1:])]
        rows.append((label, dict(passes), max(gaps), statistics.median(tpots), statistics.mean(tpots)))
    gc.callbacks.remove(on_gc)
    eng.shutdown()
    print(f"# {cpu_model_name()}, {args.cpu_threads} threads, torch {torch.__version__}; {args.model_path}, dummy "
          f"weights; {n} streams, {args.input_len} in / {args.output_len} out, greedy, {args.rounds} rounds a run; objects frozen: "
          f"{gc.get_freeze_count()}")
    print(f"{'run':<26}{'gen0 / gen1 / gen2 passes':>27}{'gen2 longest (ms)':>19}{'longest step gap (ms)':>23}"
          f"{'TPOT p50 (ms)':>15}{'TPOT mean (ms)':>16}")
    for label, p, gap, p50, mean in rows:
        counts = " / ".join(str(len(p.get(g, []))) for g in range(3))
        g2 = f"{max(p[2]) * 1e3:.1f}" if p.get(2) else "-"
        print(f"{label:<26}{counts:>27}{g2:>19}{gap * 1e3:>23.1f}{p50 * 1e3:>15.2f}{mean * 1e3:>16.2f}")


if __name__ == "__main__":
    main()
