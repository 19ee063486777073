"""The ``core.testing`` pytest plugin, registered through the ``pytest11`` entry point.

It makes a conformance suite imported into a test module a test class (whatever name it is
imported under), parametrises its test over the suite's cases (test ids are the case names),
and provides the optional fixtures the suites read, each defaulting to "use the kit's
default". A test module or conftest overrides any of them by defining a fixture of the same
name. This module imports only pytest, so having core installed costs other test runs nothing.
"""

from __future__ import annotations

from typing import Any

import pytest


def _is_suite(obj: Any) -> bool:
    return isinstance(obj, type) and bool(getattr(obj, "__core_conformance__", False)) and bool(getattr(obj, "kind", ""))


@pytest.hookimpl
def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: Any) -> Any:
    if _is_suite(obj) and isinstance(collector, pytest.Module):
        return pytest.Class.from_parent(collector, name=name, obj=obj)
    return None


@pytest.hookimpl
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.cls is not None and _is_suite(metafunc.cls) and "case" in metafunc.fixturenames:
        cases = metafunc.cls.cases()
        metafunc.parametrize("case", cases, ids=[c.name for c in cases])


@pytest.fixture(scope="session")
def conformance_plugins() -> Any:
    """The plugin manager registered names are looked up in: every installed plugin."""
    from core.testing.suite import default_plugins

    return default_plugins()


@pytest.fixture
def conformance_device() -> Any:
    """The device attention backends and quant methods run on (None: CUDA when present, else CPU)."""
    return None


@pytest.fixture
def attention_dtype() -> Any:
    """The attention backend's dtype (None: float32 on CPU, bfloat16 on CUDA)."""
    return None


@pytest.fixture
def quant_dtypes() -> Any:
    """Activation dtypes a quant method is checked in (None: float32 and bfloat16)."""
    return None


@pytest.fixture
def quant_tolerances() -> Any:
    """``{"round_trip_rtol": float, "gemm_rtol": {dtype: float}}`` (None: the kit's defaults)."""
    return None


@pytest.fixture
def model_config() -> Any:
    """A tiny transformers config for the model (None: derived from the architecture's transformers class)."""
    return None


@pytest.fixture
def model_reference() -> Any:
    """The transformers class to compare with (None: the one named like the config's architecture)."""
    return None


@pytest.fixture
def tool_parser_samples() -> Any:
    """``[core.testing.ToolSample]`` (None: the built-in samples for a built-in parser, else none)."""
    return None


@pytest.fixture
def tool_parser_format() -> Any:
    """``calls -> text`` writing ``[(name, arguments)]`` in the parser's format (None: built-in or none)."""
    return None


@pytest.fixture
def tool_parser_tools() -> Any:
    """The ``tools`` list the samples are parsed with (None: get_weather and get_time)."""
    return None


@pytest.fixture
def reasoning_parser_samples() -> Any:
    """``[core.testing.ReasoningSample]`` (None: the built-in samples for a built-in parser, else none)."""
    return None
