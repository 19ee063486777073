"""``--enable-fp32-lm-head`` (SGLang's flag): logits accumulate into float32 and are not rounded to
the activations' bf16, through the engine's own model and its logprobs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from core.engine.model_loader.model_build import Float32Head
from core.layers import VocabEmbedding
from tests.conftest import greedy, make_engine


def _head(model) -> VocabEmbedding:
    return model.model.embed_tokens if model.tied else model.lm_head


@pytest.mark.parametrize("tied", [True, False])
def test_the_heads_logits_are_the_float32_product(tiny_llama, tied):
    """The loaded model's logits equal the float32 product of the bf16 hidden state and table (no
    packed head, no rounding); without the flag they are that product rounded to bf16."""
    path, _ = tiny_llama("gqa", tie_word_embeddings=tied)
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    exact = {}
    for flag in (False, True):
        eng = make_engine(path, dtype="bfloat16", enable_fp32_lm_head=flag)
        try:
            model = eng.engine.model
            head = _head(model)
            assert isinstance(head.head(), Float32Head) is flag
            exact[flag] = F.linear(hidden.float(), head.weight.detach().float())
            got = model.compute_logits(hidden)
            assert got.dtype == torch.float32
            if flag:
                assert torch.equal(got, exact[flag])
            else:
                assert torch.equal(got, got.bfloat16().float())  # rounded to bf16 on the way
                assert (got - exact[flag]).abs().max() <= exact[flag].abs().max() / 128
        finally:
            eng.shutdown()
    assert not torch.equal(exact[True], exact[True].bfloat16().float())  # the flag's logits carry more bits


def test_served_logprobs_come_from_the_float32_logits(tiny_llama):
    """A greedy request's logprobs under the flag are log-softmaxes of unrounded float32 logits:
    the chosen token's logprob equals the reference over the model's own hidden state."""
    path, _ = tiny_llama()
    eng = make_engine(path, dtype="bfloat16", enable_fp32_lm_head=True, enable_return_hidden_states=True)
    try:
        out = eng.generate(input_ids=[5, 9, 14, 20], sampling_params=greedy(2), return_logprob=True,
                           return_hidden_states=True)
        meta = out["meta_info"]
        model = eng.engine.model
        hidden = torch.tensor(meta["hidden_states"][-1], dtype=torch.float32).reshape(-1, 64)[-1:]
        ref = torch.log_softmax(F.linear(hidden.bfloat16().float(), _head(model).weight.detach().float()), -1)[0]
        lp, tok = meta["output_token_logprobs"][-1][:2]
        assert tok == int(ref.argmax()) and math.isclose(lp, float(ref[tok]), abs_tol=1e-5)
    finally:
        eng.shutdown()
