"""``--enable-deterministic-inference``: a request's tokens and logprobs are bit for bit the same alone,
at any place in batches of any size (past the decode stack's rows and the dense copies' thresholds),
prefilled whole or in chunks, from the prefix cache or not, greedy or sampled; on two threads, where
the attention would split a lone decode's keys."""

from __future__ import annotations

import random

import pytest
import torch

import core
from core.errors import CoreError
from core.engine.deterministic import row_blocked
from tests.conftest import greedy, make_engine

N = 10  # tokens generated per request


def _prompts(seed: int, n: int, lo: int, hi: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _run(eng, batch: list[list[int]], i: int, **sampling) -> tuple[list[int], list[float]]:
    """Request ``i`` of ``batch`` (all in one call): its tokens and their logprobs."""
    outs = eng.generate(input_ids=batch, sampling_params={**greedy(N), **sampling}, return_logprob=True)
    o = outs[i]
    return o["output_ids"], [lp for lp, *_ in o["meta_info"]["output_token_logprobs"]]


def _assert_invariant(eng, chunked, p: list[int], others: list[list[int]], **sampling) -> None:
    alone = _run(eng, [p], 0, **sampling)
    assert len(alone[0]) == N
    cases = {
        "alone again (its prefix cached)": _run(eng, [p], 0, **sampling),
        "third of 3": _run(eng, others[:2] + [p], 2, **sampling),
        "first of 17": _run(eng, [p] + others[:16], 0, **sampling),
        "last of 70": _run(eng, others[:69] + [p], 69, **sampling),
        "prefilled in chunks of 16": _run(chunked, [p], 0, **sampling),
    }
    for name, got in cases.items():
        assert got == alone, name  # tokens and logprobs, exactly


@pytest.mark.parametrize("dtype,head_dim", [("float32", 64), ("bfloat16", 16)])
def test_a_request_is_the_same_in_any_batch(tiny_llama, dtype, head_dim):
    path, _ = tiny_llama("gqa", head_dim=head_dim)
    kw = dict(dtype=dtype, skip_tokenizer_init=True, cpu_threads=2, max_total_tokens=8192,
              enable_deterministic_inference=True)
    eng, chunked = make_engine(path, **kw), make_engine(path, chunked_prefill_size=16, **kw)
    try:
        p, *others = _prompts(0, 70, 5, 60, 250)
        p = p + [7] * (60 - len(p))
        _assert_invariant(eng, chunked, p, others)
        _assert_invariant(eng, chunked, p, others, temperature=0.8, top_p=0.95)  # seeded by the mode (42)
        sampled = _run(eng, [p], 0, temperature=0.8, top_p=0.95)
        assert sampled == _run(eng, [p], 0, temperature=0.8, top_p=0.95, sampling_seed=42)
        assert sampled != _run(eng, [p], 0, temperature=0.8, top_p=0.95, seed=7)
    finally:
        eng.shutdown()
        chunked.shutdown()


@pytest.mark.slow
def test_the_default_model_is_the_same_in_any_batch():
    """The GGUF default (int4 layers on kernels/cpu_gemv, the int8-blocks head, bf16: the fused C++
    layers serve); the second engine also decodes four steps per call (one C++ call for them)."""
    kw = dict(skip_tokenizer_init=True, cpu_threads=2, max_total_tokens=16384, enable_deterministic_inference=True)
    eng, chunked = core.Engine(**kw), core.Engine(chunked_prefill_size=16, num_continuous_decode_steps=4, **kw)
    try:
        p, *others = _prompts(1, 70, 5, 40, 40000)
        p = p + [11] * (40 - len(p))
        _assert_invariant(eng, chunked, p, others)
    finally:
        eng.shutdown()
        chunked.shutdown()


def test_row_blocks_give_every_call_one_shape():
    """``row_blocked`` calls the function on full blocks only (the last padded) and returns each
    row's own result: an MKL GEMM over 1..70 rows then matches the same rows inside any batch."""
    w = torch.randn(96, 80, generator=torch.Generator().manual_seed(0))
    x = torch.randn(70, 80, generator=torch.Generator().manual_seed(1))
    shapes = set()

    def gemm(rows: torch.Tensor) -> torch.Tensor:
        shapes.add(tuple(rows.shape))
        return torch.nn.functional.linear(rows, w)

    full = row_blocked(gemm, x, 16)
    assert shapes == {(16, 80)} and full.shape == (70, 96)
    for start, m in ((0, 1), (3, 2), (17, 16), (40, 30), (69, 1)):
        assert torch.equal(row_blocked(gemm, x[start : start + m], 16), full[start : start + m])
    torch.testing.assert_close(full, x @ w.T)


def test_what_the_mode_cannot_cover_is_refused(tiny_llama):
    path, _ = tiny_llama()
    for kw, match in (({"speculative_algorithm": "NGRAM"}, "not with speculative decoding"),
                      ({"enable_lora": True}, "not with LoRA adapters"),
                      ({"attention_backend": "torch_native"}, "attention backend TorchNativeBackend has no batch-invariant mode")):
        with pytest.raises(CoreError, match=match):
            make_engine(path, enable_deterministic_inference=True, **kw)
