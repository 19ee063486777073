"""SGLang's chat and constrained-output launch flags: ``--default-chat-template-kwargs`` (under a
request's own kwargs, read by the template and the reasoning parser), ``--stream-response-default-
include-usage``, ``--hf-chat-template-name``, and the JSON whitespace flags
``--constrained-json-disable-any-whitespace`` / ``--constrained-json-whitespace-pattern``, each
checked on a tiny model over the real app, with its bad values as start-up errors."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import msgspec
import pytest
from structlog.testing import capture_logs

from core.errors import CoreError
from tests.conftest import build_tiny_llama

# the template shows what its kwargs select: "/no_think " when enable_thinking is false, "[style] "
TEMPLATE = ("{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}"
            "{% if style is defined %}[{{ style }}] {% endif %}"
            "{% if reasoning_effort is defined %}effort={{ reasoning_effort }} {% endif %}"
            "{% for m in messages %}{{ m['content'] }}{% endfor %}")
HI = [{"role": "user", "content": "hi"}]
THINK = "<think>ab</think>cd"  # a constrained output the qwen3 parser splits, unless thinking is off


@contextlib.asynccontextmanager
async def served(path: Path | str, server: Any = None, **engine_kw: Any) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    """The real app over a tiny CPU engine: (client, state)."""
    from core.engine import AsyncEngine
    from core.engine.config import engine_args_from_kwargs
    from core.server.app import create_app
    from core.server.args import ServerArgs
    from core.server.state import build_state

    engine = AsyncEngine(engine_args_from_kwargs(dict(model_path=str(path), dtype="float32", max_total_tokens=1024,
                                                      cpu_threads=1, device="cpu", **engine_kw)))
    try:
        state = build_state(engine, server or ServerArgs())
        state.ready = True
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://t",
                                     timeout=120) as c:
            yield c, state
    finally:
        await engine.shutdown()


def _serve_ns(*argv: str):
    from core.cli import build_parser

    return build_parser().parse_args(["serve", "--model-path", "m", *argv])


def _validate(*argv: str) -> None:
    from core.server.args import validate_serve_args

    validate_serve_args(_serve_ns(*argv))


async def _rendered(c: httpx.AsyncClient, state: Any, **body: Any) -> str:
    r = await c.post("/tokenize", json={"messages": HI, **body})
    assert r.status_code == 200, r.text
    return state.engine.tokenizer.decode(r.json()["tokens"])


def _sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


# ----------------------------------------------------------------------------- --default-chat-template-kwargs
def test_default_chat_template_kwargs_sit_under_the_requests_own(tiny_llama, monkeypatch):
    """SGLang merges the defaults per key under a chat request's ``chat_template_kwargs`` (the
    request wins), before rendering, so the template and the reasoning parser read the merged
    kwargs: ``enable_thinking: false`` by default makes the qwen3 parser leave ``<think>`` in the
    content; a request's own ``true`` restores the split. A request's ``reasoning_effort`` still
    wins over a default ``enable_thinking``, and a default ``reasoning_effort`` stands for a
    request's that sets none."""
    from core.server.args import ServerArgs

    import core.server.openai.chat as chat_module

    # (the regex holds the whole output, reasoning included: the gate that holds a grammar back until
    # the reasoning ends is turned off)
    monkeypatch.setattr(chat_module, "reasoning_gate", lambda tags: None)
    path, _ = tiny_llama()
    defaults = {"enable_thinking": False, "style": "terse"}
    server = ServerArgs(chat_template=TEMPLATE, reasoning_parser="qwen3", default_chat_template_kwargs=defaults)

    async def chat(c: httpx.AsyncClient, **body: Any) -> dict:
        r = await c.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 30, "regex": THINK, **body})
        assert r.status_code == 200, r.text
        return r.json()

    async def go() -> dict:
        out: dict[str, Any] = {}
        async with served(path, server) as (c, state):
            out["plain"] = await _rendered(c, state)
            out["own"] = await _rendered(c, state, chat_template_kwargs={"enable_thinking": True})
            out["chat"] = await chat(c)
            out["chat_own"] = await chat(c, chat_template_kwargs={"enable_thinking": True})
            state.args = ServerArgs(chat_template=TEMPLATE, default_chat_template_kwargs={"enable_thinking": True,
                                                                                          "reasoning_effort": "low"})
            out["effort_none"] = await _rendered(c, state, reasoning_effort="none")
            out["effort_default"] = await _rendered(c, state)
            state.args = ServerArgs(chat_template=TEMPLATE, reasoning_parser="qwen3")
            out["without"] = await _rendered(c, state)
            out["chat_without"] = await chat(c)
        return out

    out = asyncio.run(go())
    assert out["plain"] == "/no_think [terse] hi" and out["own"] == "[terse] hi", out
    msg = out["chat"]["choices"][0]["message"]
    assert msg["content"] == THINK and not msg.get("reasoning_content"), msg
    assert out["chat"]["usage"]["prompt_tokens"] == len("/no_think [terse] hi")  # (one token a character)
    msg = out["chat_own"]["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("ab", "cd"), msg
    assert out["effort_none"] == "/no_think hi"  # the request's effort none turns thinking off over the default
    assert out["effort_default"] == "effort=low hi"
    assert out["without"] == "hi" and out["chat_without"]["choices"][0]["message"]["reasoning_content"] == "ab"


def test_default_chat_template_kwargs_bad_values_are_startup_errors():
    with pytest.raises(SystemExit):  # not a JSON object: argparse names the flag
        _serve_ns("--default-chat-template-kwargs", "[1]")
    for value, match in (('{"messages": []}', "--default-chat-template-kwargs: messages is set by the server"),
                         ('{"chat_template": "x"}', "--default-chat-template-kwargs: chat_template is set by the server"),
                         ('{"add_generation_prompt": false}', "add_generation_prompt false is not supported"),
                         ('{"reasoning_effort": "max"}', "reasoning_effort must be one of")):
        with pytest.raises(CoreError, match=match):
            _validate("--default-chat-template-kwargs", value)
    _validate("--default-chat-template-kwargs", '{"enable_thinking": false, "reasoning_effort": "high"}')


# ----------------------------------------------------------------------------- --stream-response-default-include-usage
def test_stream_response_default_include_usage_adds_the_usage_chunk(tiny_llama):
    """With the flag every streamed chat and completion ends with the usage chunk: without
    ``stream_options``, and (SGLang's ``include_usage or flag``) even with ``include_usage: false``."""
    from core.server.args import ServerArgs

    path, _ = tiny_llama()
    body = {"max_tokens": 3, "ignore_eos": True, "stream": True}

    async def streams(c: httpx.AsyncClient) -> list[list[dict]]:
        out = []
        for url, extra in (("/v1/chat/completions", {"messages": HI}),
                           ("/v1/chat/completions", {"messages": HI, "stream_options": {"include_usage": False}}),
                           ("/v1/completions", {"prompt": "hi"})):
            r = await c.post(url, json={**body, **extra})
            assert r.status_code == 200, r.text
            out.append(_sse(r.text))
        return out

    async def go() -> tuple[list, list]:
        async with served(path, ServerArgs(chat_template=TEMPLATE, stream_response_default_include_usage=True)) as (c, state):
            flagged = await streams(c)
            state.args = ServerArgs(chat_template=TEMPLATE)
            plain = await streams(c)
        return flagged, plain

    flagged, plain = asyncio.run(go())
    for chunks in flagged:
        last = chunks[-1]
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3, last
        assert last["usage"]["prompt_tokens"] == 2
    for chunks in plain:
        assert all(ch.get("usage") is None for ch in chunks), chunks[-1]


# ----------------------------------------------------------------------------- --hf-chat-template-name
def test_hf_chat_template_name_picks_the_tokenizers_named_template(tiny_llama, tmp_path):
    """A tokenizer with named chat templates (tokenizer_config.json's list, loaded as a dict):
    the name picks one; a name it lacks stops start-up listing its names; without a name its
    ``default`` (else its first, as SGLang's) renders; the name means nothing under --chat-template
    or beside a single template (a warning, as SGLang ignores it)."""
    from core.server.args import ServerArgs
    from core.server.state import build_state

    base, _ = tiny_llama()
    path = tmp_path / "named"
    shutil.copytree(base, path)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    body = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    cfg["chat_template"] = [{"name": n, "template": f"{n}: {body}"} for n in ("rag", "default", "tool_use")]
    cfg_path.write_text(json.dumps(cfg))

    async def go() -> dict:
        out: dict[str, Any] = {}
        async with served(path, ServerArgs(hf_chat_template_name="rag")) as (c, state):
            tok, engine = state.engine.tokenizer, state.engine
            out["rag"] = await _rendered(c, state)
            tok.chat_template = dict(named := {n: f"{n}: {body}" for n in ("rag", "default", "tool_use")})
            with pytest.raises(CoreError, match=r"--hf-chat-template-name 'nope'.*rag, default, tool_use"):
                build_state(engine, ServerArgs(hf_chat_template_name="nope"))
            build_state(engine, ServerArgs())
            out["unnamed"] = await _rendered(c, state)
            tok.chat_template = {n: named[n] for n in ("tool_use", "rag")}
            build_state(engine, ServerArgs())
            out["first"] = await _rendered(c, state)
            tok.chat_template = dict(named)
            with capture_logs() as logs:
                build_state(engine, ServerArgs(hf_chat_template_name="nope", chat_template=TEMPLATE))
            out["unused"] = [e for e in logs if e["event"] == "chat_template.name_unused"]
            assert isinstance(tok.chat_template, dict)  # left as it was
        return out

    out = asyncio.run(go())
    assert out["rag"] == "rag: hi"
    assert out["unnamed"] == "default: hi" and out["first"] == "tool_use: hi"
    assert len(out["unused"]) == 1 and out["unused"][0]["hf_chat_template_name"] == "nope"


# ----------------------------------------------------------------------------- JSON whitespace
def _allowed_after(backend: Any, kind: str, spec: str, prefix: str, tok: Any) -> set[str]:
    g = backend.compile(kind, spec).copy()
    for t in tok.encode(prefix, add_special_tokens=False):
        assert g.accept_token(t)
    mask = backend.allocate_bitmask(1)
    g.fill_bitmask(mask, 0)
    ids = [i for i in range(len(tok)) if (int(mask[0, i // 32]) >> (i % 32)) & 1]
    return {tok.decode([i]) for i in ids}


@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_json_whitespace_options_shape_the_grammar_backends_masks(name):
    """The backends' masks after ``{``: any whitespace by default, none with
    ``constrained_json_disable_any_whitespace`` (json_schema and json_object alike; xgrammar then
    writes json.dumps's one space after ``:`` and ``,``, as under SGLang, llguidance none), only
    the pattern's under llguidance's ``constrained_json_whitespace_pattern``; regexes are untouched."""
    from core.plugins import load_plugins
    from core.server.openai.job import JSON_OBJECT
    from core.testing.grammar import tokenizer

    tok = tokenizer()
    cls = load_plugins().resolve("grammar_backend", name)
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]})
    ws = {" ", "\n", "\t", "\r"}
    plain, compact = cls(tok, len(tok), stop_token_ids=[2]), cls(tok, len(tok), stop_token_ids=[2], any_whitespace=False)
    for spec in (schema, JSON_OBJECT):
        assert ws <= _allowed_after(plain, "json_schema", spec, "{", tok)
        assert not ws & _allowed_after(compact, "json_schema", spec, "{", tok)
    after_colon = _allowed_after(compact, "json_schema", schema, '{"a":', tok) & ws
    assert after_colon == ({" "} if name == "xgrammar" else set()), after_colon
    if name == "xgrammar":
        assert not ws & _allowed_after(compact, "json_schema", schema, '{"a": ', tok)
    assert " " in _allowed_after(compact, "regex", "a b", "a", tok)
    if name == "llguidance":
        tabs = cls(tok, len(tok), stop_token_ids=[2], whitespace_pattern="[\t]*")
        assert _allowed_after(tabs, "json_schema", schema, "{", tok) & ws == {"\t"}
    if name == "xgrammar":  # --constrained-json-max-whitespace-cnt (xgrammar's option; SGLang's too)
        bounded = cls(tok, len(tok), stop_token_ids=[2], max_whitespace_cnt=2)
        assert ws <= _allowed_after(bounded, "json_schema", schema, "{ ", tok)
        assert not ws & _allowed_after(bounded, "json_schema", schema, "{ \n", tok)
        assert not ws & _allowed_after(bounded, "json_schema", schema, "{\t\t", tok)
        assert ws <= _allowed_after(bounded, "json_schema", schema, '{ \n"a": ', tok)  # a new run after a token


def _byte_model(tmp_path: Path) -> Path:
    """A tiny Llama with a byte-level BPE tokenizer (llguidance reads that kind, not the char one)."""
    from core.testing.grammar import tokenizer

    tok = tokenizer()
    build_tiny_llama(tmp_path, vocab_size=len(tok) + 8)
    tok.save_pretrained(tmp_path)
    return tmp_path


def test_json_whitespace_flags_give_compact_constrained_output(tmp_path):
    """A model pushed toward whitespace (logit_bias) fills a JSON constraint with it by default;
    with ``--constrained-json-disable-any-whitespace`` its output is one line in the backend's
    fixed spacing (SGLang's: xgrammar json.dumps's, llguidance none), and with llguidance's
    ``--constrained-json-whitespace-pattern`` its whitespace is only the pattern's."""
    from core.testing.grammar import tokenizer

    path = _byte_model(tmp_path / "m")
    tok = tokenizer()
    bias = {str(tok.encode(c, add_special_tokens=False)[0]): 60 for c in (" ", "\n")}
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False}
    body = {"messages": HI, "max_tokens": 24, "temperature": 0, "logit_bias": bias,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}

    async def answer(**engine_kw: Any) -> str:
        from core.server.args import ServerArgs

        async with served(path, ServerArgs(chat_template=TEMPLATE), **engine_kw) as (c, _):
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]

    loose = asyncio.run(answer())
    assert any(c in loose for c in " \n"), loose  # the bias wins where whitespace is allowed
    for backend, spacing in (("xgrammar", ": "), ("llguidance", ":")):
        text = asyncio.run(answer(grammar_backend=backend, constrained_json_disable_any_whitespace=True))
        assert text in (f'{{"a"{spacing}true}}', f'{{"a"{spacing}false}}'), (backend, text)
    text = asyncio.run(answer(grammar_backend="llguidance", constrained_json_whitespace_pattern="[\t]*"))
    assert json.loads(text)["a"] in (True, False) and not set(text) & {" ", "\n"}, text
    text = asyncio.run(answer(constrained_json_max_whitespace_cnt=3))  # runs of at most 3, still valid JSON
    assert json.loads(text)["a"] in (True, False) and any(c in text for c in " \n"), text
    assert re.search(r"\s{4}", loose) and not re.search(r"\s{4}", text), (loose, text)


def test_vllms_per_request_json_options_shape_that_requests_output(tmp_path):
    """vLLM's per-request options on a JSON constraint: ``structured_outputs.disable_any_whitespace``
    (xgrammar and llguidance: compact JSON), ``structured_outputs.whitespace_pattern`` and the older
    ``guided_whitespace_pattern`` (llguidance: only the pattern's whitespace; xgrammar has no such
    option: a 400 naming it); the server's defaults stay for the next request."""
    from core.server.args import ServerArgs
    from core.testing.grammar import tokenizer

    path = _byte_model(tmp_path / "m")
    tok = tokenizer()
    bias = {str(tok.encode(c, add_special_tokens=False)[0]): 60 for c in (" ", "\n")}
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False}
    base = {"messages": HI, "max_tokens": 24, "temperature": 0, "logit_bias": bias}

    async def answers(backend: str, *bodies: dict) -> list:
        async with served(path, ServerArgs(chat_template=TEMPLATE), grammar_backend=backend) as (c, _):
            out = []
            for body in bodies:
                r = await c.post("/v1/chat/completions", json={**base, **body})
                out.append(r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r)
            return out

    for backend, spacing in (("xgrammar", ": "), ("llguidance", ":")):
        compact, loose = asyncio.run(answers(backend, {"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
                                             {"structured_outputs": {"json": schema}}))
        assert compact in (f'{{"a"{spacing}true}}', f'{{"a"{spacing}false}}'), (backend, compact)
        assert any(c in loose for c in " \n"), (backend, loose)  # the next request: the server's default again
    tabs, old = asyncio.run(answers("llguidance", {"structured_outputs": {"json": schema, "whitespace_pattern": "[\t]*"}},
                                    {"guided_json": schema, "guided_whitespace_pattern": "[\t]*"}))
    for text in (tabs, old):
        assert json.loads(text)["a"] in (True, False) and not set(text) & {" ", "\n"}, text
    (refused,) = asyncio.run(answers("xgrammar", {"guided_json": schema, "guided_whitespace_pattern": "[\t]*"}))
    err = refused.json()["error"]
    assert refused.status_code == 400 and err["param"] == "whitespace_pattern" and "llguidance" in err["message"]


def test_disable_additional_properties_closes_every_object_of_the_schema():
    """vLLM's ``disable_additional_properties``: every object schema without ``additionalProperties``
    gets ``false`` (nested ones too; one that sets it keeps its own); the options reach the sampling
    parameters of a JSON constraint only."""
    from core.server.openai.job import closed_objects, request_constraint
    from core.server.openai.protocol import ChatCompletionRequest

    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "c": {"type": "object", "additionalProperties": True},
                                               "d": {"type": "array", "items": {"properties": {"e": {}}}}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False and closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["c"]["additionalProperties"] is True
    assert closed["properties"]["d"]["items"]["additionalProperties"] is False and "additionalProperties" not in \
        closed["properties"]["d"]
    req = lambda so: msgspec.convert({"messages": HI, "structured_outputs": so}, ChatCompletionRequest)  # noqa: E731
    got = request_constraint(req({"json": schema, "disable_additional_properties": True, "disable_any_whitespace": True}))
    assert json.loads(got["json_schema"]) == closed and got["json_options"] == {"any_whitespace": False}
    assert request_constraint(req({"regex": "a+", "whitespace_pattern": " "})) == {"regex": "a+"}  # (vLLM: ignored)


def test_json_whitespace_flags_a_backend_cannot_honour_are_startup_errors(tiny_llama):
    """``--constrained-json-whitespace-pattern`` needs llguidance (xgrammar, the default, has no
    such option); neither flag means anything under ``--grammar-backend none``; a bad regex is
    named. The offline Engine refuses them the same way."""
    from tests.conftest import make_engine

    for argv, match in (
            (["--constrained-json-whitespace-pattern", "[ ]*"],
             "--constrained-json-whitespace-pattern is not supported by --grammar-backend xgrammar; use --grammar-backend llguidance"),
            (["--constrained-json-disable-any-whitespace", "--grammar-backend", "none"],
             "--constrained-json-disable-any-whitespace is not supported by --grammar-backend none; use --grammar-backend xgrammar or llguidance"),
            (["--constrained-json-whitespace-pattern", "[", "--grammar-backend", "llguidance"],
             "--constrained-json-whitespace-pattern '\\[' is not a regular expression"),
            (["--constrained-json-max-whitespace-cnt", "0"], "--constrained-json-max-whitespace-cnt must be >= 1"),
            (["--constrained-json-max-whitespace-cnt", "2", "--grammar-backend", "none"],
             "--constrained-json-max-whitespace-cnt is not supported by --grammar-backend none"),
            (["--constrained-json-max-whitespace-cnt", "2", "--grammar-backend", "llguidance"],
             "--constrained-json-max-whitespace-cnt is not supported by --grammar-backend llguidance; use "
             "--grammar-backend xgrammar")):
        with pytest.raises(CoreError, match=match):
            _validate(*argv)
    _validate("--constrained-json-whitespace-pattern", "[ ]?", "--grammar-backend", "llguidance",
              "--constrained-json-disable-any-whitespace")
    ns = _serve_ns("--constrained-json-disable-any-whitespace", "--constrained-json-whitespace-pattern", "x")
    assert (ns.constrained_json_disable_any_whitespace, ns.constrained_json_whitespace_pattern) == (True, "x")
    with pytest.raises(CoreError, match="--constrained-json-whitespace-pattern is not supported by --grammar-backend xgrammar"):
        make_engine(tiny_llama()[0], constrained_json_whitespace_pattern="[ ]*")
