"""Outlines 1.x's server models over an ``openai.OpenAI`` client against a live ``core serve``:
``outlines.from_sglang`` (SGLang's ``regex`` / ``response_format`` fields), ``outlines.from_vllm``
(vLLM's ``structured_outputs`` field in ``extra_body``) and ``outlines.from_openai``
(``response_format`` json_schema), with a ``Literal`` choice, a regex and a pydantic JSON type;
each on both grammar backends (``--grammar-backend xgrammar``, the default, and ``llguidance``).
The output must obey the constraint: a server that ignores the field fails here."""

from __future__ import annotations

import re
from typing import Literal

import pytest

from tests.compat.conftest import MODEL, client

pytestmark = pytest.mark.slow

PHONE = r"[0-9]{3}-[0-9]{4}"
PROMPT = "Is Paris in France? Answer, then give a phone number, then name a city and its country."


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def backend_url(request):
    return request.getfixturevalue({"xgrammar": "compat_server", "llguidance": "llguidance_server"}[request.param])


def _openai_client(url):
    openai = client("openai")
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.parametrize("kind", ["choice", "regex", "json"])
# ids without "sglang": `-k 'not sglang'` (deselecting the SGLang frontend/router modules) keeps these
@pytest.mark.parametrize("flavor", ["from_sglang", "from_vllm"], ids=["sgl-api", "vllm-api"])
def test_structured(backend_url, City, flavor, kind):
    outlines = client("outlines")
    model = getattr(outlines, flavor)(_openai_client(backend_url), MODEL)
    output_type = {"choice": Literal["yes", "no"], "regex": outlines.types.Regex(PHONE), "json": City}[kind]
    out = model(PROMPT, output_type, max_tokens=60, temperature=0)
    if kind == "choice":
        assert out in ("yes", "no"), out
    elif kind == "regex":
        assert re.fullmatch(PHONE, out), out
    else:
        City.model_validate_json(out)


def test_from_openai_json(backend_url, City):
    outlines = client("outlines")
    model = outlines.from_openai(_openai_client(backend_url), MODEL)
    City.model_validate_json(model("Name a city and its country, as JSON.", City, max_tokens=60, temperature=0))
