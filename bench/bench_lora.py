"""Multi-LoRA decode cost (issue 44; not a timed test): ``--streams`` concurrent requests, each
through its own random rank-``--rank`` adapter over every linear layer, against the same batch on
the base model, in one run.

Rows (one engine with ``--enable-lora`` and the adapters, the modes taking turns ``--repeats``
times; the best of each): ``base`` (no request names an adapter: the model's fastest path),
``lora`` (each stream its own adapter), and ``plain`` (an engine without ``--enable-lora``, the
reference for what enabling LoRA costs a base-only batch). Printed: TPOT p50 (ms) of the
streams, output tok/s, and the step ratio lora / base (issue 44's CPU bar: <= 1.3x), of the best
runs and per round (plain, base and lora back to back, both engines loaded: the median of those
is the steadier figure on a noisy machine).

The adapters are peft checkpoints for the model's shapes with random A and B
(``core.testing.lora.write_random_adapter``).

    python bench/bench_lora.py --cpu-threads 2                  # default model (SmolLM2-135M GGUF)
    python bench/bench_lora.py --model-path bench/shapes/llama-3.1-8b --load-format dummy --streams 64 --adapters 16
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import core  # noqa: F401  (before torch: its OpenMP wait policy)
import torch

def run(eng, prompts: list[list[int]], names: list[str | None], new: int) -> tuple[float, float]:
    """(TPOT p50 in ms over the streams, output tok/s) of one batch, all submitted at once."""
    import asyncio

    params = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}

    async def one(p, name):
        first = n = None
        async for chunk in await eng.async_generate(input_ids=p, sampling_params=params, stream=True, lora_path=name):
            n = len(chunk["output_ids"])
            if first is None and n:
                first = time.perf_counter()
        return (time.perf_counter() - first) / max(1, n - 1), n

    async def all_():
        return await asyncio.gather(*(one(p, nm) for p, nm in zip(prompts, names)))

    t0 = time.perf_counter()
    res = asyncio.run(all_())
    wall = time.perf_counter() - t0
    return statistics.median(t for t, _ in res) * 1e3, sum(n for _, n in res) / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--cpu-threads", type=int, default=2)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--adapters", type=int, default=0, help="distinct adapters (default: one per stream)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from core import Engine
    from core.engine.device import cpu_model_name
    from core.testing.lora import write_random_adapter

    n_ad = args.adapters or args.streams
    common = dict(cpu_threads=args.cpu_threads, log_level="warning", random_seed=0, load_format=args.load_format,
                  skip_tokenizer_init=args.load_format == "dummy",
                  max_total_tokens=max(4096, 2 * args.streams * (args.input_len + args.output_len)))
    if args.model_path:
        common["model_path"] = args.model_path
    with tempfile.TemporaryDirectory() as tmp:
        plain = Engine(**common)
        cfg = plain.engine.model_config.hf_config
        paths = []
        for i in range(n_ad):
            write_random_adapter(Path(tmp) / f"a{i}", cfg, args.rank, seed=i)
            paths.append(f"a{i}={Path(tmp) / f'a{i}'}")
        vocab = cfg.vocab_size
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(100, vocab - 100, (args.input_len,), generator=g).tolist() for _ in range(args.streams)]
        results: dict[str, list[tuple[float, float]]] = {"plain": [], "base": [], "lora": []}
        eng = Engine(**common, enable_lora=True, lora_paths=paths, max_loras_per_batch=min(n_ad, args.streams),
                     disable_radix_cache=True)
        names = [f"a{i % n_ad}" for i in range(args.streams)]
        run(plain, prompts, [None] * args.streams, 8)  # warm-up
        run(eng, prompts, names, 8)
        for _ in range(args.repeats):  # the three back to back in each round (both engines loaded, one running)
            results["plain"].append(run(plain, prompts, [None] * args.streams, args.output_len))
            results["base"].append(run(eng, prompts, [None] * args.streams, args.output_len))
            results["lora"].append(run(eng, prompts, names, args.output_len))
        eng.shutdown()
        plain.shutdown()
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else f"{cpu_model_name()}, {args.cpu_threads} threads"
    print(f"# {dev}, torch {torch.__version__}; {args.model_path or 'default model'}; {args.streams} streams over "
          f"{n_ad} rank-{args.rank} adapters (all 7 linear layers), {args.input_len} in / {args.output_len} out, "
          f"best of {args.repeats}")
    best = {k: min(v) for k, v in results.items()}
    print(f"{'mode':<8}{'TPOT p50 ms':>14}{'output tok/s':>14}")
    for k, (tpot, tps) in best.items():
        print(f"{k:<8}{tpot:>14.2f}{tps:>14.1f}")
    print(f"lora / base step: {best['lora'][0] / best['base'][0]:.2f}x   lora / plain: "
          f"{best['lora'][0] / best['plain'][0]:.2f}x")
    # each round's base and lora ran back to back, under the same load from the VM's neighbours
    for num, ref in (("lora", "base"), ("lora", "plain"), ("base", "plain")):
        rounds = sorted(x[0] / y[0] for y, x in zip(results[ref], results[num]))
        print(f"{num} / {ref} per round: median {statistics.median(rounds):.2f}x, range {rounds[0]:.2f}-{rounds[-1]:.2f}x "
              f"over {len(rounds)} rounds")


if __name__ == "__main__":
    main()
