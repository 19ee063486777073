"""The ``triton`` attention backend: against torch_native step by step on a paged pool
(prefix hits, mixed decode/prefill, a sliding window with soft-capping), its refusal where
triton cannot run, a plugin import that does not pull in triton, and the Engine's greedy
tokens equal to torch_native's. Without a GPU the kernels run in triton's interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
pytest.importorskip("triton")

from core.engine.mem_cache.kv_cache import allocate_kv_cache  # noqa: E402
from core.errors import CoreError  # noqa: E402
from core.interfaces import AttentionConfig, AttentionLayerSpec, ForwardBatch  # noqa: E402
from core_plugins.attention.torch_native import TorchNativeBackend  # noqa: E402
from core_plugins.attention.triton import TritonBackend  # noqa: E402
from tests.conftest import greedy, make_engine  # noqa: E402
from tests.test_triton_kernels import scatter_slots  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def config(h: int, hkv: int, d: int, num_slots: int, page_size: int, layers: int = 2) -> AttentionConfig:
    kv = allocate_kv_cache(layers, num_slots // page_size, page_size, hkv, d, torch.float32, DEV)
    return AttentionConfig(layers, h, hkv, d, torch.float32, DEV, kv)


def forward_batch(backend, slots: list[list[int]], lens: list[int], new: list[int]) -> ForwardBatch:
    """Sequence i holds ``lens[i]`` tokens after this forward, the last ``new[i]`` of them new."""
    pos = [p for n, e in zip(lens, new) for p in range(n - e, n)]
    loc = [s[p] for s, n, e in zip(slots, lens, new) for p in range(n - e, n)]
    width = max(lens)
    table = [s[:n] + [0] * (width - n) for s, n in zip(slots, lens)]
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=DEV)  # noqa: E731
    return ForwardBatch(input_ids=t([0] * len(pos)), positions=t(pos), out_cache_loc=t(loc), seq_lens=t(lens),
                        extend_lens=t(new), kv_indices=t(table), seq_lens_cpu=list(lens), extend_lens_cpu=list(new),
                        attn_backend=backend)


CASES = {
    # name: (H, Hkv, D, page_size, window, cap)
    "gqa-d64-page1": (4, 2, 64, 1, None, 0.0),
    "mqa-d128-page16-window-cap": (4, 1, 128, 16, 8, 5.0),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_backend_matches_torch_native_over_mixed_steps(case):
    h, hkv, d, ps, window, cap = CASES[case]
    gen = torch.Generator().manual_seed(list(CASES).index(case))
    cached = [20, 0, 3]  # prefix hits: these tokens are in the pool before the first step
    steps = [[6, 11, 1], [1, 1, 1], [1, 5, 1]]  # mixed, pure decode, mixed (a prefill chunk among decodes)
    final = [c + sum(s[i] for s in steps) for i, c in enumerate(cached)]
    slots, n = scatter_slots(final, ps, gen)
    ref_cfg, tri_cfg = config(h, hkv, d, n, ps), config(h, hkv, d, n, ps)
    for pool in (ref_cfg.kv_cache, tri_cfg.kv_cache):
        for layer_kv in (*pool.k, *pool.v):
            g = torch.Generator().manual_seed(7)  # the same cached K/V in both pools
            layer_kv[ps:] = torch.randn(layer_kv[ps:].shape, generator=g).to(DEV)
    ref, tri = TorchNativeBackend(ref_cfg), TritonBackend(tri_cfg)
    specs = [AttentionLayerSpec(i, h, hkv, d, d**-0.5, sliding_window=window, logit_cap=cap) for i in range(2)]
    lens = list(cached)
    for step in steps:
        live = [i for i, e in enumerate(step) if e]
        lens = [n + e for n, e in zip(lens, step)]
        args = ([slots[i] for i in live], [lens[i] for i in live], [step[i] for i in live])
        ref_b, tri_b = forward_batch(ref, *args), forward_batch(tri, *args)
        ref.prepare(ref_b)
        tri.prepare(tri_b)
        t = sum(step)
        for spec in specs:
            q = torch.randn(t, h, d, generator=gen).to(DEV)
            k, v = (torch.randn(t, hkv, d, generator=gen).to(DEV) for _ in range(2))
            want = ref.forward(q, k, v, spec, ref_b)
            got = tri.forward(q, k, v, spec, tri_b)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for a, b in zip((*ref_cfg.kv_cache.k, *ref_cfg.kv_cache.v), (*tri_cfg.kv_cache.k, *tri_cfg.kv_cache.v)):
        assert torch.equal(a, b), "the pools differ after the same writes"


def test_refuses_clearly_where_triton_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = AttentionConfig(1, 2, 2, 16, torch.float32, torch.device("cpu"),
                          allocate_kv_cache(1, 2, 1, 2, 16, torch.float32, torch.device("cpu")))
    with pytest.raises(CoreError, match=r"needs a CUDA GPU.*runs on cpu.*torch_native.*TRITON_INTERPRET=1"):
        TritonBackend(cfg)


def test_importing_the_plugin_does_not_import_triton():
    code = "import sys, core_plugins.attention.triton; assert 'triton' not in sys.modules, 'triton was imported'"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return tiny_llama("gqa")


ENGINE_OPTS = {
    "page1": {},
    # prompts prefilled in 16-token chunks alongside decoding requests, 16-slot pages
    "page16-chunked-mixed": {"page_size": 16, "chunked_prefill_size": 16, "enable_mixed_chunk": True},
}


@pytest.mark.timeout(300)  # bounds a hung engine (seconds on CPU)
@pytest.mark.parametrize("opts", list(ENGINE_OPTS), ids=list(ENGINE_OPTS))
def test_engine_greedy_tokens_equal_torch_native(tiny, opts):
    path, _ = tiny
    prompts = ["The quick brown fox", "Hi", "a b c d e f g h i j k l m n o p q r s t u v w x y z 0 1 2 3 4 5 6 7 8"]
    got = {}
    for backend in ("torch_native", "triton"):
        eng = make_engine(path, attention_backend=backend, max_running_requests=4, device=str(DEV), **ENGINE_OPTS[opts])
        try:
            first = [o["output_ids"] for o in eng.generate(prompts, greedy(6))]
            again = eng.generate(prompts[0] + " jumps over", greedy(4))  # the cached prompt is a prefix hit
        finally:
            eng.shutdown()
        assert again["meta_info"]["cached_tokens"] > 0
        got[backend] = first + [again["output_ids"]]
    assert got["triton"] == got["torch_native"]
