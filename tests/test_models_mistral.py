"""Mistral: sliding-window attention on every layer, prompts and generations past the window."""

from __future__ import annotations

import pytest

from tests.model_utils import build_tiny, check_against_transformers, prompt


@pytest.mark.parametrize("overrides", [{"sliding_window": 8}, {"sliding_window": 16, "num_key_value_heads": 1, "head_dim": 32}],
                         ids=["window8", "window16_mqa_head_dim"])
def test_matches_transformers(overrides, tmp_path, engine_factory):
    from transformers import MistralConfig, MistralForCausalLM

    hf = build_tiny(tmp_path, MistralConfig, MistralForCausalLM, **overrides)
    eng = engine_factory(tmp_path, skip_tokenizer_init=True, max_total_tokens=512, page_size=4)
    assert all(l.self_attn.attn.spec.sliding_window == overrides["sliding_window"] for l in eng.engine.model.model.layers)
    check_against_transformers(eng, hf, [prompt(3, 1), prompt(40, 2), prompt(17, 3)], n=12)


def test_window_matters(tmp_path, engine_factory):
    """Ignoring the window gives different logprobs past it: the comparison above has teeth."""
    from transformers import MistralConfig, MistralForCausalLM

    from tests.conftest import greedy, hf_logprobs
    import torch

    hf = build_tiny(tmp_path, MistralConfig, MistralForCausalLM, sliding_window=4)
    eng = engine_factory(tmp_path, skip_tokenizer_init=True, max_total_tokens=256)
    for layer in eng.engine.model.model.layers:
        import attrs

        layer.self_attn.attn.spec = attrs.evolve(layer.self_attn.attn.spec, sliding_window=None)
    p = prompt(20, 5)
    out = eng.generate(input_ids=p, sampling_params=greedy(1), return_logprob=True, logprob_start_len=0)
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]])
    want = hf_logprobs(hf, p)[torch.arange(19), torch.tensor(p[1:])]
    assert (got[:4] - want[:4]).abs().max() < 1e-4  # within the window: identical
    assert (got[8:] - want[8:]).abs().max() > 1e-2
