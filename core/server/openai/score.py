"""SGLang's ``/v1/score``: how likely each of some label tokens is to follow ``query + item``, for
every item (ranking and classification with a generative model).

Pointwise scoring as SGLang's: each item is one prompt (``query + item``, or ``item + query``
with ``item_first``; text joined as text, token ids as ids) whose next-token distribution is
read at the label tokens (``token_ids_logprob`` of its one step). A score is the label's
probability, or with ``apply_softmax`` the softmax over the labels' logprobs (at ``temperature``).
SGLang's other forms (embedding overrides, pooled hidden states, a score-extraction token,
multi-item scoring) are refused when set.
"""

from __future__ import annotations

import math
from typing import Any

from msgspec import Struct
from starlette.requests import Request
from starlette.responses import Response

from core.errors import InvalidRequest
from core.server.http import json_response, read_body_ignoring_unknown, state_of


class ScoringRequest(Struct, kw_only=True):
    query: str | list[int] | None = None
    items: str | list | None = None  # texts, or token-id lists (checked in _prompts)
    label_token_ids: list | None = None  # one list for every item, or one per item (checked in _labels)
    apply_softmax: bool = False
    temperature: float = 1.0
    return_token_logprobs: bool = False
    item_first: bool = False
    model: str = "default"
    # SGLang's forms this server lacks: accepted only unset
    embed_override_token_id: int | None = None
    query_embed_overrides: Any = None
    item_embed_overrides: Any = None
    return_pooled_hidden_states: bool = False
    score_extraction_token: str | None = None


_UNSUPPORTED = ("embed_override_token_id", "query_embed_overrides", "item_embed_overrides",
                "return_pooled_hidden_states", "score_extraction_token")


def _bad(message: str, param: str) -> InvalidRequest:
    return InvalidRequest(message, param=param)


def _labels(r: ScoringRequest, n: int, vocab: int) -> list[list[int]]:
    """Each item's label tokens, checked as SGLang checks them."""
    labels = r.label_token_ids
    if not labels:
        raise _bad("label_token_ids is required for generation (CausalLM) models and must be a nonempty list",
                   "label_token_ids")
    per_item = labels if isinstance(labels[0], list) else [labels] * n
    if len(per_item) != n:
        raise _bad("label_token_ids must have one list per item", "label_token_ids")
    for ids in per_item:
        if not ids or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
            raise _bad("each item must have a nonempty list of nonnegative token ids", "label_token_ids")
        if len(set(ids)) != len(ids):
            raise _bad("label_token_ids must not contain duplicate tokens", "label_token_ids")
        if (big := max(ids)) >= vocab:
            raise _bad(f"Token ID {big} is out of vocabulary (vocab size: {vocab})", "label_token_ids")
    return per_item


def _prompts(r: ScoringRequest) -> tuple[list[str] | None, list[list[int]] | None]:
    """(text prompts, token-id prompts): one per item, the query before it (after with item_first)."""
    items = [r.items] if isinstance(r.items, str) else r.items
    texts = isinstance(r.query, str) or (r.query is None and isinstance(items[0], str))
    if texts and all(isinstance(i, str) for i in items):
        q = r.query or ""
        return [f"{i}{q}" if r.item_first else f"{q}{i}" for i in items], None
    ids = lambda x: isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)  # noqa: E731
    if not texts and all(ids(i) and i for i in items):
        q = r.query or []
        return None, [[*i, *q] if r.item_first else [*q, *i] for i in items]
    raise _bad("query and items must both be text or both be token ids", "items")


def _scores(lps: list[float], apply_softmax: bool, temperature: float) -> list[float]:
    if apply_softmax:
        top = max(lps)
        weights = [math.exp((lp - top) / temperature) for lp in lps]
        total = sum(weights)
        return [w / total for w in weights]
    return [math.exp(lp) for lp in lps]


async def score(request: Request) -> Response:
    state = state_of(request)
    r = await read_body_ignoring_unknown(request, ScoringRequest, "score.field_ignored")  # (as SGLang: ignored, logged)
    for name in _UNSUPPORTED:
        if getattr(r, name) not in (None, False):
            raise _bad(f"{name} is not supported by this server", name)
    if not math.isfinite(r.temperature) or r.temperature <= 0:
        raise _bad("temperature must be finite and greater than zero", "temperature")
    if r.temperature != 1.0 and not r.apply_softmax:
        raise _bad("temperature requires apply_softmax=True", "temperature")
    if r.items is None:
        raise _bad("items must be provided", "items")
    empty = {"scores": [], "pooled_hidden_states": None, "token_logprobs": [] if r.return_token_logprobs else None,
             "model": r.model, "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
             "object": "scoring"}
    if not r.items:
        return json_response(empty)
    engine = state.engine
    n = 1 if isinstance(r.items, str) else len(r.items)
    labels = _labels(r, n, engine.vocab_size)
    texts, ids = _prompts(r)
    outs = await engine.generate(texts, [{"max_new_tokens": 1, "temperature": 0.0}] * n, ids, return_logprob=True,
                                 token_ids_logprob=labels)
    lps = [[lp for lp, _, _ in out["meta_info"]["output_token_ids_logprobs"][0]] for out in outs]
    prompt_tokens = sum(out["meta_info"]["prompt_tokens"] for out in outs)
    return json_response({**empty, "scores": [_scores(lp, r.apply_softmax, r.temperature) for lp in lps],
                          "token_logprobs": lps if r.return_token_logprobs else None,
                          "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 0,
                                    "total_tokens": prompt_tokens}})
