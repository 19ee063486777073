"""HiCache's host tier on CPU (issue 46; not a timed test): a ~3,000-token prefix's first prefill
against the same prefix served from the host tier after other prompts evicted it from a small
device pool, one run, the same engine, the same output checked.

    python bench/bench_hicache.py                  # SmolLM2-135M (the embedded default)
    python bench/bench_hicache.py --prefix-len 3000 --policy write_back

The device pool (--max-total-tokens) holds one long prompt; --evictors prompts of the same length
go through after the first request, so the prefix leaves the device (its KV stays on the host).
The figures are the wall time of a 1-token generate (prefill + first token): first prefill,
served from the host tier (load-back + the short suffix prefilled), and the speedup; the host
tier's own load-back seconds and bytes come from its counters. "Same output" compares greedy tokens
served from the host tier with those served from the device tier (the same cached KV); the first
token of a full prefill is shown too: in bf16 a full (chunked) prefill and a cached-prefix extend
may differ in the last bits, with or without the host tier.
"""

from __future__ import annotations

import argparse
import random
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--prefix-len", type=int, default=3000)
    ap.add_argument("--suffix-len", type=int, default=16)
    ap.add_argument("--evictors", type=int, default=2)
    ap.add_argument("--max-total-tokens", type=int, default=4096)
    ap.add_argument("--policy", default="write_through", help="--hicache-write-policy")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--check-tokens", type=int, default=8, help="greedy tokens compared between the two runs")
    a = ap.parse_args()

    import core

    eng = core.Engine(model_path=a.model_path, max_total_tokens=a.max_total_tokens, enable_hierarchical_cache=True,
                      hicache_ratio=4.0, hicache_write_policy=a.policy, random_seed=0, dtype=a.dtype)
    try:
        ae = eng.engine
        vocab = ae.vocab_size
        rng = random.Random(0)
        ids = lambda n: [rng.randrange(100, vocab - 100) for _ in range(n)]  # noqa: E731
        prompt = ids(a.prefix_len) + ids(a.suffix_len)
        one = {"temperature": 0.0, "max_new_tokens": 1}
        check = {"temperature": 0.0, "max_new_tokens": a.check_tokens, "ignore_eos": True}
        eng.generate(input_ids=ids(64), sampling_params=one)  # warm-up (kernels, allocator)
        ae.flush_cache()

        t0 = time.perf_counter()
        first = eng.generate(input_ids=prompt, sampling_params=one)
        t_first = time.perf_counter() - t0
        ref_out = eng.generate(input_ids=prompt, sampling_params=check)  # (a device-tier hit)
        ref = ref_out["output_ids"]
        for _ in range(a.evictors):
            eng.generate(input_ids=ids(a.prefix_len + a.suffix_len), sampling_params=one)
        tree = ae.tree_cache
        on_device = len(tree.match_prefix(prompt)[0]) * tree.page_size
        stats0 = dict(tree.tier_stats())
        t0 = time.perf_counter()
        host = eng.generate(input_ids=prompt, sampling_params=one)
        t_host = time.perf_counter() - t0
        stats1 = tree.tier_stats()
        # the same output: the reloaded KV continues exactly like the computed one
        for _ in range(a.evictors):
            eng.generate(input_ids=ids(a.prefix_len + a.suffix_len), sampling_params=one)
        again_out = eng.generate(input_ids=prompt, sampling_params=check)
        again = again_out["output_ids"]
    finally:
        eng.shutdown()

    print(f"model {ae.model_config.source}  dtype {ae.model_config.dtype}  prompt {len(prompt)} tokens  "
          f"device pool {ae.max_total_tokens} tokens  host pool {stats1['host_total_tokens']} tokens  "
          f"policy {a.policy}")
    print(f"prefix tokens still on the device before the re-request: {on_device}")
    print(f"first prefill (TTFT)              {t_first * 1e3:9.1f} ms  cached_tokens "
          f"{first['meta_info']['cached_tokens']}")
    print(f"served from the host tier (TTFT)  {t_host * 1e3:9.1f} ms  cached_tokens "
          f"{host['meta_info']['cached_tokens']}  (load-back "
          f"{(stats1['load_seconds'] - stats0['load_seconds']) * 1e3:.1f} ms, "
          f"{(stats1['bytes_to_device'] - stats0['bytes_to_device']) / 2**20:.1f} MiB, "
          f"{stats1['host_hit_tokens'] - stats0['host_hit_tokens']} tokens)")
    print(f"speedup {t_first / t_host:.2f}x")
    print(f"same output: {a.check_tokens} greedy tokens served from the host tier == from the device tier: "
          f"{again == ref} (cached_tokens {ref_out['meta_info']['cached_tokens']} / "
          f"{again_out['meta_info']['cached_tokens']}: {ref} vs {again}); first token == the first prefill's: {first['output_ids'] == host['output_ids']} "
          f"({first['output_ids']} vs {host['output_ids']})")


if __name__ == "__main__":
    main()
