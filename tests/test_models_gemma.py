"""Gemma 2 (attention and final logit soft-capping, sliding/global layers) and Gemma 3 text
(q/k norms, per-layer-type rotary base) against transformers, prompts longer than the window."""

from __future__ import annotations

import pytest

from tests.model_utils import build_tiny, check_against_transformers, prompt

GEMMA = {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8, "hidden_activation": "gelu_pytorch_tanh"}
CASES = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {**GEMMA, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0,
                                                      "num_hidden_layers": 3}),
    "gemma2_untied": ("Gemma2Config", "Gemma2ForCausalLM", {**GEMMA, "tie_word_embeddings": False}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {**GEMMA, "num_hidden_layers": 3, "sliding_window_pattern": 2,
                                                         "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                                                                             "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers(case, tmp_path, engine_factory):
    import transformers

    cfg, cls, overrides = CASES[case]
    hf = build_tiny(tmp_path, getattr(transformers, cfg), getattr(transformers, cls), **overrides)
    assert "sliding_attention" in hf.config.layer_types and "full_attention" in hf.config.layer_types
    eng = engine_factory(tmp_path, skip_tokenizer_init=True, max_total_tokens=512)
    check_against_transformers(eng, hf, [prompt(3, 1), prompt(30, 2), prompt(17, 3)], n=8)
