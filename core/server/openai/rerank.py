"""SGLang's ``/v1/rerank``: the documents ordered by their relevance to a query.

Two kinds of reranker, told apart as SGLang tells them:

* **A generative reranker** (Qwen3-Reranker): the server's chat template (``--chat-template``, or
  the tokenizer's) asks for a yes / no answer. Each document is rendered with it (``messages``:
  the query, then the document, both user turns; ``instruct`` passed when set) and scores
  ``P(yes) / (P(yes) + P(no))`` at the next token.
* **A cross-encoder**: a sequence-classification model with one label served with
  ``--is-embedding``. Each (query, document) pair is tokenized as the tokenizer pairs two texts,
  and scores the label's logit, through ``config.json``'s ``sbert_ce_default_activation_function``
  where it names ``torch.nn.modules.activation.Sigmoid`` (sentence-transformers' convention; else
  the logit as it is, as SGLang).

The answer is SGLang's: a JSON list of ``{"score", "document", "index"}``, best first (the
``top_n`` best with ``top_n``), ``document`` left out with ``return_documents: false``. Anything
else, multimodal content included, is a 400 naming the problem.
"""

from __future__ import annotations

import math
from typing import Any

from msgspec import Struct
from starlette.requests import Request
from starlette.responses import Response

from core.errors import CoreError, InvalidRequest
from core.server.http import ApiError, json_response, read_body_ignoring_unknown, state_of


class RerankRequest(Struct, kw_only=True):
    query: Any = None
    documents: Any = None
    instruct: str | None = None
    top_n: int | None = None
    return_documents: bool = True


def _texts(r: RerankRequest) -> tuple[str, list[str]]:
    if isinstance(r.query, list) or (isinstance(r.documents, list) and any(isinstance(d, list) for d in r.documents)):
        raise InvalidRequest("multimodal rerank content is not supported by this server; send text", param="query")
    if not isinstance(r.query, str) or not r.query.strip():
        raise InvalidRequest("Query cannot be empty or whitespace only", param="query")
    if not isinstance(r.documents, list) or not r.documents:
        raise InvalidRequest("Documents cannot be empty", param="documents")
    if any(not isinstance(d, str) or not d.strip() for d in r.documents):
        raise InvalidRequest("Each document must be a non-empty string", param="documents")
    if r.top_n is not None and r.top_n < 1:
        raise InvalidRequest("Value error, parameter top_n should be larger than 0.", param="top_n")
    return r.query, r.documents


def _template(state: Any) -> str | None:
    """The chat template the server renders with, where it is a reranker's (else None)."""
    from core.server.openai.chat import load_chat_template

    if state.args.chat_template:
        try:
            text = load_chat_template(state.args.chat_template)
        except CoreError as e:
            raise ApiError(500, str(e)) from None
    else:
        text = getattr(state.engine.tokenizer, "chat_template", None)
    if not isinstance(text, str):
        return None
    low = text.lower()  # (what marks a reranker's template, as SGLang reads it: 'answer can only be "yes" or "no"')
    return text if "answer can only be" in low and '"yes"' in low and '"no"' in low else None


def _yes_no(tok: Any) -> list[int]:
    """The ids of the single tokens "yes" and "no" (a 400 where the tokenizer has none)."""
    ids = [tok.encode(w, add_special_tokens=False) for w in ("yes", "no")]
    if any(len(i) != 1 for i in ids):
        raise InvalidRequest("the tokenizer has no single 'yes' and 'no' tokens for a yes/no reranker")
    return [ids[0][0], ids[1][0]]


async def _generative(state: Any, template: str, query: str, docs: list[str], instruct: str | None) -> list[float]:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(autoescape=False)
    try:
        compiled = env.from_string(template)
        extra = {"instruct": instruct} if instruct else {}  # (the template's default(...) needs it undefined)
        prompts = [compiled.render(messages=[{"role": "user", "content": query}, {"role": "user", "content": d}],
                                   **extra) for d in docs]
    except Exception as e:  # jinja2's errors
        raise InvalidRequest(f"the reranker's chat template could not render the request: {e}") from None
    labels = _yes_no(state.engine.tokenizer)
    outs = await state.engine.generate(prompts, [{"max_new_tokens": 1, "temperature": 0.0}] * len(prompts),
                                       return_logprob=True, token_ids_logprob=[labels] * len(prompts))
    scores = []
    for out in outs:
        p_yes, p_no = (math.exp(lp) for lp, _, _ in out["meta_info"]["output_token_ids_logprobs"][0])
        scores.append(p_yes / (p_yes + p_no) if p_yes + p_no > 0 else 0.0)
    return scores


async def _cross_encoder(state: Any, query: str, docs: list[str]) -> list[float]:
    engine = state.engine
    cfg = engine.model_config.hf_config
    if getattr(cfg, "num_labels", 1) != 1:
        raise InvalidRequest(f"the served classifier has {cfg.num_labels} labels; a cross-encoder reranker has one")
    tok = engine.tokenizer
    ids = [tok(query, d)["input_ids"] for d in docs]
    scores = [e[0] for e in await engine.encode([state.fit_prompt(i, engine.model_config.context_len) for i in ids])]
    if str(getattr(cfg, "sbert_ce_default_activation_function", "")).endswith(".Sigmoid"):
        scores = [1.0 / (1.0 + math.exp(-s)) for s in scores]
    return scores


async def rerank(request: Request) -> Response:
    state = state_of(request)
    r = await read_body_ignoring_unknown(request, RerankRequest, "rerank.field_ignored")
    query, docs = _texts(r)
    engine = state.engine
    if engine.tokenizer is None:
        raise InvalidRequest("/v1/rerank needs the tokenizer (the server runs with --skip-tokenizer-init)")
    if engine.args.is_embedding and engine.is_classifier:
        scores = await _cross_encoder(state, query, docs)
    elif not engine.args.is_embedding and (template := _template(state)) is not None:
        scores = await _generative(state, template, query, docs, r.instruct)
    else:
        raise InvalidRequest("the served model is not a reranker: serve a generative reranker (Qwen3-Reranker) with "
                             "its yes/no chat template (--chat-template), or a one-label sequence-classification "
                             "model (a cross-encoder) with --is-embedding")
    ranked = sorted(range(len(docs)), key=lambda i: -scores[i])[: r.top_n]
    body = [{"score": scores[i], **({"document": docs[i]} if r.return_documents else {}), "index": i} for i in ranked]
    return json_response(body)
