"""Helpers for the per-architecture tests: build a tiny random transformers model from a
config class, save it, serve it in the engine, and compare with transformers."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from tests.conftest import TINY_BASE, assert_greedy_matches, assert_pool_free, greedy, hf_logprobs

ATOL = 1e-4


def prompt(length: int, seed: int, vocab: int = 256) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, vocab) for _ in range(length - 1)]


def build_tiny(path: Path, config_cls, model_cls, seed: int = 0, **overrides: Any):
    """Save a random ``model_cls(config_cls(TINY_BASE + overrides))`` to ``path``; return the HF model (fp32, eval).

    The reference runs transformers' eager attention, the plain definition: transformers 5.17
    (the GPU machine's) let Gemma 2 take SDPA, which drops attention soft-capping."""
    config = config_cls(**{**TINY_BASE, **overrides}, attn_implementation="eager")
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    model.save_pretrained(path)
    return model


def check_against_transformers(eng, hf, prompts: list[list[int]], n: int = 6, atol: float = ATOL) -> None:
    """Prompt + decode logprobs (teacher-forced over the engine's own greedy tokens) and
    greedy tokens match transformers, for ``prompts`` batched together."""
    outs = eng.generate(input_ids=prompts, sampling_params=greedy(n), return_logprob=True, logprob_start_len=0)
    for p, out in zip(prompts, outs):
        ref = hf_logprobs(hf, p + out["output_ids"])
        L = len(p)
        meta = out["meta_info"]
        got = torch.tensor([lp for lp, _, _ in meta["input_token_logprobs"][1:]])
        want = ref[torch.arange(L - 1), torch.tensor(p[1:])]
        torch.testing.assert_close(got, want, atol=atol, rtol=0)
        got = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])
        want = ref[torch.arange(L - 1, L - 1 + n), torch.tensor(out["output_ids"])]
        torch.testing.assert_close(got, want, atol=atol, rtol=0)
        assert_greedy_matches(hf, p, out["output_ids"], n)
    assert_pool_free(eng)
