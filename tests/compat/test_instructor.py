"""instructor (``instructor.from_openai``) against a live ``core serve`` in the modes a user picks
for an OpenAI-compatible server: TOOLS (a forced tool call), JSON (response_format json_object,
the schema in the prompt) and JSON_SCHEMA (response_format json_schema); for each, ``create``,
``create_partial`` (streamed partial objects) and ``create_iterable`` with a small pydantic model.
``max_retries=0``: a reply that does not validate fails the test instead of being re-asked."""

from __future__ import annotations

import pytest

from tests.compat.conftest import MODEL, client

pytestmark = pytest.mark.slow

MODES = ["TOOLS", "JSON", "JSON_SCHEMA"]
# One worked example: JSON mode leaves the format to the prompt, and without an example a 135M model
# tends to echo the JSON schema instructor puts in the system message rather than an instance of it.
EXAMPLE = [{"role": "user", "content": "Name a city in Japan."},
           {"role": "assistant", "content": '{"name": "Tokyo", "country": "Japan"}'}]
ONE = EXAMPLE + [{"role": "user", "content": "Name a city in France."}]
TWO = EXAMPLE + [{"role": "user", "content": "Name two cities in France."}]


@pytest.fixture(scope="module")
def City():
    pydantic = client("pydantic")

    class City(pydantic.BaseModel):
        name: str
        country: str

    return City


@pytest.fixture(scope="module", params=MODES)
def inst(request, compat_server):
    instructor, openai = client("instructor"), client("openai")
    oai = openai.OpenAI(base_url=compat_server + "/v1", api_key="none", max_retries=0, timeout=120)
    return instructor.from_openai(oai, mode=getattr(instructor.Mode, request.param))


KW = dict(model=MODEL, temperature=0, max_tokens=100, max_retries=0)


def test_create(inst, City):
    city, completion = inst.chat.completions.create_with_completion(response_model=City, messages=ONE, **KW)
    assert isinstance(city, City) and city.name and city.country
    assert completion.choices[0].finish_reason in ("stop", "tool_calls")


def test_create_partial(inst, City):
    parts = list(inst.chat.completions.create_partial(response_model=City, messages=ONE, **KW))
    assert len(parts) > 1, parts  # streamed: partial objects as the JSON grows
    assert parts[0].name is None or len(parts[0].name) <= len(parts[-1].name)
    final = parts[-1]
    assert final.name and final.country, final
    City.model_validate(final.model_dump())


def test_create_iterable(inst, City):
    cities = list(inst.chat.completions.create_iterable(response_model=City, messages=TWO, **KW))
    assert cities and all(isinstance(c, City) and c.name and c.country for c in cities), cities
