"""Fill-in-the-middle completions (SGLang's ``--completion-template``,
``core.server.openai.completion_template``): /v1/completions' ``suffix`` goes between the
template's markers, as SGLang formats it; without a template, or with token-id prompts, a suffix
is a 400 naming the fix; a bad template stops start-up."""

from __future__ import annotations

import json

import pytest

from core.errors import CoreError
from core.server.openai.completion_template import BUILTIN, load_completion_template


def test_builtin_templates_place_the_markers_as_sglang():
    assert BUILTIN["qwen_coder"].prompt("def f(", "  return 1") == "<|fim_prefix|>def f(<|fim_suffix|>  return 1<|fim_middle|>"
    assert BUILTIN["star_coder"].prompt("a", "b") == "<fim_prefix>a<fim_suffix>b<fim_middle>"
    assert BUILTIN["deepseek_coder"].prompt("a", "b") == "<｜fim▁begin｜>a<｜fim▁hole｜>b<｜fim▁end｜>"


def test_template_files_and_bad_values(tmp_path):
    f = tmp_path / "fim.json"
    f.write_text(json.dumps({"name": "mine", "fim_begin_token": "<B>", "fim_middle_token": "<M>",
                             "fim_end_token": "<E>", "fim_position": "MIDDLE"}))
    assert load_completion_template(str(f)).prompt("x", "y") == "<B>x<M>y<E>"
    assert load_completion_template(None) is None
    with pytest.raises(CoreError, match="neither a built-in template .*qwen_coder.* nor a file"):
        load_completion_template("nope")
    f.write_text(json.dumps({"name": "mine", "fim_begin_token": "<B>"}))
    with pytest.raises(CoreError, match="needs name, fim_begin_token"):
        load_completion_template(str(f))
    f.write_text(json.dumps({"name": "m", "fim_begin_token": "<B>", "fim_middle_token": "<M>", "fim_end_token": "<E>",
                             "fim_position": "LEFT"}))
    with pytest.raises(CoreError, match="fim_position must be MIDDLE or END"):
        load_completion_template(str(f))
    from core.cli import build_parser
    from core.server.args import validate_serve_args

    ns = build_parser().parse_args(["serve", "--model-path", str(tmp_path), "--completion-template", "nope"])
    with pytest.raises(CoreError, match="--completion-template nope"):
        validate_serve_args(ns)


def test_suffix_completions_read_the_fim_prompt(tiny_llama):
    """A suffix request gives the tokens of its FIM prompt sent as a plain prompt; no suffix (or
    "") leaves the prompt alone; token-id prompts and a server without a template refuse it."""
    from core.server.args import ServerArgs
    from tests.server_utils import serve_in_process

    path = tiny_llama()[0]
    greedy = {"model": "m", "max_tokens": 5, "temperature": 0}

    async def calls(c):
        fim = await c.post("/v1/completions", json={**greedy, "prompt": "def f(", "suffix": "  return 1"})
        plain = await c.post("/v1/completions", json={**greedy, "prompt": BUILTIN["qwen_coder"].prompt("def f(", "  return 1")})
        bare = await c.post("/v1/completions", json={**greedy, "prompt": "def f(", "suffix": ""})
        unsuffixed = await c.post("/v1/completions", json={**greedy, "prompt": "def f("})
        ids = await c.post("/v1/completions", json={**greedy, "prompt": [5, 6, 7], "suffix": "x"})
        return fim.json(), plain.json(), bare.json(), unsuffixed.json(), ids

    fim, plain, bare, unsuffixed, ids = serve_in_process({"model_path": str(path)},
                                                         ServerArgs(completion_template="qwen_coder"), calls)
    assert fim["choices"][0]["text"] == plain["choices"][0]["text"]
    assert fim["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] > unsuffixed["usage"]["prompt_tokens"]
    assert bare["choices"][0]["text"] == unsuffixed["choices"][0]["text"]
    assert bare["usage"]["prompt_tokens"] == unsuffixed["usage"]["prompt_tokens"]
    assert ids.status_code == 400 and ids.json()["error"]["param"] == "suffix"

    async def without(c):
        return await c.post("/v1/completions", json={**greedy, "prompt": "def f(", "suffix": "x"})

    r = serve_in_process({"model_path": str(path)}, ServerArgs(), without)
    assert r.status_code == 400 and "--completion-template" in r.json()["error"]["message"]
