"""Decode with and without ``--speculative-algorithm NGRAM`` on the default model, in one run.

Three workloads: batch 1 with a prompt whose answer copies it (repeat this repository's README
opening: the case n-gram drafting is for), batch 1 with a prompt whose answer does not (a story),
and ``--streams`` concurrent requests mixing both. Each mode is its own engine; they take turns
for ``--repeats`` rounds (a noisy machine hurts both alike) and the best round of each is printed:
decode tok/s after the first token (batch 1) or output tok/s of the whole batch, whether the
tokens are the same in both modes, and the NGRAM engine's mean accept length (tokens per target
forward).

    python bench/bench_speculative.py --cpu-threads 2 [--max-new-tokens 128] [--repeats 3] [--streams 64]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import core  # noqa: F401  (before torch: its OpenMP wait policy)
import torch

from core.engine.device import cpu_model_name

PASSAGE = (Path(__file__).resolve().parents[1] / "README.md").read_text()[:600]


def run(engine, prompt: str, max_new: int) -> tuple[float, list[int], dict]:
    params = {"temperature": 0, "max_new_tokens": max_new}
    t0, first, out = time.perf_counter(), None, None
    for chunk in engine.generate(prompt, params, stream=True):
        if first is None and chunk["output_ids"]:
            first = time.perf_counter()
        out = chunk
    n = len(out["output_ids"])
    return (n - 1) / (time.perf_counter() - first), out["output_ids"], out["meta_info"]


STORY = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def run_batch(engine, prompts: list[str], max_new: int) -> tuple[float, list[list[int]], float]:
    """(output tok/s of the whole batch, each request's tokens, mean accept length)."""
    params = {"temperature": 0, "max_new_tokens": max_new}
    t0 = time.perf_counter()
    outs = engine.generate(prompts, [params] * len(prompts))
    dt = time.perf_counter() - t0
    ids = [o["output_ids"] for o in outs]
    accept = sum(o["meta_info"].get("spec_accept_length", 1.0) for o in outs) / len(outs)
    return sum(map(len, ids)) / dt, ids, accept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-draft-tokens", type=int, default=12)
    ap.add_argument("--streams", type=int, default=64)
    args = ap.parse_args()
    from core import Engine

    modes = {"plain": {}, "NGRAM": {"speculative_algorithm": "NGRAM",
                                    "speculative_num_draft_tokens": args.num_draft_tokens}}
    engines = {m: Engine(cpu_threads=args.cpu_threads, log_level="warning", **kw) for m, kw in modes.items()}
    tok = engines["plain"].engine.tokenizer

    def chat(text: str) -> str:
        return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)

    copy = chat("Repeat this text exactly, word for word:\n\n" + PASSAGE)
    story = chat(STORY)
    # the batch: half copy a slice of the passage, half write stories on different subjects
    batch = [chat("Repeat this text exactly, word for word:\n\n" + PASSAGE[i * 7 % 300:][:300]) if i % 2 else
             chat(f"{STORY} Make the keeper's name start with the letter {chr(65 + i % 26)}.")
             for i in range(args.streams)]
    best: dict[tuple[str, str], tuple] = {}
    for _ in range(args.repeats):
        for m, eng in engines.items():
            for name, prompt in (("copy, batch 1", copy), ("story, batch 1", story)):
                rate, ids, meta = run(eng, prompt, args.max_new_tokens)
                if (name, m) not in best or rate > best[name, m][0]:
                    best[name, m] = (rate, ids, meta.get("spec_accept_length", 1.0))
            name = f"mixed, {args.streams} streams"
            rate, ids, accept = run_batch(eng, batch, args.max_new_tokens // 2)
            if (name, m) not in best or rate > best[name, m][0]:
                best[name, m] = (rate, ids, accept)
    for eng in engines.values():
        eng.shutdown()
    print(f"# {cpu_model_name()}, {args.cpu_threads} threads, torch {torch.__version__}; default model, greedy, "
          f"{args.max_new_tokens} new tokens at batch 1 and {args.max_new_tokens // 2} in the batch, best of {args.repeats}")
    print(f"{'workload':<22}{'mode':<8}{'tok/s':>10}{'accept length':>15}  same tokens  speed-up")
    for (name, m), (rate, ids, accept) in best.items():
        plain = best[name, "plain"]
        print(f"{name:<22}{m:<8}{rate:>10.1f}{accept:>15.2f}  {str(ids == plain[1]):<11}  {rate / plain[0]:.2f}x")


if __name__ == "__main__":
    main()
