"""The example plugin's own tests: run with ``python -m pytest`` from this package's folder
(or core's), with core installed. They load the plugin module directly
(``load_plugins(extra_modules=...)``), so they pass whether or not the wheel is installed.

Correctness of each extension is core's conformance kit (``core.testing``): importing a suite
collects it, and a fixture names what it checks. The rest checks what is particular to this
plugin: its registrations, its counters, and the engine running on all of it together."""

from __future__ import annotations

import asyncio
import json
import string
from pathlib import Path

import pytest
import torch

import core_plugin_example as example
from core.config import engine_args_from_kwargs
from core.plugins import api_compatible, load_plugins
from core.testing import (
    ToolSample, attention_backend_conformance, grammar_backend_conformance, model_conformance, tool_parser_conformance,
)

# core installs this pytest plugin (a pytest11 entry point); naming it here too is a no-op then
pytest_plugins = ["core.testing.pytest_plugin"]

EXTRA = [("example", example)]


def test_declares_a_compatible_api_range():
    import core

    assert api_compatible(example.CORE_PLUGIN_API, core.PLUGIN_API_VERSION)
    assert not api_compatible(example.CORE_PLUGIN_API, "2.0")


def test_registrations():
    m = load_plugins("unquantized", extra_modules=EXTRA)  # allowlist: do not also load an installed copy
    desc = {d["name"]: d for d in m.describe()}["example"]
    assert desc["api_version"] == ">=1.0,<2" and desc["error"] is None
    assert desc["registrations"] == {
        "attention_backend": ["example_counting"],
        "model": ["ExampleLlamaForCausalLM"],
        "tool_parser": ["example_brackets"],
        "grammar_backend": ["example_counting_xgrammar"],
    }


# --------------------------------------------------------------------------- the conformance kit


@pytest.fixture(scope="module")
def conformance_plugins():
    """Names below are looked up among core's dense weights and this plugin only."""
    return load_plugins("unquantized", extra_modules=EXTRA)


@pytest.fixture
def attention_backend():
    return "example_counting"


@pytest.fixture
def grammar_backend():
    return "example_counting_xgrammar"


@pytest.fixture
def tool_parser():
    return "example_brackets"


TEXT = 'Let me check. [[tool get_weather {"city": "Paris"}]] and [[tool get_weather {"city": "Rome"}]] done [x]'


@pytest.fixture
def tool_parser_samples():
    paris, rome = ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})
    return [ToolSample(TEXT, "Let me check.  and  done [x]", (paris, rome)),
            ToolSample("[[tool get_weather {not json}]] [", "[[tool get_weather {not json}]] ["),
            ToolSample("No call here, only [brackets].", "No call here, only [brackets].")]


@pytest.fixture
def tool_parser_format():
    """How the round-trip case writes calls in this parser's format."""
    return lambda calls: " ".join(f"[[tool {name} {json.dumps(args)}]]" for name, args in calls)


@pytest.fixture
def model_architecture():
    return "ExampleLlamaForCausalLM"


@pytest.fixture(scope="module")
def model_config():
    """No transformers class is named ExampleLlamaForCausalLM: say which config it reads..."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       initializer_range=0.25, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                       architectures=["ExampleLlamaForCausalLM"])


@pytest.fixture
def model_reference():
    """...and which transformers model it must agree with."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM


# --------------------------------------------------------------------------- tiny model

VOCAB = 128


def _char_tokenizer():
    """One token per printable ASCII character (ids 0-2: <unk>, <s>, </s>)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for c in string.printable[:95]:
        vocab.setdefault(c, len(vocab))
    while len(vocab) < VOCAB:
        vocab[f"<extra{len(vocab)}>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def build_checkpoint(path: Path, architecture: str = "ExampleLlamaForCausalLM") -> Path:
    """A tiny random Llama saved with ``architectures: [architecture]`` and a char tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.25, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tok = _char_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    tok.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = [architecture]
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("example-llama"))


def _generate(path: Path, plugins, prompts, params, **kwargs):
    from core.engine import AsyncEngine

    args = engine_args_from_kwargs(dict(model_path=str(path), dtype="float32", max_total_tokens=1024,
                                        cpu_threads=1, device="cpu", **kwargs))

    async def main():
        engine = AsyncEngine(args, plugins=plugins)
        try:
            return [await engine.generate(p, params) for p in prompts]
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def test_model_backend_and_grammar_in_the_engine(checkpoint):
    example.STATS.clear()
    greedy = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    pm = load_plugins("unquantized", extra_modules=EXTRA)
    ours = _generate(checkpoint, pm, ["hello", "abc"], greedy,
                     attention_backend="example_counting", grammar_backend="example_counting_xgrammar")
    assert example.STATS["model_instances"] == 1
    assert example.STATS["attention_prepare"] >= 8  # at least one forward per new token
    assert example.STATS["attention_forward"] == 2 * example.STATS["attention_prepare"]  # two layers
    # Same weights through core's built-in Llama and torch-native backend: identical tokens.
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (checkpoint / "config.json").write_text(json.dumps(cfg))
    try:
        ref = _generate(checkpoint, load_plugins("unquantized,llama,torch_native"), ["hello", "abc"], greedy,
                        grammar_backend="none")
    finally:
        cfg["architectures"] = ["ExampleLlamaForCausalLM"]
        (checkpoint / "config.json").write_text(json.dumps(cfg))
    assert [o["output_ids"] for o in ours] == [o["output_ids"] for o in ref]
    # The grammar backend constrains output: three digits, whatever the random model prefers.
    (out,) = _generate(checkpoint, pm, ["x"], {"temperature": 0, "max_new_tokens": 8, "regex": "[0-9]{3}"},
                       attention_backend="example_counting", grammar_backend="example_counting_xgrammar")
    assert len(out["text"]) == 3 and out["text"].isdigit(), out["text"]
    assert example.STATS["grammar_compile_regex"] == 1
