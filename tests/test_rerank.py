"""SGLang's ``/v1/rerank`` (``core.server.openai.rerank``): a generative reranker's scores are
``P(yes) / (P(yes) + P(no))`` of transformers' next token after the rendered template; a
cross-encoder's are its classification logit on the tokenizer's (query, document) pair; documents
come best first, ``top_n`` of them, without text under ``return_documents: false``; SGLang's
validation errors, and a model that is no reranker, are 400s."""

from __future__ import annotations

from pathlib import Path

import torch
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tests.conftest import build_tiny_llama, char_tokenizer

# A reranker's template in the shape of Qwen3-Reranker's (the system turn asks for yes or no).
TEMPLATE = ('Note that the answer can only be "yes" or "no".\n'
            "I: {{ instruct | default('any') }}\nQ: {{ messages[0]['content'] }}\nD: {{ messages[1]['content'] }}\nA:")
QUERY, DOCS = "where is the cat", ["the cat sat on the mat", "dogs bark", "a cat is on the mat", "sky"]


def _tokenizer():
    tok = char_tokenizer()
    tok.add_tokens(["yes", "no"])
    return tok


def _reranker(tmp_path: Path):
    tok = _tokenizer()
    hf = build_tiny_llama(tmp_path, vocab_size=len(tok) + 6)
    tok.save_pretrained(tmp_path)
    return tok, hf


def _reference(tok, hf, doc: str, instruct: str | None = None) -> float:
    extra = {"instruct": instruct} if instruct else {}
    text = ImmutableSandboxedEnvironment().from_string(TEMPLATE).render(
        messages=[{"role": "user", "content": QUERY}, {"role": "user", "content": doc}], **extra)
    ids = tok.encode(text)
    with torch.inference_mode():
        probs = torch.softmax(hf(torch.tensor([ids])).logits[0, -1].float(), -1)
    yes, no = (tok.encode(w, add_special_tokens=False)[0] for w in ("yes", "no"))
    return float(probs[yes] / (probs[yes] + probs[no]))


def test_a_generative_rerankers_scores_are_its_yes_share(tmp_path):
    from core.server.args import ServerArgs
    from tests.server_utils import serve_in_process

    tok, hf = _reranker(tmp_path)

    async def calls(c):
        full = await c.post("/v1/rerank", json={"query": QUERY, "documents": DOCS})
        top = await c.post("/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2, "return_documents": False,
                                               "instruct": "Find a cat"})
        bad = [await c.post("/v1/rerank", json=body) for body in (
            {"query": " ", "documents": DOCS},
            {"query": QUERY, "documents": []},
            {"query": QUERY, "documents": ["a", ""]},
            {"query": QUERY, "documents": DOCS, "top_n": 0},
            {"query": [{"type": "image_url", "image_url": {"url": "x"}}], "documents": DOCS})]
        return full.json(), top.json(), bad

    full, top, bad = serve_in_process({"model_path": str(tmp_path)}, ServerArgs(chat_template=TEMPLATE), calls)
    want = [_reference(tok, hf, d) for d in DOCS]
    assert [r["index"] for r in full] == sorted(range(len(DOCS)), key=lambda i: -want[i])
    for r in full:
        assert abs(r["score"] - want[r["index"]]) < 1e-5 and r["document"] == DOCS[r["index"]]
    want = [_reference(tok, hf, d, "Find a cat") for d in DOCS]
    assert [r["index"] for r in top] == sorted(range(len(DOCS)), key=lambda i: -want[i])[:2]
    assert all(abs(r["score"] - want[r["index"]]) < 1e-5 and "document" not in r for r in top)
    assert [r.status_code for r in bad] == [400] * 5
    assert [r.json()["error"]["param"] for r in bad] == ["query", "documents", "documents", "top_n", "query"]


def test_a_cross_encoders_scores_are_its_logit_on_the_pair(tmp_path):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from core.server.args import ServerArgs
    from tests.model_utils import build_tiny
    from tests.server_utils import serve_in_process

    tok = char_tokenizer()
    hf = build_tiny(tmp_path, LlamaConfig, LlamaForSequenceClassification, num_labels=1)
    tok.save_pretrained(tmp_path)

    async def calls(c):
        return (await c.post("/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 3})).json()

    got = serve_in_process({"model_path": str(tmp_path), "is_embedding": True}, ServerArgs(), calls)
    with torch.inference_mode():
        want = [float(hf(torch.tensor([tok(QUERY, d)["input_ids"]])).logits[0, 0]) for d in DOCS]
    assert [r["index"] for r in got] == sorted(range(len(DOCS)), key=lambda i: -want[i])[:3]
    assert all(abs(r["score"] - want[r["index"]]) < 1e-4 for r in got)


def test_a_model_that_is_no_reranker_is_a_400(tiny_llama):
    from core.server.args import ServerArgs
    from tests.server_utils import serve_in_process

    async def calls(c):
        return await c.post("/v1/rerank", json={"query": QUERY, "documents": DOCS}), await c.get("/ready")

    r, ready = serve_in_process({"model_path": str(tiny_llama()[0])}, ServerArgs(), calls)
    assert r.status_code == 400 and "not a reranker" in r.json()["error"]["message"]
    assert ready.status_code == 200
