"""lm-evaluation-harness (``lm_eval.simple_evaluate``) against a live ``core serve``, on tiny tasks
written into ``tmp_path`` (YAML configs over a local JSONL file, read by datasets' ``json`` builder):

- ``local-completions`` with ``tokenizer_backend=remote`` (the server's ``/tokenizer_info``,
  ``/tokenize``, ``/detokenize``, as lm-eval uses them on vLLM): loglikelihood
  (``multiple_choice``), ``loglikelihood_rolling`` and ``generate_until``, prompts sent as token ids
  with ``echo`` + ``logprobs``;
- ``local-completions`` without a tokenizer (``tokenizer_backend=none``): ``generate_until`` on text;
- ``local-chat-completions`` with ``apply_chat_template=True``: ``generate_until``.

Nothing may reach the network: the Hugging Face offline switches are set, and every socket
connection to a non-loopback address fails the test."""

from __future__ import annotations

import ipaddress
import json
import math
import socket
from pathlib import Path

import pytest

from tests.compat.conftest import MODEL, client

pytestmark = pytest.mark.slow

MC_DOCS = [
    {"question": "What is the capital of France?", "choices": ["Paris", "Tokyo", "a banana"], "label": 0},
    {"question": "What color is the sky on a clear day?", "choices": ["green", "blue", "loud"], "label": 1},
    {"question": "How many legs does a cat have?", "choices": ["four", "seven", "none"], "label": 0},
]
ROLLING_DOCS = [{"text": "The quick brown fox jumps over the lazy dog."},
                {"text": "Paris is the capital and largest city of France."}]
GEN_DOCS = [{"question": "What is the capital of France?", "answer": "Paris"},
            {"question": "What is two plus two?", "answer": "four"}]


def _task(name: str, data: Path, cache: Path, body: str) -> str:
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
            f"  cache_dir: {json.dumps(str(cache))}\ntest_split: test\n{body}\nmetadata:\n  version: 1.0\n")


TASKS = {
    "compat_mc": (MC_DOCS, """output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: "{{label}}"
metric_list:
  - metric: acc
  - metric: acc_norm"""),
    "compat_rolling": (ROLLING_DOCS, """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte"""),
    "compat_gen": (GEN_DOCS, """output_type: generate_until
doc_to_text: "Q: {{question}}\\nA:"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    ignore_case: true
    ignore_punctuation: true"""),
}


@pytest.fixture
def no_network(monkeypatch):
    """Hugging Face offline mode, and a socket guard: a connection anywhere but loopback raises and
    is recorded (the test then fails even if the caller swallowed the error)."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    try:  # the switches are read at import: patch the modules already imported too
        import datasets.config
        monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
        monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    except ImportError:
        pass
    try:
        import huggingface_hub.constants
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    except ImportError:
        pass
    attempts: list = []

    def loopback(address) -> bool:
        if isinstance(address, tuple):
            host = address[0]
        elif isinstance(address, (str, bytes)):
            return True  # a unix socket path
        else:
            return False
        if host in ("localhost", ""):
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    real_connect, real_connect_ex, real_getaddrinfo = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo

    def connect(self, address):
        if not loopback(address):
            attempts.append(address)
            raise OSError(f"compat test: network access to {address!r} blocked")
        return real_connect(self, address)

    def connect_ex(self, address):
        if not loopback(address):
            attempts.append(address)
            raise OSError(f"compat test: network access to {address!r} blocked")
        return real_connect_ex(self, address)

    def getaddrinfo(host, *a, **kw):
        if not loopback((host.decode() if isinstance(host, bytes) else host or "", 0)):
            attempts.append(host)
            raise socket.gaierror(f"compat test: name lookup of {host!r} blocked")
        return real_getaddrinfo(host, *a, **kw)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield
    assert not attempts, f"lm-eval tried to reach the network: {attempts}"


@pytest.fixture
def task_manager(tmp_path):
    for name, (docs, body) in TASKS.items():
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (tmp_path / f"{name}.yaml").write_text(_task(name, data, tmp_path / "hf-cache", body))
    lm_eval_tasks = client("lm_eval.tasks")
    return lm_eval_tasks.TaskManager(include_path=str(tmp_path), include_defaults=False)


def _evaluate(task_manager, model: str, model_args: dict, tasks: list[str], **kw) -> dict:
    lm_eval = client("lm_eval")
    out = lm_eval.simple_evaluate(model=model, model_args={"model": MODEL, "max_retries": 1, **model_args},
                                  tasks=tasks, task_manager=task_manager, bootstrap_iters=0, **kw)
    assert out is not None and set(tasks) <= set(out["results"]), out and out.get("results")
    return out


def _in_unit(x) -> bool:
    return isinstance(x, (int, float)) and 0.0 <= x <= 1.0


def _check_gen(out, task="compat_gen") -> None:
    assert _in_unit(out["results"][task]["exact_match,none"]), out["results"][task]
    replies = [s["resps"][0][0] for s in out["samples"][task]]
    assert len(replies) == len(GEN_DOCS) and all(isinstance(r, str) for r in replies), replies
    assert any(r.strip() for r in replies), replies


def test_local_completions_remote_tokenizer(compat_server, task_manager, no_network):
    out = _evaluate(task_manager, "local-completions",
                    {"base_url": compat_server + "/v1/completions", "tokenizer_backend": "remote"},
                    ["compat_mc", "compat_rolling", "compat_gen"])
    mc = out["results"]["compat_mc"]
    assert _in_unit(mc["acc,none"]) and _in_unit(mc["acc_norm,none"]), mc
    for sample in out["samples"]["compat_mc"]:  # one (loglikelihood, is_greedy) per choice
        for ((ll, greedy),) in sample["resps"]:
            assert math.isfinite(ll) and ll < 0 and isinstance(greedy, bool), sample["resps"]
    rolling = out["results"]["compat_rolling"]
    for key in ("word_perplexity,none", "byte_perplexity,none"):
        assert math.isfinite(rolling[key]) and rolling[key] >= 1.0, rolling
    assert math.isfinite(rolling["bits_per_byte,none"]) and rolling["bits_per_byte,none"] > 0, rolling
    _check_gen(out)


def test_local_completions_text_generate(compat_server, task_manager, no_network):
    out = _evaluate(task_manager, "local-completions",
                    {"base_url": compat_server + "/v1/completions", "tokenizer_backend": "none",
                     "tokenized_requests": False}, ["compat_gen"])
    _check_gen(out)


def test_local_chat_completions_generate(compat_server, task_manager, no_network):
    out = _evaluate(task_manager, "local-chat-completions", {"base_url": compat_server + "/v1/chat/completions"},
                    ["compat_gen"], apply_chat_template=True)
    _check_gen(out)
