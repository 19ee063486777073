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
from typing import Any

import pytest

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
