"""SGLang's ``token_ids_logprob``: with ``return_logprob``, the logprobs of the tokens asked for at
every prompt position ``logprob_start_len`` covers and every output position
(``input_token_ids_logprobs`` / ``output_token_ids_logprobs``), checked against transformers;
offline (one list, or a list per prompt), on /generate with the tokens' text, and bad ids refused."""

from __future__ import annotations

import pytest
import torch

from core.errors import InvalidRequest
from tests.conftest import assert_pool_free, make_engine
from tests.model_utils import prompt

ASKED = [3, 17, 40]


def _reference(hf, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of ``ids`` (the next token's distribution)."""
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_the_asked_tokens_logprobs_match_transformers(tiny_llama, overlap):
    path, hf = tiny_llama()
    eng = make_engine(path, enable_overlap_schedule=overlap, disable_overlap_schedule=not overlap)
    try:
        ps = [prompt(7, seed=1), prompt(9, seed=2), prompt(6, seed=3)]
        greedy = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
        outs = eng.generate(input_ids=ps, sampling_params=greedy, return_logprob=True, logprob_start_len=[0, 2, -1],
                            top_logprobs_num=2, token_ids_logprob=[ASKED, [5], []])
        for p, out, start, asked in zip(ps, outs, [0, 2, -1], [ASKED, [5], []]):
            meta = out["meta_info"]
            if not asked:
                assert "output_token_ids_logprobs" not in meta and "input_token_ids_logprobs" not in meta
                continue
            ref = _reference(hf, p + out["output_ids"])
            got_out = meta["output_token_ids_logprobs"]
            assert len(got_out) == len(out["output_ids"])
            for k, pos in enumerate(got_out):  # the k-th output token's distribution: after p + k outputs
                assert [t for _, t, _ in pos] == asked
                want = ref[len(p) - 1 + k, asked]
                assert torch.allclose(torch.tensor([lp for lp, _, _ in pos]), want, atol=1e-4), (k, pos, want)
            got_in = meta["input_token_ids_logprobs"]
            assert len(got_in) == len(p) - start
            if start == 0:
                assert got_in[0] is None  # the first prompt token has no distribution, as its logprob
            for j, pos in enumerate(got_in[1 if start == 0 else 0:], start=max(start, 1)):
                want = ref[j - 1, asked]
                assert torch.allclose(torch.tensor([lp for lp, _, _ in pos]), want, atol=1e-4), (j, pos)
        one = eng.generate(input_ids=ps[0], sampling_params=greedy, return_logprob=True, token_ids_logprob=17)
        assert [[t for _, t, _ in pos] for pos in one["meta_info"]["output_token_ids_logprobs"]] == [[17]] * 5
        for bad, words in ((["x"], "must be a list of token ids"), ([10**6], "out-of-vocabulary token id 1000000")):
            with pytest.raises(InvalidRequest, match=words):
                eng.generate(input_ids=ps[0], sampling_params=greedy, return_logprob=True, token_ids_logprob=bad)
        assert_pool_free(eng)
    finally:
        eng.shutdown()


def test_generate_returns_them_with_text(tiny_llama):
    from core.server.args import ServerArgs
    from tests.server_utils import serve_in_process

    path, _ = tiny_llama()
    ids = prompt(6, seed=4)

    async def calls(c):
        body = {"input_ids": [ids, ids], "return_logprob": True, "return_text_in_logprobs": True,
                "token_ids_logprob": [ASKED, [7]], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
        r = await c.post("/generate", json=body)
        bad = await c.post("/generate", json={**body, "token_ids_logprob": [ASKED]})
        return r.status_code, r.json(), bad

    status, outs, bad = serve_in_process({"model_path": str(path)}, ServerArgs(), calls)
    assert status == 200
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    pos = outs[0]["meta_info"]["output_token_ids_logprobs"]
    assert len(pos) == 3 and [[t, text] for _, t, text in pos[0]] == [[t, tok.decode([t])] for t in ASKED]
    assert [t for _, t, _ in outs[1]["meta_info"]["output_token_ids_logprobs"][0]] == [7]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "token_ids_logprob"
