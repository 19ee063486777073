"""vLLM's CPU build on bench_offline.py's workload, as the baseline for docs/benchmarks.md.

C prompts of --input-len random token ids (the same ids bench_offline.py makes), exactly
--output-len tokens out (EOS ignored), greedy. TTFT is the wall time of the same batch with
one output token (all prefill) over different prompts, so its prefix cache cannot help. Run it alone, in
its own virtual environment (see ../shared/bench/README.md), with both cores given to the
worker::

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \\
        python bench/bench_vllm.py MODEL_DIR --concurrency 1,8,64 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time

import torch


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n, length), generator=g).tolist()


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--concurrency", default="1,8,64")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.input_len + args.output_len + 64,
              max_num_seqs=max(levels), gpu_memory_utilization=0.5)
    vocab = 49152
    llm.generate([TokensPrompt(prompt_token_ids=list(range(100, 116)))], SamplingParams(max_tokens=4, ignore_eos=True))
    full = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    print(f"{'engine':<14}{'concurrency':>12}{'output tok/s':>14}{'TTFT (s)':>14}{'wall (s)':>10}")
    for c in levels:
        ps = [TokensPrompt(prompt_token_ids=p) for p in make_prompts(c, args.input_len, vocab, c)]
        other = [TokensPrompt(prompt_token_ids=p) for p in make_prompts(c, args.input_len, vocab, c + 10_000)]
        t0 = time.perf_counter()
        llm.generate(other, first, use_tqdm=False)  # other prompts: no prefix-cache hit for the timed run
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        outs = llm.generate(ps, full, use_tqdm=False)
        wall = time.perf_counter() - t0
        toks = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"{'vllm-cpu':<14}{c:>12}{toks / wall:>14.1f}{ttft:>14.3f}{wall:>10.2f}", flush=True)


if __name__ == "__main__":  # vLLM starts its workers with spawn
    main()
