"""Qwen2 (q/k/v bias, optional sliding layers) and Qwen3 (q/k norm) against transformers."""

from __future__ import annotations

import pytest

from tests.model_utils import build_tiny, check_against_transformers, prompt

CASES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    # sliding window 8 on layers >= 1 (max_window_layers), prompts well past it
    "qwen2_sliding": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    "qwen2_tied_mqa": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    "qwen3_yarn": ("Qwen3Config", "Qwen3ForCausalLM", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0,
                                                                            "factor": 4.0, "original_max_position_embeddings": 64}}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers(case, tmp_path, engine_factory):
    import transformers

    cfg, cls, overrides = CASES[case]
    hf = build_tiny(tmp_path, getattr(transformers, cfg), getattr(transformers, cls), **overrides)
    eng = engine_factory(tmp_path, skip_tokenizer_init=True, max_total_tokens=512)
    check_against_transformers(eng, hf, [prompt(3, 1), prompt(30, 2), prompt(17, 3)])
