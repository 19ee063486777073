"""SGLang's ``/v1/score`` (``core.server.openai.score``): each item's label-token probabilities
after ``query + item`` equal transformers' next-token distribution there (softmax over the labels
with ``apply_softmax``, at a temperature); token-id and text forms, ``item_first``, and SGLang's
validation errors."""

from __future__ import annotations

import math

import torch

LABELS = [5, 9, 40]


def test_scores_are_the_next_token_probabilities_of_the_labels(tiny_llama):
    from core.server.args import ServerArgs
    from tests.server_utils import serve_in_process

    path, hf = tiny_llama()
    query, items = [11, 12, 13, 14], [[20, 21], [30], [22, 23, 24]]

    async def calls(c):
        plain = await c.post("/v1/score", json={"query": query, "items": items, "label_token_ids": LABELS,
                                                "return_token_logprobs": True})
        soft = await c.post("/v1/score", json={"query": query, "items": items, "label_token_ids": LABELS,
                                               "apply_softmax": True, "temperature": 0.5, "item_first": True})
        text = await c.post("/v1/score", json={"query": "ab", "items": ["c", "de"], "label_token_ids": [[5], [6, 7]]})
        bad = [await c.post("/v1/score", json=body) for body in (
            {"query": query, "items": items},
            {"query": query, "items": items, "label_token_ids": [5, 5]},
            {"query": query, "items": items, "label_token_ids": LABELS, "temperature": 0.5},
            {"query": "ab", "items": [[1]], "label_token_ids": LABELS},
            {"query": query, "items": items, "label_token_ids": [10**7]},
            {"query": query, "items": items, "label_token_ids": LABELS, "score_extraction_token": "x"})]
        empty = await c.post("/v1/score", json={"query": query, "items": [], "label_token_ids": LABELS})
        return plain.json(), soft.json(), text.json(), bad, empty.json()

    plain, soft, text, bad, empty = serve_in_process({"model_path": str(path)}, ServerArgs(), calls)

    def ref(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), -1)

    for item, scores, lps in zip(items, plain["scores"], plain["token_logprobs"]):
        want = ref(query + item)[LABELS]
        assert torch.allclose(torch.tensor(lps), want, atol=1e-4) and torch.allclose(
            torch.tensor(scores), want.exp(), atol=1e-5)
    for item, scores in zip(items, soft["scores"]):
        want = torch.softmax(ref(item + query)[LABELS] / 0.5, -1)
        assert torch.allclose(torch.tensor(scores), want, atol=1e-4) and math.isclose(sum(scores), 1, abs_tol=1e-6)
    assert plain["object"] == "scoring" and plain["usage"]["prompt_tokens"] == sum(len(query) + len(i) for i in items)
    assert soft["token_logprobs"] is None and [len(s) for s in text["scores"]] == [1, 2]
    assert [r.status_code for r in bad] == [400] * 6
    assert [r.json()["error"]["param"] for r in bad] == ["label_token_ids", "label_token_ids", "temperature", "items",
                                                         "label_token_ids", "score_extraction_token"]
    assert empty["scores"] == []
