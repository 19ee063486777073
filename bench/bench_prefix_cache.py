"""Prefix cache and chunked prefill benchmark (not a timed test).

1. Shared system prompt: --num-requests requests share a --system-len token system prompt
   (plus a short unique question each) and generate --output-len tokens. Run with the radix
   cache on and off in the same process: prefill tokens computed, cache hit rate, throughput.
2. Inter-token latency of running streams while a --long-len token prompt arrives, with
   chunked prefill (--chunked-prefill-size) and without (-1).

The numbers are noisy on a shared CPU; run it on a quiet machine:
    python bench/bench_prefix_cache.py --cpu-threads 2
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch


def rand_ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n,), generator=g).tolist()


def make_engine(args, **kw):
    from core import Engine

    opts = dict(cpu_threads=args.cpu_threads, log_level="warning", random_seed=0)
    if args.model_path:
        opts["model_path"] = args.model_path
    if args.dtype:
        opts["dtype"] = args.dtype
    opts.update(kw)
    return Engine(**opts)


def bench_shared_prefix(args) -> None:
    print(f"== {args.num_requests} requests sharing a {args.system_len}-token system prompt "
          f"(+{args.question_len} unique tokens each, {args.output_len} output tokens)")
    results = {}
    for label, disable in (("cache on", False), ("cache off", True)):
        eng = make_engine(args, disable_radix_cache=disable, max_total_tokens=args.max_total_tokens)
        try:
            vocab = eng.engine.vocab_size
            system = rand_ids(args.system_len, vocab, 1)
            prompts = [system + rand_ids(args.question_len, vocab, 100 + i) for i in range(args.num_requests)]
            params = {"temperature": 0, "max_new_tokens": args.output_len, "ignore_eos": True}
            eng.generate(input_ids=rand_ids(8, vocab, 7), sampling_params={"max_new_tokens": 2})  # warm-up
            eng.engine.flush_cache()
            sched = eng.engine.scheduler
            before = sched.prefill_tokens
            t0 = time.perf_counter()
            outs = eng.generate(input_ids=prompts, sampling_params=params)
            dt = time.perf_counter() - t0
            tree = eng.engine.tree_cache
            out_tokens = sum(len(o["output_ids"]) for o in outs)
            prompt_tokens = sum(len(p) for p in prompts)
            results[label] = dict(
                prefill=sched.prefill_tokens - before,
                hit=tree.hit_rate if tree is not None else 0.0,
                cached=sum(o["meta_info"]["cached_tokens"] for o in outs),
                secs=dt, out_tps=out_tokens / dt, total_tps=(prompt_tokens + out_tokens) / dt,
                outputs=[o["output_ids"] for o in outs],
            )
        finally:
            eng.shutdown()
    for label, r in results.items():
        print(f"  {label:9s}: prefill tokens computed {r['prefill']:7d} | cache hit rate {r['hit']:.3f} | "
              f"cached_tokens (meta_info) {r['cached']:6d} | {r['secs']:6.2f} s | "
              f"{r['out_tps']:7.1f} output tok/s | {r['total_tps']:8.1f} total tok/s")
    same = results["cache on"]["outputs"] == results["cache off"]["outputs"]
    print(f"  greedy outputs identical with and without the cache: {same}")
    print(f"  speed-up: {results['cache off']['secs'] / results['cache on']['secs']:.2f}x")


def bench_itl(args) -> None:
    print(f"== inter-token latency of {args.num_streams} running streams while a {args.long_len}-token prompt arrives")
    for label, chunk in ((f"chunked {args.chunked_prefill_size}", args.chunked_prefill_size), ("unchunked", -1)):
        eng = make_engine(args, chunked_prefill_size=chunk, max_total_tokens=args.long_len + 4096)
        try:
            vocab = eng.engine.vocab_size
            eng.generate(input_ids=rand_ids(8, vocab, 7), sampling_params={"max_new_tokens": 2})  # warm-up
            stamps: list[list[float]] = [[] for _ in range(args.num_streams)]
            window: dict[str, float] = {}

            def stream(i: int) -> None:
                params = {"temperature": 0, "max_new_tokens": args.stream_len, "ignore_eos": True}
                for _ in eng.generate(input_ids=rand_ids(16, vocab, 300 + i), sampling_params=params, stream=True):
                    stamps[i].append(time.perf_counter())

            threads = [threading.Thread(target=stream, args=(i,)) for i in range(args.num_streams)]
            for t in threads:
                t.start()
            while min(len(s) for s in stamps) < 5:
                time.sleep(0.01)
            window["start"] = time.perf_counter()
            long = eng.generate(input_ids=rand_ids(args.long_len, vocab, 9), sampling_params={"max_new_tokens": 1})
            window["end"] = time.perf_counter()
            for t in threads:
                t.join()
            gaps = [b - a for s in stamps for a, b in zip(s, s[1:]) if b >= window["start"] and a <= window["end"]]
            quiet = [b - a for s in stamps for a, b in zip(s, s[1:]) if a > window["end"]]
            print(f"  {label:13s}: long prompt TTFT {window['end'] - window['start']:6.2f} s | ITL during its prefill: "
                  f"max {max(gaps) * 1000:7.1f} ms, mean {statistics.mean(gaps) * 1000:6.1f} ms over {len(gaps)} gaps | "
                  f"ITL after: mean {statistics.mean(quiet) * 1000 if quiet else float('nan'):5.1f} ms"
                  f" | cached {long['meta_info']['cached_tokens']}")
        finally:
            eng.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default=None)
    p.add_argument("--cpu-threads", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--system-len", type=int, default=1000)
    p.add_argument("--question-len", type=int, default=24)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=80000)
    p.add_argument("--num-streams", type=int, default=4)
    p.add_argument("--stream-len", type=int, default=200)
    p.add_argument("--long-len", type=int, default=8000)
    p.add_argument("--chunked-prefill-size", type=int, default=2048)
    p.add_argument("--skip", choices=["prefix", "itl"], default=None)
    args = p.parse_args()
    from core.log import configure_logging

    configure_logging("warning")
    print(f"torch {torch.__version__}, {args.cpu_threads} threads")
    if args.skip != "prefix":
        bench_shared_prefix(args)
    if args.skip != "itl":
        bench_itl(args)


if __name__ == "__main__":
    main()
