"""SGLang's frontend language (``sglang`` 0.5.23, ``sglang.lang``) against a live ``core serve``.

The programs run through ``sgl.RuntimeEndpoint(base_url)``, the backend SGLang documents for a
running server: it reads ``GET /get_model_info`` once, then sends every ``sgl.gen`` /
``sgl.select`` as ``POST /generate`` (``text`` or batched ``input_ids``, ``sampling_params``
with the full SGLang set including ``stop_regex``, ``regex`` and ``json_schema``, and the
top-level ``return_logprob`` / ``logprob_start_len`` / ``top_logprobs_num`` /
``return_text_in_logprobs`` / ``stream``), ``POST /flush_cache`` and ``GET /server_info``.
The expectations are SGLang's documented behaviour for each primitive. ``stop_regex`` is also
checked on the raw ``/generate`` API, where SGLang keeps the text the pattern matched
(``trim_matched_stop`` only trims a literal stop string, never a regex match).

All generation is greedy (temperature 0) with a few tokens on the default model (SmolLM2).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import httpx
import pytest

from tests.compat.conftest import sglang_frontend
from tests.server_utils import default_server  # noqa: F401  (pytest fixture)

pytestmark = pytest.mark.slow

SGLANG_VERSION = "0.5.23"


# ---------------------------------------------------------------------------- helpers & fixtures
@pytest.fixture(scope="module")
def sgl() -> Any:
    module = sglang_frontend()
    assert module.__version__ == SGLANG_VERSION, f"these tests pin sglang {SGLANG_VERSION}, found {module.__version__}"
    return module


@pytest.fixture(scope="module")
def backend(sgl: Any, default_server: str) -> Any:  # noqa: F811
    return sgl.RuntimeEndpoint(default_server)


@pytest.fixture(scope="module")
def chatml_backend(sgl: Any, default_server: str) -> Any:  # noqa: F811
    """SmolLM2's chat format is ChatML; SGLang matches templates by model path and has no rule
    for SmolLM2, so the template is named explicitly, as SGLang documents for such models."""
    return sgl.RuntimeEndpoint(default_server, chat_template_name="chatml")


def finished(state: Any) -> Any:
    """Wait for a program and surface the error its executor thread swallowed (the frontend only
    warns and leaves the variable unset)."""
    state.sync()
    error = state.error()
    if error is not None:
        raise AssertionError(f"program failed in the frontend: {error!r}") from error
    return state


def assert_logprob_entries(entries: list, n: int | None = None) -> None:
    """SGLang's logprob entries: ``(logprob, token_id, token_text_or_None)`` with a finite logprob <= 0."""
    if n is not None:
        assert len(entries) == n
    for logprob, token_id, *_ in entries:
        assert isinstance(token_id, int)
        assert isinstance(logprob, float) and math.isfinite(logprob) and logprob <= 1e-6, logprob


# ---------------------------------------------------------------------------- the backend itself
def test_runtime_endpoint_reads_model_info(backend: Any) -> None:
    assert backend.model_info["is_generation"] is True
    assert isinstance(backend.get_model_name(), str) and backend.get_model_name()


def test_flush_cache_and_server_info(sgl: Any, backend: Any) -> None:
    backend.flush_cache()  # raises unless 200
    info = sgl.get_server_info(backend)
    assert isinstance(info, dict) and info


# ---------------------------------------------------------------------------- gen
def test_gen_max_tokens_greedy(sgl: Any, backend: Any) -> None:
    @sgl.function
    def count(s: Any) -> None:
        s += "Count: 1, 2, 3,"
        s += sgl.gen("rest", max_tokens=4, temperature=0)

    state = finished(count.run(backend=backend))
    meta = state.get_meta_info("rest")
    assert meta["completion_tokens"] == 4
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert state.text() == "Count: 1, 2, 3," + state["rest"]
    again = finished(count.run(backend=backend))
    assert again["rest"] == state["rest"]  # greedy is deterministic


def test_set_default_backend(sgl: Any, backend: Any) -> None:
    @sgl.function
    def count(s: Any) -> None:
        s += "Count: 1, 2, 3,"
        s += sgl.gen("rest", max_tokens=2, temperature=0)

    sgl.set_default_backend(backend)
    try:
        assert finished(count.run())["rest"]
    finally:
        sgl.set_default_backend(None)


def test_gen_stop_string_is_trimmed(sgl: Any, backend: Any) -> None:
    @sgl.function
    def count(s: Any) -> None:
        s += "Count: 1, 2, 3,"
        s += sgl.gen("next", max_tokens=8, temperature=0, stop=",")

    state = finished(count.run(backend=backend))
    assert state.get_meta_info("next")["finish_reason"] == {"type": "stop", "matched": ","}
    assert state["next"].strip().isdigit()  # the stop string itself is not in the output


def test_gen_stop_regex(sgl: Any, backend: Any) -> None:
    @sgl.function
    def digits(s: Any) -> None:
        s += "Numbers in words: one, two, three, four. In digits:"
        s += sgl.gen("out", max_tokens=32, temperature=0, stop_regex=r"\d")

    state = finished(digits.run(backend=backend))
    assert state.get_meta_info("out")["finish_reason"] == {"type": "stop", "matched": r"\d"}
    assert re.fullmatch(r"\D*\d", state["out"]), state["out"]  # ends on the first digit, kept


def test_roles_with_chat_template(sgl: Any, chatml_backend: Any) -> None:
    @sgl.function
    def chat(s: Any) -> None:
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user("What is the capital of France?")
        s += sgl.assistant(sgl.gen("answer", max_tokens=24, temperature=0))

    state = finished(chat.run(backend=chatml_backend))
    answer = state["answer"]
    assert state.text() == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                            f"<|im_start|>assistant\n{answer}<|im_end|>\n")
    assert "Paris" in answer
    assert state.get_meta_info("answer")["finish_reason"]["type"] == "stop"  # ended its own turn
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant"]
    assert state.messages()[-1]["content"] == answer


# ---------------------------------------------------------------------------- constrained decoding
def test_regex_constrained_gen(sgl: Any, backend: Any) -> None:
    ip = r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"

    @sgl.function
    def address(s: Any) -> None:
        s += "The IP address of localhost is "
        s += sgl.gen("ip", max_tokens=24, temperature=0, regex=ip)

    state = finished(address.run(backend=backend))
    assert re.fullmatch(ip, state["ip"]), state["ip"]


def test_json_schema_gen(sgl: Any, backend: Any) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}}}

    @sgl.function
    def person(s: Any) -> None:
        s += "Describe a person as JSON with a name and an age: "
        s += sgl.gen("person", max_tokens=48, temperature=0, json_schema=json.dumps(schema))

    state = finished(person.run(backend=backend))
    jsonschema.validate(json.loads(state["person"]), schema)


def test_gen_int_and_gen_string(sgl: Any, backend: Any) -> None:
    @sgl.function
    def quiz(s: Any) -> None:
        s += "Q: How many legs does a dog have?\nA: "
        s += sgl.gen_int("legs", max_tokens=4, temperature=0)
        s += "\nQ: What is the name of our planet?\nA: "
        s += sgl.gen_string("planet", max_tokens=12, temperature=0)

    state = finished(quiz.run(backend=backend))
    int(state["legs"])  # gen_int: REGEX_INT, then the " "/"\n" stop is trimmed
    assert re.fullmatch(r"\"[\w\d\s]*\"", state["planet"]), state["planet"]  # REGEX_STR


# ---------------------------------------------------------------------------- control flow
def test_fork_and_join(sgl: Any, backend: Any) -> None:
    @sgl.function
    def branches(s: Any) -> None:
        s += "Count: 1, 2, 3,"
        forks = s.fork(2)
        forks[0] += " 4, 5,"
        forks[1] += " 4, 5, 6,"
        forks += sgl.gen("next", max_tokens=6, temperature=0, stop=",")
        forks.join()

    state = finished(branches.run(backend=backend))
    assert state.text() == "Count: 1, 2, 3,"  # the branches do not write into the parent
    assert [n.strip() for n in state["next"]] == ["6", "7"]  # join gathers each fork's variable


def test_run_batch_keeps_order(sgl: Any, backend: Any) -> None:
    @sgl.function
    def count(s: Any, start: str) -> None:
        s += "Count: " + start
        s += sgl.gen("next", max_tokens=6, temperature=0, stop=",")

    starts = ["1, 2, 3,", "5, 6, 7,", "10, 11, 12,"]
    states = count.run_batch([{"start": x} for x in starts], backend=backend, num_threads=2)
    assert [finished(st)["next"].strip() for st in states] == ["4", "8", "13"]


def test_streaming_text_iter(sgl: Any, backend: Any) -> None:
    @sgl.function
    def count(s: Any) -> None:
        s += "Count: 1, 2, 3,"
        s += sgl.gen("rest", max_tokens=8, temperature=0)

    state = count.run(backend=backend, stream=True)
    pieces = list(state.text_iter("rest"))
    finished(state)
    assert len(pieces) > 1  # arrived incrementally, not in one block
    assert "".join(pieces) == state["rest"]
    assert state["rest"] == finished(count.run(backend=backend))["rest"]
    assert state.get_meta_info("rest")["finish_reason"] == {"type": "length", "length": 8}


# ---------------------------------------------------------------------------- logprobs and select
def test_gen_return_logprob_and_top_logprobs(sgl: Any, backend: Any) -> None:
    @sgl.function
    def capital(s: Any) -> None:
        s += "The capital of France is"
        s += sgl.gen("city", max_tokens=3, temperature=0, return_logprob=True, top_logprobs_num=3)

    state = finished(capital.run(backend=backend))
    meta = state.get_meta_info("city")
    assert "input_token_logprobs" in meta  # present whenever return_logprob is set
    outputs, tops = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert_logprob_entries(outputs, meta["completion_tokens"])
    assert len(tops) == len(outputs)
    for (logprob, token_id, *_), top in zip(outputs, tops):
        assert_logprob_entries(top, 3)
        assert [t[0] for t in top] == sorted((t[0] for t in top), reverse=True)
        assert top[0][1] == token_id and math.isclose(top[0][0], logprob, rel_tol=1e-4, abs_tol=1e-5)  # greedy = top-1


def test_gen_input_logprobs_from_start(sgl: Any, backend: Any) -> None:
    @sgl.function
    def capital(s: Any) -> None:
        s += "The capital of France is"
        s += sgl.gen("city", max_tokens=2, temperature=0, return_logprob=True, logprob_start_len=0,
                     return_text_in_logprobs=True)

    meta = finished(capital.run(backend=backend)).get_meta_info("city")
    inputs = meta["input_token_logprobs"]
    assert len(inputs) == meta["prompt_tokens"]
    assert inputs[0][0] is None  # the first prompt token has no logprob
    assert_logprob_entries(inputs[1:])
    assert "".join(t[2] for t in inputs) == "The capital of France is"


def test_logprob_entries_are_sglang_triples(sgl: Any, backend: Any) -> None:
    """SGLang always returns ``(logprob, token_id, text)`` entries, with ``None`` as the text
    unless ``return_text_in_logprobs`` is set."""
    @sgl.function
    def capital(s: Any) -> None:
        s += "The capital of France is"
        s += sgl.gen("city", max_tokens=2, temperature=0, return_logprob=True, top_logprobs_num=2)

    meta = finished(capital.run(backend=backend)).get_meta_info("city")
    for entry in meta["output_token_logprobs"] + [t for top in meta["output_top_logprobs"] for t in top]:
        assert len(entry) == 3 and entry[2] is None, entry


def test_select_token_length_normalized(sgl: Any, backend: Any) -> None:
    @sgl.function
    def capital(s: Any) -> None:
        s += "The capital of France is"
        s += sgl.select("city", choices=[" Paris", " London", " a banana"])

    state = finished(capital.run(backend=backend))
    assert state["city"] == " Paris"
    meta = state.get_meta_info("city")
    scores = meta["normalized_prompt_logprobs"]
    assert len(scores) == 3 and all(math.isfinite(x) for x in scores)
    assert scores[0] == max(scores)
    for choice, entries in zip([" Paris", " London", " a banana"], meta["input_token_logprobs"]):
        assert "".join(t[2] for t in entries).endswith(choice)  # text in logprobs, token healing undone


def test_select_unconditional_likelihood_normalized(sgl: Any, backend: Any) -> None:
    """The unconditional pass sends each choice's token ids as batched ``input_ids`` with
    ``return_logprob`` and no ``logprob_start_len``; it reads ``input_token_logprobs``."""
    choices = [" yes", " no"]

    @sgl.function
    def sky(s: Any) -> None:
        s += "Q: Is the sky blue on a clear day? Answer yes or no.\nA:"
        s += sgl.select("answer", choices=choices, choices_method=sgl.unconditional_likelihood_normalized)

    state = finished(sky.run(backend=backend))
    assert state["answer"] in choices
    meta = state.get_meta_info("answer")
    unconditional = meta["unconditional_token_logprobs"]
    assert len(unconditional) == len(choices) and all(unconditional)
    assert all(math.isfinite(x) for x in meta["normalized_unconditional_prompt_logprobs"])


# ---------------------------------------------------------------------------- the raw /generate API
def test_raw_generate_stop_regex_keeps_match(default_server: str) -> None:  # noqa: F811
    body = {"text": "Numbers in words: one, two, three, four. In digits:",
            "sampling_params": {"stop_regex": ["\\d"], "max_new_tokens": 64, "temperature": 0}}
    r = httpx.post(default_server + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "\\d"}
    assert re.fullmatch(r"\D*\d", out["text"]), out["text"]


def test_raw_generate_empty_stop_regex_list(default_server: str) -> None:  # noqa: F811
    """The frontend sends ``"stop_regex": []`` (and ``"regex": null``, ``"json_schema": null``)
    in every request."""
    body = {"text": "Count: 1, 2, 3,", "sampling_params": {
        "max_new_tokens": 2, "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [], "stop_regex": [],
        "temperature": 0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
        "presence_penalty": 0.0, "ignore_eos": False, "regex": None, "json_schema": None,
        "skip_special_tokens": True, "spaces_between_special_tokens": True}}
    r = httpx.post(default_server + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 2


def test_raw_generate_input_logprobs_without_start_len(default_server: str) -> None:  # noqa: F811
    body = {"input_ids": [[504, 3575, 282], [504, 3575]], "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True}
    r = httpx.post(default_server + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    for item in r.json():
        assert isinstance(item["meta_info"]["input_token_logprobs"], list)
