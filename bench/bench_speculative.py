"""Batch-1 decode with and without ``--speculative-algorithm NGRAM`` on the default model, in one run.

The prompt asks the model to repeat a passage (this repository's README opening), so its answer
copies the prompt: the case n-gram drafting is for. Each mode is its own engine; they take turns
for ``--repeats`` rounds (a noisy machine hurts both alike) and the best round of each is printed:
decode tok/s after the first token, the tokens, whether they are the same in both modes, and the
NGRAM engine's mean accept length (tokens per target forward).

    python bench/bench_speculative.py --cpu-threads 2 [--max-new-tokens 128] [--repeats 3]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-draft-tokens", type=int, default=12)
    args = ap.parse_args()
    from core import Engine

    modes = {"plain": {}, "NGRAM": {"speculative_algorithm": "NGRAM",
                                    "speculative_num_draft_tokens": args.num_draft_tokens}}
    engines = {m: Engine(cpu_threads=args.cpu_threads, log_level="warning", **kw) for m, kw in modes.items()}
    tok = engines["plain"].engine.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Repeat this text exactly, word for word:\n\n"
                                       + PASSAGE}], tokenize=False, add_generation_prompt=True)
    best: dict[str, tuple] = {}
    for _ in range(args.repeats):
        for m, eng in engines.items():
            rate, ids, meta = run(eng, prompt, args.max_new_tokens)
            if m not in best or rate > best[m][0]:
                best[m] = (rate, ids, meta)
    for eng in engines.values():
        eng.shutdown()
    print(f"# {cpu_model_name()}, {args.cpu_threads} threads, torch {torch.__version__}; default model, batch 1, "
          f"greedy, up to {args.max_new_tokens} new tokens, best of {args.repeats}")
    print(f"{'mode':<8}{'decode tok/s':>14}{'tokens':>8}{'accept length':>15}")
    for m, (rate, ids, meta) in best.items():
        print(f"{m:<8}{rate:>14.1f}{len(ids):>8}{meta.get('spec_accept_length', 1.0):>15.2f}")
    print(f"# same tokens: {best['plain'][1] == best['NGRAM'][1]}; speed-up {best['NGRAM'][0] / best['plain'][0]:.2f}x")


if __name__ == "__main__":
    main()
