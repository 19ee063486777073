"""Decode with and without ``--speculative-algorithm NGRAM`` on the default model, in one run.

Three workloads: batch 1 with a prompt whose answer copies it (repeat this repository's README
opening: the case n-gram drafting is for), batch 1 with a prompt whose answer does not (a story),
and ``--streams`` concurrent requests mixing both. Each mode is its own engine; they take turns
for ``--repeats`` rounds (a noisy machine hurts both alike) and the best round of each is printed:
decode tok/s after the first token (batch 1) or output tok/s of the whole batch, whether the
tokens are the same in both modes in every round, and the NGRAM engine's mean accept length (tokens
per target forward). Each round has new prompts (another slice of the README to copy, another
story), so no answer repeats an earlier one: NGRAM's index is shared across requests.

    python bench/bench_speculative.py --cpu-threads 2 [--max-new-tokens 128] [--repeats 3] [--streams 64]

Real shapes without a checkpoint (a GPU machine): ``--model-path CONFIG_DIR`` loads dummy weights and
sends token ids. A random model's answers are not text, so the repeating answer is a repeated
request: each round sends a new random prompt twice and times the second answer, which NGRAM's
shared index drafts from the first (the first answer is timed as "new prompt").

    python bench/bench_speculative.py --model-path bench/shapes/llama-3.1-8b --repeats 3
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import core  # noqa: F401  (before torch: its OpenMP wait policy)
import torch

from core.engine.device import cpu_model_name



def run(engine, prompt: str, max_new: int) -> tuple[float, list[int], dict]:
    params = {"temperature": 0, "max_new_tokens": max_new}
    first, out = None, None
    for chunk in engine.generate(prompt, params, stream=True):
        if first is None and chunk["output_ids"]:
            first = time.perf_counter()
        out = chunk
    n = len(out["output_ids"])
    return (n - 1) / (time.perf_counter() - first), out["output_ids"], out["meta_info"]


def run_batch(engine, prompts: list[str], max_new: int) -> tuple[float, list[list[int]], float]:
    """(output tok/s of the whole batch, each request's tokens, mean accept length)."""
    params = {"temperature": 0, "max_new_tokens": max_new}
    t0 = time.perf_counter()
    outs = engine.generate(prompts, [params] * len(prompts))
    dt = time.perf_counter() - t0
    ids = [o["output_ids"] for o in outs]
    accept = sum(o["meta_info"].get("spec_accept_length", 1.0) for o in outs) / len(outs)
    return sum(map(len, ids)) / dt, ids, accept


def dummy_main(args: argparse.Namespace) -> None:
    """Batch 1 on dummy weights of ``--model-path``'s shapes: a new random prompt, then the same
    again; then ``--streams`` new prompts at once (output tok/s from submission to the last token)."""
    import random

    from core import Engine

    ngram = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": args.num_draft_tokens}
    modes = {"plain": {}, "NGRAM": ngram}
    if torch.cuda.is_available():  # the same, its verifies run eagerly (their graphs dropped after start-up)
        modes["eager-v"] = ngram
    common = {"model_path": args.model_path, "load_format": "dummy", "skip_tokenizer_init": True, "log_level": "warning",
              "max_total_tokens": 16384}  # (not a memory fraction: the engine before may not have let go of its pool yet)
    runs: dict[tuple[str, str], list[tuple]] = {}
    for m, kw in modes.items():  # one engine at a time: an 8B's weights twice may not fit
        eng = Engine(**common, **kw)
        if m == "eager-v" and (graphs := eng.engine.runner.graphs) is not None:
            graphs.verify_sizes = []
        vocab = eng.engine.model_config.hf_config.vocab_size
        params = {"temperature": 0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}
        for r in range(args.repeats + 1):  # round 0 warms the engine up (kernels, graphs)
            prompt = [random.Random(1000 + r).randrange(100, vocab) for _ in range(128)]
            for name in ("new prompt, batch 1", "repeated request, batch 1"):
                first, out = None, None
                for chunk in eng.generate(input_ids=prompt, sampling_params=params, stream=True):
                    if first is None and chunk["output_ids"]:
                        first = time.perf_counter()
                    out = chunk
                rate = (len(out["output_ids"]) - 1) / (time.perf_counter() - first)
                if r:
                    runs.setdefault((name, m), []).append((rate, out["output_ids"],
                                                           out["meta_info"].get("spec_accept_length", 1.0)))
            if args.streams > 1:  # a batch of new prompts at once: speculation must not cost throughput
                rng = random.Random(2000 + r)
                batch = [[rng.randrange(100, vocab) for _ in range(128)] for _ in range(args.streams)]
                t0 = time.perf_counter()
                outs = eng.generate(input_ids=batch, sampling_params=params)
                rate = sum(len(o["output_ids"]) for o in outs) / (time.perf_counter() - t0)
                if r:
                    runs.setdefault((f"new prompts, {args.streams} streams", m), []).append(
                        (rate, [o["output_ids"] for o in outs], outs[0]["meta_info"].get("spec_accept_length", 1.0)))
        eng.shutdown()
        del eng
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else cpu_model_name()
    print(f"# {dev}, torch {torch.__version__}; {args.model_path} dummy weights, greedy, 128 in / "
          f"{args.max_new_tokens} out, best of {args.repeats}")
    _table(runs)


def _table(runs: dict[tuple[str, str], list[tuple]]) -> None:
    print(f"{'workload':<28}{'mode':<8}{'tok/s':>10}{'accept length':>15}  same tokens  speed-up")
    for (name, m), rounds in runs.items():
        plain = runs[name, "plain"]
        rate, _, accept = max(rounds, key=lambda x: x[0])
        same = all(a[1] == b[1] for a, b in zip(rounds, plain))
        print(f"{name:<28}{m:<8}{rate:>10.1f}{accept:>15.2f}  {str(same):<11}  {rate / max(x[0] for x in plain):.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-draft-tokens", type=int, default=12)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--model-path", help="a config.json folder: dummy weights of its shapes, token ids (see above)")
    args = ap.parse_args()
    if args.model_path:
        return dummy_main(args)
    from core import Engine

    ngram = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": args.num_draft_tokens}
    modes = {"plain": {}, "NGRAM": ngram}
    if torch.cuda.is_available():  # the same, its verifies run eagerly (their graphs dropped after start-up)
        modes["eager-v"] = ngram
    engines = {m: Engine(cpu_threads=args.cpu_threads, log_level="warning", **kw) for m, kw in modes.items()}
    tok = engines["plain"].engine.tokenizer

    def chat(text: str) -> str:
        return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    subjects = ["a lighthouse keeper who finds a message in a bottle", "a baker who opens a shop on the moon",
                "a cat that learns to play the violin", "two rivals stuck in a lift", "a robot that plants trees"]

    def prompts(r: int) -> tuple[str, str, list[str]]:
        """Round ``r``'s prompts, new each round: an answer never repeats an earlier round's (NGRAM's
        index is shared across requests, and a repeated prompt would draft the earlier answer)."""
        passage = readme[600 * r:600 * (r + 1)]
        copy = chat("Repeat this text exactly, word for word:\n\n" + passage)
        story = chat(f"Write a short story about {subjects[r % len(subjects)]}.")
        # the batch: half copy a slice of the passage, half write stories on different subjects
        batch = [chat("Repeat this text exactly, word for word:\n\n" + passage[i * 7 % 300:][:300]) if i % 2 else
                 chat(f"Write a short story about {subjects[(r + i) % len(subjects)]}, whose hero's name starts "
                      f"with the letter {chr(65 + i % 26)}.") for i in range(args.streams)]
        return copy, story, batch

    runs: dict[tuple[str, str], list[tuple]] = {}
    for r in range(args.repeats):
        copy, story, batch = prompts(r)
        for m, eng in engines.items():
            for name, prompt in (("copy, batch 1", copy), ("story, batch 1", story)):
                rate, ids, meta = run(eng, prompt, args.max_new_tokens)
                runs.setdefault((name, m), []).append((rate, ids, meta.get("spec_accept_length", 1.0)))
            rate, ids, accept = run_batch(eng, batch, args.max_new_tokens // 2)
            runs.setdefault((f"mixed, {args.streams} streams", m), []).append((rate, ids, accept))
    for eng in engines.values():
        eng.shutdown()
    print(f"# {cpu_model_name()}, {args.cpu_threads} threads, torch {torch.__version__}; default model, greedy, "
          f"{args.max_new_tokens} new tokens at batch 1 and {args.max_new_tokens // 2} in the batch, best of {args.repeats}")
    _table(runs)


if __name__ == "__main__":
    main()
