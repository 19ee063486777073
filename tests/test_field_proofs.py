"""Proofs of request fields and engine arguments honoured without an end-to-end test elsewhere
(issue 41): ``tests/test_field_walker.py``'s classification table names these tests. Over the
walker's tiny model and in-process app."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from pathlib import Path
from typing import Any

import pytest

from tests.test_field_walker import MSGS, PROMPT, App, app, embed_app, model_path  # noqa: F401 (fixtures)


def test_engine_args_reach_the_engine(app: App) -> None:
    """Options without an end-to-end test elsewhere reach what they configure (the module app runs
    with max_prefill_tokens, schedule_conservativeness, radix_eviction_policy, random_seed,
    cpu_threads and strict_plugins set)."""
    import torch

    from core.engine.scheduler import INIT_NEW_TOKEN_RATIO

    eng = app.engine
    assert eng.scheduler.max_prefill_tokens == 4000
    assert eng.scheduler.init_new_token_ratio == pytest.approx(min(INIT_NEW_TOKEN_RATIO * 2.0, 1.0))
    assert eng.tree_cache.eviction_policy == "lfu"
    assert eng.sampler.generator.initial_seed() == 5
    assert torch.get_num_threads() == 1  # cpu_threads
    assert eng.args.strict_plugins is True and eng.args.plugins is None


def test_engine_plugins_and_strict_plugins_reach_load_plugins(model_path: Path, monkeypatch) -> None:
    import core.engine.async_engine as ae
    from core.engine.config import engine_args_from_kwargs

    seen = {}

    class Stop(Exception):
        pass

    def fake(allow: Any, strict: bool = False) -> Any:
        seen.update(allow=allow, strict=strict)
        raise Stop

    monkeypatch.setattr(ae, "load_plugins", fake)
    with pytest.raises(Stop):
        ae.AsyncEngine(engine_args_from_kwargs({"model_path": str(model_path), "device": "cpu",
                                                "plugins": "core-builtin", "strict_plugins": True}))
    assert seen == {"allow": "core-builtin", "strict": True}


def test_log_metrics_false_keeps_a_generate_out_of_the_metrics(app: App) -> None:
    def count() -> float:
        text = app.run_async(app.client.get("/metrics")).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("sglang:num_requests_total") or line.startswith("core:num_requests_total"))

    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
    before = count()
    assert app.post("/generate", {**body, "log_metrics": False}).status_code == 200
    assert count() == before
    assert app.post("/generate", body).status_code == 200
    assert count() == before + 1


def test_abort_all_gives_its_message_and_update_aborts_running_requests(app: App, model_path: Path) -> None:
    long = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True, "temperature": 0}}

    async def run(path: str, body: dict) -> dict:
        task = asyncio.ensure_future(app.client.post("/generate", json=long))
        for _ in range(2000):
            if app.engine.num_running():
                break
            await asyncio.sleep(0.001)
        r = await app.client.post(path, json=body)
        assert r.status_code == 200, r.text
        return (await task).json()

    out = app.run_async(run("/abort_request", {"abort_all": True, "abort_message": "bye now"}))
    assert out["meta_info"]["finish_reason"] == {"type": "abort", "message": "bye now"}, out
    out = app.run_async(run("/update_weights_from_disk", {"model_path": str(model_path), "abort_all_requests": True}))
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and len(out["output_ids"]) < 200, out


def test_profile_options_reach_the_torch_profiler(app: App, tmp_path: Path, monkeypatch) -> None:
    import core.engine.profiler as prof_mod

    real, seen = prof_mod.torch.profiler.profile, {}

    def spy(**kwargs: Any) -> Any:
        seen.update(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(prof_mod.torch.profiler, "profile", spy)
    r = app.post("/start_profile", {"output_dir": str(tmp_path), "activities": ["CPU"], "with_stack": True,
                                    "record_shapes": True, "num_steps": 1})
    assert r.status_code == 200, r.text
    app.post("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    app.post("/stop_profile", {})
    import torch

    assert seen["with_stack"] is True and seen["record_shapes"] is True
    assert list(seen["activities"]) == [torch.profiler.ProfilerActivity.CPU]


def test_tokenize_template_options_change_the_count(app: App) -> None:
    """/tokenize's template options reach the template (as chat's ``documents`` does), and
    /detokenize's ``tokens`` / ``skip_special_tokens`` are honoured."""
    def count(**kw: Any) -> int:
        r = app.post("/tokenize", {"messages": MSGS, **kw})
        assert r.status_code == 200, r.text
        return r.json()["count"]

    plain = count()
    tool = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
    assert count(tools=[tool]) != plain
    assert count(messages=[*MSGS, {"role": "assistant", "content": "ok"}], continue_final_message=True) != \
        count(messages=[*MSGS, {"role": "assistant", "content": "ok"}])
    assert count(chat_template_kwargs={"greeting": "x" * 20}) > plain
    chat = {"messages": MSGS, "max_tokens": 1}
    a = app.post("/v1/chat/completions", chat).json()["usage"]["prompt_tokens"]
    b = app.post("/v1/chat/completions", {**chat, "documents": [{"title": "t", "text": "some text"}]}).json()
    assert b["usage"]["prompt_tokens"] > a, b
    ids = app.post("/tokenize", {"prompt": "hello", "add_special_tokens": False}).json()["tokens"]
    assert app.post("/detokenize", {"tokens": ids}).json()["text"] == "hello"
    eos = app.engine.tokenizer.eos_token_id
    with_eos = ids + [eos]
    kept = app.post("/detokenize", {"tokens": with_eos, "skip_special_tokens": False}).json()["text"]
    dropped = app.post("/detokenize", {"tokens": with_eos, "skip_special_tokens": True}).json()["text"]
    assert dropped == "hello" and kept != dropped


def test_messages_sampling_fields_reach_the_chat_request() -> None:
    from core.server.anthropic import MessagesRequest, chat_request

    r = chat_request(MessagesRequest(messages=MSGS, max_tokens=5, temperature=0.5, top_p=0.9, top_k=3,
                                     thinking={"type": "disabled"}))
    assert (r.temperature, r.top_p, r.top_k, r.max_completion_tokens or r.max_tokens) == (0.5, 0.9, 3, 5)
    assert r.chat_template_kwargs and r.chat_template_kwargs.get("enable_thinking") is False


def test_responses_fields_reach_the_chat_request(app: App) -> None:
    """The Responses API's sampling and template fields become the chat request's; ``request_id``
    is the response id, ``metadata`` and ``user`` come back in the response object."""
    from core.server.openai.responses import ResponsesRequest, chat_request

    fields = dict(text={"format": {"type": "json_object"}}, temperature=0.5, top_p=0.9, top_k=3, min_p=0.1,
                  repetition_penalty=1.2, seed=4, ignore_eos=True, chat_template_kwargs={"a": 1}, request_id="abc",
                  priority=2, metadata={"k": "v"}, user="u", frequency_penalty=0.3, presence_penalty=0.4, stop=["x"])
    c = chat_request(ResponsesRequest(input="hi", **fields), [], [{"type": "message", "role": "user", "content": "hi"}])
    assert c.response_format == {"type": "json_object"}
    assert (c.temperature, c.top_p, c.top_k, c.min_p, c.repetition_penalty, c.seed, c.ignore_eos, c.priority) == \
        (0.5, 0.9, 3, 0.1, 1.2, 4, True, 2)
    assert (c.frequency_penalty, c.presence_penalty, c.stop) == (0.3, 0.4, ["x"])
    assert c.chat_template_kwargs == {"a": 1} and c.user == "u"
    r = app.post("/v1/responses", {"input": "hi", "max_output_tokens": 2, "request_id": "resp_walker",
                                   "metadata": {"k": "v"}, "user": "u", "store": False, "top_logprobs": 2,
                                   "include": ["message.output_text.logprobs"]})
    assert r.status_code == 200, r.text
    out = r.json()
    assert (out["id"], out["metadata"], out["user"], out["store"]) == ("resp_walker", {"k": "v"}, "u", False)
    lps = [lp for item in out["output"] for part in item.get("content") or [] for lp in part.get("logprobs") or []]
    assert lps and all(len(lp["top_logprobs"]) == 2 for lp in lps), out["output"]


def test_embeddings_base64_is_the_float_vector(embed_app: App) -> None:
    f = embed_app.post("/v1/embeddings", {"input": PROMPT}).json()["data"][0]["embedding"]
    b = embed_app.post("/v1/embeddings", {"input": PROMPT, "encoding_format": "base64"}).json()["data"][0]["embedding"]
    raw = base64.b64decode(b)
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(f)
    r = embed_app.post("/encode", {"text": "hello"})
    assert r.status_code == 200 and len(r.json()["embedding"]) == len(f), r.text


def test_continuous_usage_stats_puts_the_usage_in_every_chunk(app: App) -> None:
    def chunks(path: str, body: dict) -> list[dict]:
        r = app.post(path, {**body, "stream": True, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        assert r.status_code == 200, r.text
        return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]

    for path, body in (("/v1/chat/completions", {"messages": MSGS}), ("/v1/completions", {"prompt": "hi"})):
        got = chunks(path, body)
        assert got and all(isinstance(c.get("usage"), dict) for c in got), (path, got)
        with_choices = [c for c in got if c["choices"]]
        assert with_choices[-1]["usage"]["completion_tokens"] == 4
        assert got[-1]["usage"]["completion_tokens"] == 4 and not got[-1]["choices"]
        # the prompt counts from the first chunk on (chat's role chunk came before any output), as in vLLM
        assert {c["usage"]["prompt_tokens"] for c in got} == {got[-1]["usage"]["prompt_tokens"]} != {0}, (path, got)
