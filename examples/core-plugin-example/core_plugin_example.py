"""core-plugin-example: one of each extension a third party most often ships.

* attention backend ``example_counting``: core's torch-native math, counting its calls;
* model ``ExampleLlamaForCausalLM``: a Llama variant under a new Hugging Face architecture name;
* tool-call parser ``example_brackets``: calls written as ``[[tool NAME {"json": "arguments"}]]``;
* grammar backend ``example_counting_xgrammar``: xgrammar under a new name, counting compilations;
* the flag ``--example-stats-file PATH``: the counters are written there as JSON on shutdown.

A third-party plugin may import core's public modules (``core``, ``core.interfaces``) and,
to reuse them, core's built-ins (``core_plugins.*``); it never edits core.
"""

from __future__ import annotations

import collections
import json
import re
import threading

from core import hookimpl
from core.interfaces import ToolCall
from core_plugins.attention.torch_native import TorchNativeBackend
from core_plugins.models.llama import LlamaForCausalLM

__version__ = "0.3.0"

# The plugin API range this plugin was written against (a PEP 440 specifier; a bare "1"
# means "any 1.x"). Core refuses the plugin, naming both versions, if its own is outside.
CORE_PLUGIN_API = ">=1.0,<2"

STATS: collections.Counter[str] = collections.Counter()
_lock = threading.Lock()
_stats_file: str | None = None


def count(key: str, n: int = 1) -> None:
    with _lock:
        STATS[key] += n


# --------------------------------------------------------------------------- attention


class CountingAttentionBackend(TorchNativeBackend):
    """The torch-native reference math; ``prepare`` counts forwards, ``forward`` counts layer calls.

    Constructed once per engine as ``CountingAttentionBackend(config: AttentionConfig)``."""

    def prepare(self, batch):
        count("attention_prepare")
        super().prepare(batch)

    def forward(self, q, k, v, layer, batch):
        count("attention_forward")
        return super().forward(q, k, v, layer, batch)


# --------------------------------------------------------------------------- model


class ExampleLlamaForCausalLM(LlamaForCausalLM):
    """Llama, served under the architecture name ``ExampleLlamaForCausalLM`` (what a
    checkpoint's ``config.json`` ``architectures`` says). Built as ``cls(hf_config, ctx)``."""

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        count("model_instances")


# --------------------------------------------------------------------------- tool parser

_CALL = re.compile(r"\[\[tool\s+([A-Za-z_][\w.-]*)\s*(\{.*?\})\s*\]\]", re.S)
_OPEN = "[["


class BracketToolParser:
    """Tool calls as ``[[tool NAME {"arg": 1}]]``; anything else is normal text.

    Streaming holds back text from ``[[`` until its ``]]`` arrives (and a trailing ``[``
    that may start one), then emits the whole call in one delta."""

    def __init__(self) -> None:
        count("tool_parser_instances")
        self.buf = ""
        self.index = 0

    def _calls(self, text: str) -> tuple[str, list[ToolCall]]:
        normal, calls, pos = [], [], 0
        for m in _CALL.finditer(text):
            try:
                args = json.loads(m.group(2))
            except ValueError:
                continue  # not a call: stays normal text
            normal.append(text[pos:m.start()])
            calls.append(ToolCall(name=m.group(1), arguments=json.dumps(args), index=self.index))
            self.index += 1
            pos = m.end()
        normal.append(text[pos:])
        count("tool_calls_parsed", len(calls))
        return "".join(normal), calls

    def parse(self, text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCall]]:
        self.index = 0
        return self._calls(text)

    def parse_streaming(self, delta: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCall]]:
        self.buf += delta
        cut = self.buf.find(_OPEN)
        if cut < 0:  # no call started; keep a trailing "[" that may begin one
            cut = len(self.buf) - 1 if self.buf.endswith("[") else len(self.buf)
            out, self.buf = self.buf[:cut], self.buf[cut:]
            return out, []
        end = self.buf.find("]]", cut)
        if end < 0:
            out, self.buf = self.buf[:cut], self.buf[cut:]
            return out, []
        done, self.buf = self.buf[:end + 2], self.buf[end + 2:]
        normal, calls = self._calls(done)
        more_normal, more_calls = self.parse_streaming("", tools) if self.buf else ("", [])
        return normal + more_normal, calls + more_calls

    def flush(self, tools: list[dict] | None = None) -> tuple[str, list[ToolCall]]:
        rest, self.buf = self.buf, ""
        return self._calls(rest) if rest else ("", [])


# --------------------------------------------------------------------------- grammar backend


def make_grammar_backend(tokenizer, vocab_size, *, stop_token_ids=None):
    """Factory: xgrammar under another name, counting compilations (core caches them by
    spec). xgrammar is imported here, when the backend is selected, not at discovery."""
    from core_plugins.grammar.xgrammar_backend import XGrammarBackend

    class CountingXGrammarBackend(XGrammarBackend):
        def compile(self, kind, spec):
            count(f"grammar_compile_{kind}")
            return super().compile(kind, spec)

    return CountingXGrammarBackend(tokenizer, vocab_size, stop_token_ids=stop_token_ids)


# --------------------------------------------------------------------------- hooks

@hookimpl
def register_attention_backends(register):
    register("example_counting", CountingAttentionBackend)


@hookimpl
def register_models(register):
    register("ExampleLlamaForCausalLM", ExampleLlamaForCausalLM)


@hookimpl
def register_tool_parsers(register):
    register("example_brackets", BracketToolParser)


@hookimpl
def register_grammar_backends(register):
    register("example_counting_xgrammar", make_grammar_backend)


@hookimpl
def add_cli_options(parser):
    parser.add_argument("--example-stats-file", default=None,
                        help="core-plugin-example: write its call counters here (JSON) on shutdown")


@hookimpl
def on_startup(engine):
    global _stats_file
    _stats_file = engine.args.extra.get("example_stats_file")
    count("startups")


@hookimpl
def on_shutdown(engine):
    if _stats_file:
        with _lock:
            data = dict(STATS)
        with open(_stats_file, "w", encoding="utf-8") as f:
            json.dump(data, f)
