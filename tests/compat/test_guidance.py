"""guidance's remote models for OpenAI-compatible servers against a live ``core serve``:
``guidance.models.experimental.SglangModel`` (regex through SGLang's ``regex`` field, ``select``
and other grammars as an llguidance Lark grammar in ``ebnf``, JSON through ``response_format``),
``guidance.models.experimental.VLLMModel`` (every constraint as a Lark grammar in vLLM's
``structured_outputs.grammar`` / ``guided_grammar``) and ``guidance.models.OpenAI`` (plain ``gen``
and JSON through ``response_format``). Lark grammars need ``--grammar-backend llguidance``.

guidance always streams with ``logprobs=True, top_logprobs=5`` and computes ``e ** logprob`` for the
token and every alternative: a ``null`` logprob (e.g. a token masked by the grammar) crashes it."""

from __future__ import annotations

import json
import re

import pytest

from tests.compat.conftest import MODEL, client

pytestmark = pytest.mark.slow

NUMBER = r"[0-9]{1,3}"
CITY_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                "country": {"type": "string", "maxLength": 20}},
               "required": ["name", "country"], "additionalProperties": False}
# (model class, grammar backend) pairs a user can run; VLLMModel sends Lark grammars only
SERVER_MODELS = [("SglangModel", "xgrammar"), ("SglangModel", "llguidance"), ("VLLMModel", "llguidance")]
LARK_MODELS = [m for m in SERVER_MODELS if m[1] == "llguidance"]
JSON_MODELS = SERVER_MODELS + [("OpenAI", "xgrammar")]


def _ids(pairs):  # without "sglang": `-k 'not sglang'` (deselecting the SGLang frontend/router modules) keeps these
    return [f"{cls.replace('Sglang', 'SGL')}-{backend}" for cls, backend in pairs]


@pytest.fixture(scope="module")
def guidance():
    return client("guidance")


def _url(request, backend: str) -> str:
    return request.getfixturevalue({"xgrammar": "compat_server", "llguidance": "llguidance_server"}[backend])


def _model(guidance, cls: str, url: str):
    if cls == "OpenAI":
        return guidance.models.OpenAI(MODEL, base_url=url + "/v1", api_key="none", echo=False)
    return getattr(guidance.models.experimental, cls)(MODEL, base_url=url + "/v1", api_key="none", echo=False)


def _ask(guidance, lm, question: str, answer):
    with guidance.user():
        lm += question
    with guidance.assistant():
        lm += answer
    return lm


@pytest.mark.parametrize("cls,backend", SERVER_MODELS, ids=_ids(SERVER_MODELS))
def test_gen_regex(request, guidance, cls, backend):
    lm = _model(guidance, cls, _url(request, backend))
    lm = _ask(guidance, lm, "What is 2+2? Reply with a number.",
              guidance.gen("n", regex=NUMBER, max_tokens=5, temperature=0))
    assert re.fullmatch(NUMBER, lm["n"]), lm["n"]


@pytest.mark.parametrize("cls,backend", LARK_MODELS, ids=_ids(LARK_MODELS))
def test_select(request, guidance, cls, backend):
    lm = _model(guidance, cls, _url(request, backend))
    lm = _ask(guidance, lm, "Is Paris in France?", guidance.select(["yes", "no"], name="a"))
    assert lm["a"] in ("yes", "no"), lm["a"]


@pytest.mark.parametrize("cls,backend", JSON_MODELS, ids=_ids(JSON_MODELS))
def test_json(request, guidance, cls, backend):
    lm = _model(guidance, cls, _url(request, backend))
    lm = _ask(guidance, lm, "Name a city and its country, as JSON.",
              guidance.json("c", schema=CITY_SCHEMA, max_tokens=200, temperature=0))  # (room for the schema's 2 x 20
    # characters at up to 4 tokens each: a greedy path of emoji, seen once in CI, ran out at 60)
    client("jsonschema").validate(json.loads(lm["c"]), CITY_SCHEMA)


def test_openai_gen(compat_server, guidance):
    lm = _ask(guidance, _model(guidance, "OpenAI", compat_server), "Say hello.", guidance.gen("g", max_tokens=5, temperature=0))
    assert isinstance(lm["g"], str) and lm["g"]
