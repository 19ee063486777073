"""Offline throughput / TTFT benchmark: core's Engine next to transformers' generate.

For each concurrency C in --concurrency, C requests of --input-len random tokens each
generate exactly --output-len tokens (EOS ignored). core receives them all at once
through async_generate (streaming, so time to first token is measured per request);
transformers runs the same prompts as one padded-free batch (all prompts have the
same length) in ``generate``, its TTFT being the time of a 1-token generate.

Run on a quiet machine, one engine at a time:
    python bench/bench_offline.py --cpu-threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time

import torch


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n, length), generator=g).tolist()


async def run_core(engine, prompts: list[list[int]], out_len: int) -> tuple[float, list[float], int]:
    params = {"temperature": 0, "max_new_tokens": out_len, "ignore_eos": True}
    t0 = time.perf_counter()
    ttfts: list[float] = []

    async def one(p: list[int]) -> int:
        n = 0
        async for chunk in await engine.async_generate(input_ids=p, sampling_params=params, stream=True):
            if n == 0 and chunk["output_ids"]:
                ttfts.append(time.perf_counter() - t0)
            n = len(chunk["output_ids"])
        return n

    counts = await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - t0, ttfts, sum(counts)


def run_hf(model, prompts: list[list[int]], out_len: int) -> tuple[float, float, int]:
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False, pad_token_id=0)
        wall = time.perf_counter() - t0
    return wall, ttft, (out.shape[1] - ids.shape[1]) * ids.shape[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,8,64")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cpu-threads", type=int, default=None)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    levels = [int(c) for c in args.concurrency.split(",")]

    from core import Engine
    from core.log import configure_logging

    configure_logging("warning")
    engine = Engine(dtype=args.dtype, max_total_tokens=max(levels) * (args.input_len + args.output_len) + 64,
                    max_running_requests=max(levels), cpu_threads=args.cpu_threads, log_level="warning")
    vocab = engine.engine.vocab_size
    path = engine.engine.model_config.path
    # warm-up
    engine.generate(input_ids=make_prompts(1, 16, vocab, 0)[0], sampling_params={"max_new_tokens": 4, "ignore_eos": True})
    rows = []
    for c in levels:
        prompts = make_prompts(c, args.input_len, vocab, c)
        wall, ttfts, toks = asyncio.run(run_core(engine, prompts, args.output_len))
        rows.append(("core", c, toks / wall, statistics.median(ttfts), wall))
    engine.shutdown()

    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
        model.generate(torch.tensor(make_prompts(1, 16, vocab, 0)), max_new_tokens=4, do_sample=False, pad_token_id=0)
        for c in levels:
            prompts = make_prompts(c, args.input_len, vocab, c)
            wall, ttft, toks = run_hf(model, prompts, args.output_len)
            rows.append(("transformers", c, toks / wall, ttft, wall))

    print(f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"dtype {args.dtype}, {args.input_len} in / {args.output_len} out, EOS ignored")
    print(f"{'engine':<14}{'concurrency':>12}{'output tok/s':>14}{'TTFT p50 (s)':>14}{'wall (s)':>10}")
    for name, c, tps, ttft, wall in sorted(rows, key=lambda r: (r[1], r[0])):
        print(f"{name:<14}{c:>12}{tps:>14.1f}{ttft:>14.3f}{wall:>10.2f}")


if __name__ == "__main__":
    main()
