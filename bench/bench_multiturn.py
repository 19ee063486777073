"""Multi-turn chat with and without HiCache's host tier (issue 46; not a timed test), one run.

``--conversations`` conversations, each a distinct system prompt and ``--turns`` turns, visited
round-robin (turn 1 of every conversation, then turn 2, ...), so that between two turns of one
conversation every other conversation passes through a device pool (``--max-total-tokens``) that
holds only about a quarter of them. Each turn sends the conversation so far plus a new user
message and generates ``--answer-tokens`` greedy tokens, which join the history. Without the host
tier a returning conversation's evicted prefix is prefilled again; with it, its pages come back
from host memory. Printed per mode: TTFT p50 / p90 over the turns after the first, the prompt
tokens computed (not served from any cache), and whether both modes produced the same answers
(in bf16 a prefix prefilled again in other chunks may round differently and flip a near-tie; with
``--dtype float32`` they match).

    python bench/bench_multiturn.py [--conversations 16] [--turns 6] [--system-tokens 600]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def run(args: argparse.Namespace, hicache: bool) -> tuple[list[float], int, list[list[int]]]:
    import core

    eng = core.Engine(max_total_tokens=args.max_total_tokens, enable_hierarchical_cache=hicache, dtype=args.dtype,
                      hicache_ratio=args.hicache_ratio, random_seed=0, log_level="warning", cpu_threads=args.cpu_threads,
                      model_path=args.model_path, load_format=args.load_format,
                      skip_tokenizer_init=args.load_format == "dummy")
    try:
        vocab = eng.engine.vocab_size
        rng = random.Random(0)

        def ids(n: int) -> list[int]:
            return [rng.randrange(100, vocab - 100) for _ in range(n)]

        history = [ids(args.system_tokens) for _ in range(args.conversations)]
        users = [[ids(args.user_tokens) for _ in range(args.turns)] for _ in range(args.conversations)]
        params = {"temperature": 0.0, "max_new_tokens": args.answer_tokens, "ignore_eos": True}
        ttft, computed, answers = [], 0, []
        for turn in range(args.turns):
            for c in range(args.conversations):
                prompt = history[c] + users[c][turn]
                t0, first, out = time.perf_counter(), None, None
                for chunk in eng.generate(input_ids=prompt, sampling_params=params, stream=True):
                    if first is None and chunk["output_ids"]:
                        first = time.perf_counter() - t0
                    out = chunk
                if turn:
                    ttft.append(first)
                computed += len(prompt) - out["meta_info"]["cached_tokens"]
                answers.append(out["output_ids"])
                history[c] = prompt + out["output_ids"]
        return ttft, computed, answers
    finally:
        eng.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=600)
    ap.add_argument("--user-tokens", type=int, default=40)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--max-total-tokens", type=int, default=0,
                    help="device pool (default: about a quarter of the conversations' final length)")
    ap.add_argument("--hicache-ratio", type=float, default=6.0)
    ap.add_argument("--cpu-threads", type=int, default=2)
    ap.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--load-format", default="auto", help="dummy: random weights of --model-path's config.json")
    ap.add_argument("--dtype", default="auto", help="float32: the two modes' answers are comparable token for token")
    args = ap.parse_args()
    final = args.system_tokens + args.turns * (args.user_tokens + args.answer_tokens)
    args.max_total_tokens = args.max_total_tokens or max(2048, args.conversations * final // 4)
    from core.engine.device import cpu_model_name

    results = {mode: run(args, mode == "host tier") for mode in ("device only", "host tier")}
    print(f"# {cpu_model_name()}, {args.cpu_threads} threads; {args.model_path or 'default model'}; {args.conversations} conversations x "
          f"{args.turns} turns round-robin, {args.system_tokens}-token system prompts, {args.user_tokens}-token "
          f"messages, {args.answer_tokens}-token answers; device pool {args.max_total_tokens} tokens "
          f"(conversations end at ~{final} tokens)")
    print(f"{'mode':<14}{'TTFT p50 ms':>12}{'TTFT p90 ms':>12}{'prompt tokens computed':>24}")
    for mode, (ttft, computed, _) in results.items():
        q = statistics.quantiles(ttft, n=10)
        print(f"{mode:<14}{statistics.median(ttft) * 1e3:>12.1f}{q[8] * 1e3:>12.1f}{computed:>24}")
    same = results["device only"][2] == results["host tier"][2]
    print(f"# same answers: {same}")


if __name__ == "__main__":
    main()
