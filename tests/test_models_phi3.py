"""Phi-3: fused qkv_proj / gate_up_proj checkpoint tensors, optional sliding window."""

from __future__ import annotations

import pytest

from tests.model_utils import build_tiny, check_against_transformers, prompt


@pytest.mark.parametrize("overrides", [{}, {"sliding_window": 8, "partial_rotary_factor": 0.5}], ids=["plain", "window_partial_rope"])
def test_matches_transformers(overrides, tmp_path, engine_factory):
    from transformers import Phi3Config, Phi3ForCausalLM

    hf = build_tiny(tmp_path, Phi3Config, Phi3ForCausalLM, **overrides)
    eng = engine_factory(tmp_path, skip_tokenizer_init=True, max_total_tokens=512)
    check_against_transformers(eng, hf, [prompt(3, 1), prompt(30, 2), prompt(17, 3)])
