"""The conformance kit: check an attention backend, quant method, model, parser, grammar
backend, speculative drafter or HiCache storage backend against core's references, from pytest or from
``core plugins --check NAME``.

In a plugin's tests, import the suite for its kind and name the plugin in a fixture::

    import pytest
    from core.testing import attention_backend_conformance

    @pytest.fixture
    def attention_backend():
        return "my_backend"          # a registered name, or the backend class itself

The suites (classes; the ``core.testing`` pytest plugin collects them under any name):

========================================  ======================  ===================================
suite                                     required fixture        checked against
========================================  ======================  ===================================
``attention_backend_conformance``         ``attention_backend``   torch_native on the same KV pool
``quant_method_conformance``              ``quant_method``        dequantize-then-matmul, float weights
``model_conformance``                     ``model_architecture``  transformers on a tiny random config
``tool_parser_conformance``               ``tool_parser``         its own ``parse``, samples, round trips
``reasoning_parser_conformance``          ``reasoning_parser``    its own ``parse``, samples
``grammar_backend_conformance``           ``grammar_backend``     oracles for JSON schema, regex, EBNF
``drafter_conformance``                   ``speculative_algorithm``  the engine's contract for drafts,
                                                                     chains and trees (a model drafter on
                                                                     a fake draft model or EAGLE head,
                                                                     observing a fake target's features)
``hicache_storage_conformance``           ``hicache_storage_backend``  round trips, missing keys, overwrite,
                                                                     clear, a failed write
``multimodal_processor_conformance``      ``multimodal_processor``  placeholder expansion, pixels, content
                                                                     hashes, count mismatches (a built
                                                                     processor: pytest only)
========================================  ======================  ===================================

Outside pytest, :func:`check_plugin` runs a suite and returns a :class:`CaseResult` per case.
See docs/writing-a-plugin.md ("Check it with the conformance kit").
"""

from core.testing.attention import ATTENTION_CASES, TOLERANCES, AttentionCase
from core.testing.check import check_plugin, format_results
from core.testing.grammar import GRAMMAR_CASES
from core.testing.parser_samples import REASONING_SAMPLES, TOOL_FORMATS, TOOL_SAMPLES, ReasoningSample, ToolSample
from core.testing.suite import Case, CaseResult, ConformanceError, Skipped
from core.testing.suites import (
    AttentionBackendConformance, DrafterConformance, GrammarBackendConformance, HiCacheStorageConformance,
    ModelConformance, MultimodalProcessorConformance, QuantMethodConformance, ReasoningParserConformance, Suite, ToolParserConformance,
)

attention_backend_conformance = AttentionBackendConformance
quant_method_conformance = QuantMethodConformance
model_conformance = ModelConformance
tool_parser_conformance = ToolParserConformance
reasoning_parser_conformance = ReasoningParserConformance
grammar_backend_conformance = GrammarBackendConformance
drafter_conformance = DrafterConformance
hicache_storage_conformance = HiCacheStorageConformance
multimodal_processor_conformance = MultimodalProcessorConformance

__all__ = [
    "attention_backend_conformance", "quant_method_conformance", "model_conformance", "tool_parser_conformance",
    "reasoning_parser_conformance", "grammar_backend_conformance", "drafter_conformance",
    "hicache_storage_conformance", "HiCacheStorageConformance", "multimodal_processor_conformance",
    "MultimodalProcessorConformance",
    "AttentionBackendConformance", "QuantMethodConformance", "ModelConformance", "ToolParserConformance",
    "ReasoningParserConformance", "GrammarBackendConformance", "DrafterConformance", "Suite",
    "check_plugin", "format_results", "Case", "CaseResult", "ConformanceError", "Skipped",
    "ToolSample", "ReasoningSample", "TOOL_SAMPLES", "TOOL_FORMATS", "REASONING_SAMPLES",
    "AttentionCase", "ATTENTION_CASES", "TOLERANCES", "GRAMMAR_CASES",
]
