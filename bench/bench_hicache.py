"""HiCache's host and file tiers on CPU (issue 46; not a timed test): a ~3,000-token prefix's first prefill
against the same prefix served from the host tier after other prompts evicted it from a small
device pool, one run, the same engine, the same output checked; then (``--storage``, on by default)
the file tier after a restart: a new engine on the same storage folder serves the prefix from storage.

    python bench/bench_hicache.py                  # SmolLM2-135M (the embedded default)
    python bench/bench_hicache.py --prefix-len 3000 --policy write_back

The device pool (--max-total-tokens) holds one long prompt; --evictors prompts of the same length
go through after the first request, so the prefix leaves the device (its KV stays on the host).
The figures are the wall time of a 1-token generate (prefill + first token): first prefill,
served from the host tier (load-back + the short suffix prefilled), and the speedup; the host
tier's own load-back seconds and bytes come from its counters. "Same output" compares greedy tokens
served from the host tier with those served from the device tier (the same cached KV); the first
token of a full prefill is shown too: in bf16 a full (chunked) prefill and a cached-prefix extend
may differ in the last bits, with or without the host tier. For the file tier, the KV read back is
compared bit for bit with the KV the first engine held; its greedy tokens may still part from the
device tier's in bf16: there the prompt's last token's KV came from the full prefill (the tree held
it), while a restarted engine recomputes that token (a match stops one token short of the prompt),
as an engine without any tier does after a prefill that stopped there.
"""

from __future__ import annotations

import argparse
import random
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--load-format", default="auto", help="dummy: random weights of --model-path's config.json")
    ap.add_argument("--prefix-len", type=int, default=3000)
    ap.add_argument("--suffix-len", type=int, default=16)
    ap.add_argument("--evictors", type=int, default=2)
    ap.add_argument("--max-total-tokens", type=int, default=4096)
    ap.add_argument("--policy", default="write_through", help="--hicache-write-policy")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--check-tokens", type=int, default=8, help="greedy tokens compared between the two runs")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--no-storage", dest="storage", action="store_false",
                    help="leave out the file tier (--hicache-storage-backend file) and its restart")
    ap.add_argument("--storage-dir", default=None, help="the file tier's folder (default: a fresh temporary one)")
    a = ap.parse_args()

    import os
    import shutil
    import tempfile

    import torch

    import core

    folder = a.storage_dir or tempfile.mkdtemp(prefix="bench-hicache-")
    os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = folder
    kw = dict(model_path=a.model_path, max_total_tokens=a.max_total_tokens, enable_hierarchical_cache=True,
              hicache_ratio=4.0, hicache_write_policy=a.policy, random_seed=0, dtype=a.dtype, page_size=a.page_size,
              hicache_storage_backend="file" if a.storage else None, load_format=a.load_format,
              skip_tokenizer_init=a.load_format == "dummy")
    eng = core.Engine(**kw)
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
        kv_ref = _prefix_kv(ae, prompt[:-1])  # the prefix's KV as the first engine computed it
        for _ in range(a.evictors):
            eng.generate(input_ids=ids(a.prefix_len + a.suffix_len), sampling_params=one)
        tree = ae.tree_cache
        on_device = len(tree.match_prefix(prompt)[0]) * tree.page_size
        if hasattr(tree, "flush_writes"):  # the evictors' write-through copies (a writer thread) are done, as
            tree.flush_writes()  # they would be after any pause: the timing below is the load-back's alone
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
        eng.shutdown()  # (the storage writes land)
    written = ae.tree_cache.tier_stats()
    if a.storage:
        eng2 = core.Engine(**kw)  # the restart: empty device and host tiers, the same storage folder
        try:
            eng2.generate(input_ids=ids(64), sampling_params=one)  # warm-up, as the first engine had
            tree2 = eng2.engine.tree_cache
            s0 = dict(tree2.tier_stats())
            t0 = time.perf_counter()
            disk = eng2.generate(input_ids=prompt, sampling_params=one)
            t_disk = time.perf_counter() - t0
            s1 = tree2.tier_stats()
            kv_disk = _prefix_kv(eng2.engine, prompt[:-1])
            eng2.engine.scheduler.flush_cache()  # device and host tiers only (the engine's flush empties storage too)
            disk_check = eng2.generate(input_ids=prompt, sampling_params=check)
        finally:
            eng2.shutdown()
            if a.storage_dir is None:
                shutil.rmtree(folder, ignore_errors=True)

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
    if a.storage:
        print(f"file tier after a restart (TTFT)  {t_disk * 1e3:9.1f} ms  cached_tokens "
              f"{disk['meta_info']['cached_tokens']}  (storage read "
              f"{(s1['storage_read_seconds'] - s0['storage_read_seconds']) * 1e3:.1f} ms, "
              f"{(s1['bytes_from_storage'] - s0['bytes_from_storage']) / 2**20:.1f} MiB, "
              f"{s1['storage_hit_tokens'] - s0['storage_hit_tokens']} tokens; written by the first engine "
              f"{written['bytes_to_storage'] / 2**20:.1f} MiB in {written['storage_write_seconds'] * 1e3:.0f} ms, "
              f"in the background)")
        print(f"speedup (file tier) {t_first / t_disk:.2f}x")
        print(f"KV read from the file tier == the KV the first engine computed, bit for bit: "
              f"{kv_disk is not None and bool(torch.equal(kv_disk, kv_ref))}")
        print(f"same output: {a.check_tokens} greedy tokens served from the file tier == from the device tier: "
              f"{disk_check['output_ids'] == ref} (cached_tokens {disk_check['meta_info']['cached_tokens']}: "
              f"{disk_check['output_ids']}); "
              f"first token == the first prefill's: {disk['output_ids'] == first['output_ids']}")


def _prefix_kv(ae, ids):
    """The K and V of every layer held on the device for ``ids`` (None unless all of it is)."""
    import torch

    tree, kv = ae.tree_cache, ae.kv_cache
    pages, _ = tree.match_prefix(ids)
    ps = tree.page_size
    if len(pages) * ps < len(ids) // ps * ps:
        return None
    slots = (torch.tensor(pages)[:, None] * ps + torch.arange(ps)).flatten()
    return torch.stack([torch.stack([k[slots], v[slots]]) for k, v in zip(kv.k, kv.v)]).clone()


if __name__ == "__main__":
    main()
