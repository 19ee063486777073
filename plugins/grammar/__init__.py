"""Built-in grammar backends: ``xgrammar`` (default) and ``llguidance``."""

from core import hookimpl

CORE_PLUGIN_API = "1"


@hookimpl
def register_grammar_backends(register):
    register("xgrammar", "core_plugins.grammar.xgrammar_backend:XGrammarBackend")
    register("llguidance", "core_plugins.grammar.llguidance_backend:LLGuidanceBackend")
