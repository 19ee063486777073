"""The compatibility suite: real clients (SGLang's frontend language, sglang-router, openai,
litellm, langchain-openai, instructor, outlines, guidance, lm-eval) against a live ``core serve``.

The clients come from the ``compat`` extra plus ``pip install --no-deps sglang`` (the README's
test command installs both). ``client(name)`` imports one: where it is missing the test is
skipped with the install command, except under CI (``CI`` set), where a missing client fails,
so a broken install step can never pass as green.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from typing import Any, Iterator

import pytest

from tests.server_utils import start_server

INSTALL_HINT = "pip install --no-deps sglang==0.5.23 && pip install -e '.[test,compat]'"


def client(module: str) -> Any:
    """Import a client module, or skip (fail under CI) naming the install command."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if os.environ.get("CI"):
            pytest.fail(f"compat client {module} is not installed under CI ({e}); run: {INSTALL_HINT}")
        pytest.skip(f"compat client {module} is not installed ({e}); run: {INSTALL_HINT}")


def sglang_frontend() -> Any:
    """``import sglang`` without its server's dependencies: ``sglang/__init__`` imports from the
    ``sglang.srt.utils`` package, whose own ``__init__`` needs zmq and the rest of the server.
    Registering that package empty first (its submodules still load from its folder) sidesteps
    it; the frontend language needs none of the server."""
    if "sglang.srt.utils" not in sys.modules:
        spec = importlib.util.find_spec("sglang")
        if spec is not None and spec.submodule_search_locations:
            stub = types.ModuleType("sglang.srt.utils")
            stub.__path__ = [os.path.join(spec.submodule_search_locations[0], "srt", "utils")]
            sys.modules["sglang.srt.utils"] = stub
    return client("sglang")


# ---------------------------------------------------------------------------- the shared servers
MODEL = "SmolLM2-135M-Instruct"  # the default model's served name
# SmolLM2's template has no tool format: with qwen25's parser, calls come in the Hermes
# <tool_call> format the grammar of tool_choice required / named holds the model to
COMPAT_FLAGS = ("--tool-call-parser", "qwen25")


@pytest.fixture(scope="session")
def compat_server() -> Iterator[str]:
    """The default model and grammar backend (xgrammar), ``--tool-call-parser qwen25``: one for
    every client module of the session."""
    with start_server(*COMPAT_FLAGS) as url:
        yield url


@pytest.fixture(scope="session")
def llguidance_server() -> Iterator[str]:
    """As ``compat_server`` with ``--grammar-backend llguidance``."""
    with start_server(*COMPAT_FLAGS, "--grammar-backend", "llguidance") as url:
        yield url


# ---------------------------------------------------------------------------- shared test data
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]
CITY_SCHEMA = {"type": "object",
               "properties": {"name": {"type": "string", "maxLength": 20},
                              "country": {"type": "string", "enum": ["France", "Japan", "Peru"]}},
               "required": ["name", "country"], "additionalProperties": False}
CITY_Q = [{"role": "user", "content": "Name a city and its country, as JSON."}]


@pytest.fixture(scope="session")
def City() -> type:
    """A small pydantic model the structured-output clients fill in."""
    pydantic = client("pydantic")

    class City(pydantic.BaseModel):
        """A city and the country it is in."""
        name: str = pydantic.Field(max_length=20)
        country: str = pydantic.Field(max_length=20)

    return City


def validate(instance: Any, schema: dict) -> None:
    """``instance`` is valid under JSON Schema ``schema``."""
    client("jsonschema").validate(instance, schema)
