"""Where the server differed from SGLang with an HTTP 200 (each test failed before its fix): the
first streamed token under --stream-interval, a request exactly filling the context, chat's
sampling defaults from generation_config.json, a batch's rid expansion, /model_info's fields,
/tokenize's tool_choice and reasoning_effort, and generation on an embedding server."""

from __future__ import annotations

import json

import pytest

from tests.conftest import build_tiny_llama
from tests.test_robustness_limits import Served

HI = [{"role": "user", "content": "hi"}]


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = tmp_path_factory.mktemp("tiny")
    build_tiny_llama(p, initializer_range=0.02)  # flat logits: unconstrained samples vary
    (p / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.5, "top_k": 1}))
    return p


@pytest.fixture(scope="module")
def served(path):
    s = Served(path, "--stream-interval", "8", "--context-length", "64")
    yield s
    s.close()


def test_the_first_token_streams_at_once_then_every_interval(served):
    """SGLang sends a stream's first token as soon as it exists, then every --stream-interval
    tokens; /generate and chat held the first back until the interval (/v1/completions did not)."""
    usage = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    r = served.post("/generate", json={"text": "hello", "stream": True,
                                       "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}})
    assert [len(e["output_ids"]) for e in _events(r.text)] == [1, 9, 12]
    for route, body in (("/v1/chat/completions", {"messages": HI}), ("/v1/completions", {"prompt": "hi"})):
        r = served.post(route, json={**body, "stream": True, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                     **usage})
        counts = [e["usage"]["completion_tokens"] for e in _events(r.text) if e.get("choices") and e["choices"][0].get(
            "delta", e["choices"][0]).get("content", e["choices"][0].get("text"))]
        assert counts[:2] == [1, 9], (route, counts)


def test_a_request_that_exactly_fills_the_context_is_served(served):
    """SGLang refuses prompt + max_new_tokens above the context length; /generate refused it equal too."""
    ids = list(range(10, 20))
    ok = served.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 54, "ignore_eos": True,
                                                                              "temperature": 0}})
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 54
    over = served.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 55}})
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_new_tokens"


def test_chat_takes_the_models_sampling_defaults(served, path):
    """--sampling-defaults model (SGLang's default): a chat request that omits temperature, top_p,
    top_k, min_p or repetition_penalty takes generation_config.json's (top_k 1 here: greedy)."""
    def chat(**kw):
        r = served.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 16, "ignore_eos": True, **kw})
        return r.json()["choices"][0]["message"]["content"]

    greedy = chat(temperature=0)
    assert [chat() for _ in range(3)] == [greedy] * 3
    assert len({chat(top_k=-1, temperature=1.0) for _ in range(3)}) > 1  # the request's own values win
    s = Served(path, "--sampling-defaults", "openai")
    try:
        outs = {s.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 16, "ignore_eos": True}).json()[
            "choices"][0]["message"]["content"] for _ in range(3)}
    finally:
        s.close()
    assert len(outs) > 1  # OpenAI's defaults: temperature 1, no top_k


def test_a_batch_rid_expands_as_sglangs(served):
    r = served.post("/generate", json={"text": ["a", "b"], "rid": "job", "sampling_params": {"max_new_tokens": 1}})
    assert [o["meta_info"]["id"] for o in r.json()] == ["job_0", "job_1"]


def test_model_info_has_sglangs_fields(served, path):
    info = served.get("/model_info").json()
    assert info["architectures"] == ["LlamaForCausalLM"] and info["model_type"] == "llama"
    assert info["tokenizer_path"] == info["model_path"] == str(path)  # (no --tokenizer-path: the model's)
    assert (info["load_format"], info["has_image_understanding"], info["has_audio_understanding"]) == ("auto", False, False)
    assert info["reasoning_parser"] is None and info["tool_call_parser"] is None


def test_tokenize_counts_what_chat_renders(served):
    """/tokenize dropped tool_choice and reasoning_effort, so its count was not the chat prompt's."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for extra in ({"tools": tools, "tool_choice": "none"}, {"tools": tools}, {"reasoning_effort": "low"}):
        chat = served.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1, **extra})
        count = served.post("/tokenize", json={"messages": HI, **extra}).json()["count"]
        assert count == chat.json()["usage"]["prompt_tokens"], extra


def test_an_embedding_server_does_not_generate(path):
    """With --is-embedding the model is served for embeddings (a classifier has no LM head at all);
    /generate and the OpenAI generation routes answered with text made from the embedding matrix."""
    s = Served(path, "--is-embedding")
    try:
        assert s.post("/v1/embeddings", json={"input": "hi"}).status_code == 200
        for route, body in (("/generate", {"text": "hi"}), ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                            ("/v1/chat/completions", {"messages": HI, "max_tokens": 2})):
            r = s.post(route, json=body)
            assert r.status_code == 400 and "--is-embedding" in r.json()["error"]["message"], route
        assert s.get("/health_generate").status_code == 200  # (an embedding checks its health)
    finally:
        s.close()
