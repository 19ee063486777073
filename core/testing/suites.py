"""The suites a plugin author imports into a test module, one per extension kind.

Each is a class of one test, parametrised over the kind's cases by the ``core.testing``
pytest plugin (registered through the ``pytest11`` entry point when core is installed), and
collected under whatever name it is imported as. The one required fixture names the plugin
under test: a registered name (looked up among the installed plugins, or in the
``conformance_plugins`` fixture's manager) or the factory itself. Optional fixtures, defaulted
by the plugin, supply samples, configs, devices and tolerances. Subclassing works too::

    class TestMyBackend(AttentionBackendConformance): ...

This module imports no pytest: only running a case does.
"""

from __future__ import annotations

from typing import Any, ClassVar

from core.testing.attention import AttentionSubject, attention_cases
from core.testing.drafter import DrafterSubject, drafter_cases
from core.testing.grammar import GrammarSubject, grammar_cases
from core.testing.hicache_storage import StorageSubject, hicache_storage_cases
from core.testing.models import ModelSubject, model_cases
from core.testing.multimodal import ProcessorSubject, multimodal_processor_cases
from core.testing.parsers import ReasoningParserSubject, ToolParserSubject, reasoning_parser_cases, tool_parser_cases
from core.testing.quant import QuantSubject, quant_cases
from core.testing.suite import Case, run_in_pytest

_CACHE: dict[tuple, Any] = {}  # subjects that are costly to build (models, grammar backends); the key holds
# the objects themselves, so none is collected and its id reused while cached


def _cached(key: tuple, build: Any) -> Any:
    try:
        hash(key)
    except TypeError:  # an unhashable target: build each time
        return build()
    if key not in _CACHE:
        _CACHE[key] = build()
    return _CACHE[key]


def _config_key(config: Any) -> Any:
    return None if config is None else config.to_json_string()


class Suite:
    """Base of the suites: ``cases()`` lists what the ``case`` parameter takes."""

    __core_conformance__: ClassVar[bool] = True
    kind: ClassVar[str] = ""

    @staticmethod
    def cases() -> list[Case]:
        return []


class AttentionBackendConformance(Suite):
    """Fixture ``attention_backend``; optional ``conformance_device``, ``attention_dtype``."""

    kind = "attention_backend"
    cases = staticmethod(attention_cases)

    def test_attention_backend(self, case, attention_backend, conformance_plugins, conformance_device, attention_dtype):
        run_in_pytest(case, AttentionSubject.build(attention_backend, plugins=conformance_plugins,
                                                   device=conformance_device, dtype=attention_dtype))


class QuantMethodConformance(Suite):
    """Fixture ``quant_method``; optional ``conformance_device``, ``quant_dtypes``, ``quant_tolerances``
    (``{"round_trip_rtol": float, "gemm_rtol": {dtype: float}}``)."""

    kind = "quant_method"
    cases = staticmethod(quant_cases)

    def test_quant_method(self, case, quant_method, conformance_plugins, conformance_device, quant_dtypes,
                          quant_tolerances):
        run_in_pytest(case, QuantSubject.build(quant_method, plugins=conformance_plugins, device=conformance_device,
                                               dtypes=quant_dtypes, **(quant_tolerances or {})))


class ModelConformance(Suite):
    """Fixture ``model_architecture``; optional ``model_config`` (a tiny transformers config) and
    ``model_reference`` (the transformers class to compare with)."""

    kind = "model"
    cases = staticmethod(model_cases)

    def test_model(self, case, model_architecture, conformance_plugins, model_config, model_reference):
        key = ("model", model_architecture, _config_key(model_config), model_reference, conformance_plugins)
        subject = _cached(key, lambda: ModelSubject.build(model_architecture, plugins=conformance_plugins,
                                                          config=model_config, reference=model_reference))
        run_in_pytest(case, subject)


class ToolParserConformance(Suite):
    """Fixture ``tool_parser``; optional ``tool_parser_samples`` (``[ToolSample]``),
    ``tool_parser_format`` (``calls -> text``) and ``tool_parser_tools``."""

    kind = "tool_parser"
    cases = staticmethod(tool_parser_cases)

    def test_tool_parser(self, case, tool_parser, conformance_plugins, tool_parser_samples, tool_parser_format,
                         tool_parser_tools):
        run_in_pytest(case, ToolParserSubject.build(tool_parser, plugins=conformance_plugins, samples=tool_parser_samples,
                                                    format_calls=tool_parser_format, tools=tool_parser_tools))


class ReasoningParserConformance(Suite):
    """Fixture ``reasoning_parser``; optional ``reasoning_parser_samples`` (``[ReasoningSample]``)."""

    kind = "reasoning_parser"
    cases = staticmethod(reasoning_parser_cases)

    def test_reasoning_parser(self, case, reasoning_parser, conformance_plugins, reasoning_parser_samples):
        run_in_pytest(case, ReasoningParserSubject.build(reasoning_parser, plugins=conformance_plugins,
                                                         samples=reasoning_parser_samples))


class GrammarBackendConformance(Suite):
    """Fixture ``grammar_backend``."""

    kind = "grammar_backend"
    cases = staticmethod(grammar_cases)

    def test_grammar_backend(self, case, grammar_backend, conformance_plugins):
        key = ("grammar", grammar_backend, conformance_plugins)
        run_in_pytest(case, _cached(key, lambda: GrammarSubject.build(grammar_backend, plugins=conformance_plugins)))


class DrafterConformance(Suite):
    """Fixture ``speculative_algorithm`` (a drafter for speculative decoding)."""

    kind = "speculative_algorithm"
    cases = staticmethod(drafter_cases)

    def test_speculative_algorithm(self, case, speculative_algorithm, conformance_plugins):
        run_in_pytest(case, DrafterSubject.build(speculative_algorithm, plugins=conformance_plugins))


class HiCacheStorageConformance(Suite):
    """Fixture ``hicache_storage_backend`` (a HiCache storage backend)."""

    kind = "hicache_storage_backend"
    cases = staticmethod(hicache_storage_cases)

    def test_hicache_storage_backend(self, case, hicache_storage_backend, conformance_plugins):
        run_in_pytest(case, StorageSubject.build(hicache_storage_backend, plugins=conformance_plugins))


class MultimodalProcessorConformance(Suite):
    """Fixture ``multimodal_processor`` (a built processor, or a zero-argument factory of one: a
    processor is made for one model's folder, config and tokenizer)."""

    kind = "multimodal_processor"
    cases = staticmethod(multimodal_processor_cases)

    def test_multimodal_processor(self, case, multimodal_processor, conformance_plugins):
        run_in_pytest(case, ProcessorSubject.build(multimodal_processor, plugins=conformance_plugins))
