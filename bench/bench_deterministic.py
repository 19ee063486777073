"""What ``--enable-deterministic-inference`` costs: the default model's decode step and prefill with
and without it, engines alternating in one process (one at a time), best of the rounds.

    python bench/bench_deterministic.py --cpu-threads 2 --rounds 2
"""

from __future__ import annotations

import argparse
import platform
import random
import time

import core  # noqa: F401  (before torch: its OpenMP wait policy, see core/openmp.py)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--cpu-threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=128, help="the prefill's prompts")
    ap.add_argument("--context", type=int, default=512, help="the decode's prompts (their prefill not timed)")
    ap.add_argument("--steps", type=int, default=64)
    a = ap.parse_args()
    streams = [int(s) for s in a.streams.split(",")]
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(a.prompt_len)] for _ in range(max(streams))]
    contexts = [[rng.randrange(100, 30000) for _ in range(a.context)] for _ in range(max(streams))]
    decode = {"temperature": 0, "max_new_tokens": a.steps, "min_new_tokens": a.steps}
    one = {"temperature": 0, "max_new_tokens": 1, "min_new_tokens": 1}
    best: dict[tuple[bool, int], list[float]] = {}
    for _ in range(a.rounds):
        for det in (False, True):
            eng = core.Engine(model_path=a.model_path, skip_tokenizer_init=True, cpu_threads=a.cpu_threads,
                              disable_radix_cache=True, enable_deterministic_inference=det)
            eng.generate(input_ids=prompts[:1], sampling_params=one)  # warm-up
            for n in streams:
                t = time.perf_counter()
                eng.generate(input_ids=contexts[:n], sampling_params=one)
                first = time.perf_counter() - t  # (the prefill and first token, taken out of the decode's time)
                t = time.perf_counter()
                eng.generate(input_ids=contexts[:n], sampling_params=decode)
                step = (time.perf_counter() - t - first) / (a.steps - 1) * 1e3
                t = time.perf_counter()
                eng.generate(input_ids=prompts[:n], sampling_params=one)
                prefill = (time.perf_counter() - t) * 1e3
                old = best.get((det, n), [float("inf")] * 2)
                best[(det, n)] = [min(old[0], step), min(old[1], prefill)]
            eng.shutdown()
    print(f"# {platform.processor() or platform.machine()}, {a.cpu_threads} threads, best of {a.rounds} rounds; "
          f"decode: {a.steps} steps after {a.context}-token prompts; prefill: {a.prompt_len}-token prompts")
    print("streams  decode ms/step (plain / deterministic)  prefill ms (plain / deterministic)")
    for n in streams:
        (s0, p0), (s1, p1) = best[(False, n)], best[(True, n)]
        print(f"{n:7d}  {s0:8.2f} / {s1:8.2f} ({s1 / s0:.2f}x)       {p0:8.1f} / {p1:8.1f} ({p1 / p0:.2f}x)")


if __name__ == "__main__":
    main()
