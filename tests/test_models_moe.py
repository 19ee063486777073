"""Qwen2-MoE: top-k routing (with and without renormalisation), shared expert, dense
layers from ``mlp_only_layers``; per-expert checkpoint tensors loaded into fused weights."""

from __future__ import annotations

import pytest

from tests.model_utils import build_tiny, check_against_transformers, prompt

MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=6, num_experts_per_tok=2)


@pytest.mark.parametrize("overrides", [{"norm_topk_prob": False}, {"norm_topk_prob": True, "mlp_only_layers": [1]},
                                       {"num_experts_per_tok": 3, "decoder_sparse_step": 2}],
                         ids=["plain", "renorm_dense_layer", "top3_sparse_step"])
def test_matches_transformers(overrides, tmp_path, engine_factory):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    hf = build_tiny(tmp_path, Qwen2MoeConfig, Qwen2MoeForCausalLM, **{**MOE, **overrides})
    eng = engine_factory(tmp_path, skip_tokenizer_init=True, max_total_tokens=512)
    check_against_transformers(eng, hf, [prompt(3, 1), prompt(30, 2), prompt(17, 3)])
