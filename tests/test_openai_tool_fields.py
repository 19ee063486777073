"""Tool-calling and request fields that were accepted but not honoured (each test failed before its fix):
a constrained answer under a reasoning parser whose output starts inside the think block,
``parallel_tool_calls: false`` with ``tool_choice: auto``, ``strict`` tools under ``auto``, and the
Responses and Messages APIs' unknown fields."""

from __future__ import annotations

import json
from typing import Any

import pytest
import xgrammar as xgr

from tests.test_robustness_limits import Served

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("get_weather", "get_time")]
CALL_W = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_T = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
STRICT = [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris"]}}, "required": ["city"],
    "additionalProperties": False}}}]
STRICT_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
HI = [{"role": "user", "content": "hi"}]


def _sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.fixture(scope="module")
def qwen(tiny_llama):
    s = Served(tiny_llama()[0], "--tool-call-parser", "qwen25")
    yield s
    s.close()


@pytest.fixture(scope="module")
def r1(tiny_llama):
    s = Served(tiny_llama()[0], "--reasoning-parser", "deepseek-r1", "--tool-call-parser", "qwen25")
    yield s
    s.close()


# ---- a constraint under a reasoning parser: the answer after the reasoning (SGLang's, vLLM's order)


def _chat(served, body: dict, stream: bool) -> tuple[str, str]:
    r = served.post("/v1/chat/completions", json={**body, "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        deltas = [c["choices"][0]["delta"] for c in _sse(r.text) if c["choices"]]
        return "".join(d.get("content") or "" for d in deltas), "".join(d.get("reasoning_content") or "" for d in deltas)
    msg = r.json()["choices"][0]["message"]
    return msg["content"] or "", msg.get("reasoning_content") or ""


ANSWER = {"ebnf": 'root ::= "{\\"a\\": 1}"'}


@pytest.mark.parametrize("stream", [False, True])
def test_a_constrained_answer_follows_the_reasoning(r1, stream):
    """deepseek-r1's output starts inside <think>: the reasoning runs free (the random model never
    closes it: no answer within max_tokens, as on SGLang) and the grammar holds what follows the
    end tag (here forced by a thinking budget of 3 tokens)."""
    body = {"messages": HI, "temperature": 0, "max_tokens": 30, **ANSWER}
    unconstrained = r1.post("/v1/chat/completions", json={**body, "ebnf": None, "logprobs": True}).json()["choices"][0]
    free = [t["token"] for t in unconstrained["logprobs"]["content"]]
    assert _chat(r1, body, stream) == ("", "".join(free))
    content, reasoning = _chat(r1, {**body, "thinking_token_budget": 3}, stream)
    assert (content, reasoning) == ('{"a": 1}', "".join(free[:3]))


def test_a_hybrid_models_first_token_decides_whether_it_reasons(tiny_llama):
    """qwen3's output reasons only if it opens <think>: the first token may be the grammar's or the
    tag's (then the rest of the tag is forced); thinking turned off keeps the grammar from the start."""
    s = Served(tiny_llama()[0], "--reasoning-parser", "qwen3")
    try:
        tok = s.engine.tokenizer
        lt = tok.encode("<", add_special_tokens=False)[0]
        body = {"messages": HI, "temperature": 0, "max_tokens": 40, **ANSWER}
        assert _chat(s, body, False) == ('{"a": 1}', "")  # (the model's first choice is the grammar's)
        opened = {**body, "logit_bias": {str(lt): 100}, "thinking_token_budget": 2}
        assert _chat(s, opened, False) == ('{"a": 1}', "<<")  # "<" opens <think>; two tokens of reasoning
        off = {**opened, "chat_template_kwargs": {"enable_thinking": False}}
        assert _chat(s, off, False) == ('{"a": 1}', "")
    finally:
        s.close()


class _Inner:
    """A grammar matcher that allows tokens 3 and 40 and ends after one token."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def fill_bitmask(self, bitmask, index):
        bitmask[index].zero_()
        bitmask[index, 0], bitmask[index, 1] = 1 << 3, 1 << 8

    def accept_token(self, token_id):
        self.seen.append(token_id)
        return token_id in (3, 40)

    def is_terminated(self):
        return bool(self.seen)

    def copy(self):
        return _Inner()


def _allowed(matcher) -> set[int]:
    import torch

    bitmask = torch.full((2, 2), -1, dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 1)
    return {t for t in range(64) if int(bitmask[1, t // 32]) >> (t % 32) & 1}


def test_after_reasoning_lets_the_reasoning_through_and_holds_the_answer():
    """core.engine.grammar.AfterReasoning: with an optional opener (<think> = 31, 63) the first
    token is the grammar's or the opener's (whose rest is then forced); the reasoning is free until
    the end tag (9, 10, matched across a false start); then the grammar holds, and ends the output."""
    from core.engine.grammar import AfterReasoning, ReasoningGate

    gate = ReasoningGate(end_ids=(9, 10), start_ids=(31, 63))
    m = AfterReasoning(_Inner(), gate)
    assert _allowed(m) == {3, 40, 31} and not m.is_terminated()
    assert m.accept_token(31) and _allowed(m) == {63} and m.accept_token(63)
    assert _allowed(m) == set(range(64))  # reasoning: anything
    for t in (5, 9, 9, 10):
        assert m.accept_token(t) and m.inner.seen == []
    assert _allowed(m) == {3, 40} and not m.is_terminated()
    assert not m.accept_token(5)  # (the inner grammar decides from here: it rejects 5)
    assert m.inner.seen == [5] and m.is_terminated()
    answer = AfterReasoning(_Inner(), gate)  # the first token is the grammar's: no reasoning
    assert answer.accept_token(40) and answer.inner.seen == [40] and answer.is_terminated()
    both = AfterReasoning(_Inner(), ReasoningGate(end_ids=(9,), start_ids=(3, 63)))  # 3: the tag's and the grammar's
    assert both.accept_token(3) and _allowed(both) == {3, 40, 63}  # still either
    assert both.accept_token(40) and both.state == "answer" and both.inner.seen == [3, 40]
    inside = AfterReasoning(_Inner(), ReasoningGate(end_ids=(9,)))  # output starts inside the reasoning
    assert _allowed(inside) == set(range(64)) and inside.accept_token(3) and inside.inner.seen == []
    assert inside.accept_token(9) and _allowed(inside) == {3, 40}
    assert isinstance(inside.copy(), AfterReasoning) and inside.copy().state == "think"


def test_a_required_tool_call_survives_a_reasoning_parser(r1):
    """The call follows the reasoning (closed here by a thinking budget), which is reasoning_content."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris"]}}, "required": ["city"],
        "additionalProperties": False}}}]
    body = {"messages": HI, "temperature": 0, "max_tokens": 200, "tools": tools, "tool_choice": "required",
            "parallel_tool_calls": False, "thinking_token_budget": 2}  # (the random model wanders in whitespace)
    r = r1.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["reasoning_content"]
    calls = choice["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert choice["finish_reason"] == "tool_calls"


def test_a_messages_json_answer_is_a_text_block(r1):
    """After the thinking block (its budget closes it), the JSON answer is the text block."""
    body = {"messages": HI, "max_tokens": 30, "temperature": 0, "thinking": {"type": "enabled", "budget_tokens": 2},
            "output_config": {"format": {"type": "json_schema", "schema": {"type": "object", "properties": {
                "a": {"type": "integer", "enum": [1]}}, "required": ["a"], "additionalProperties": False}}}}
    r = r1.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    blocks = r.json()["content"]
    assert [b["type"] for b in blocks] == ["thinking", "text"]
    assert json.loads(blocks[1]["text"]) == {"a": 1}


# ---- parallel_tool_calls: false under tool_choice auto


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_keeps_one_call(qwen, stream):
    """The output (dictated by the ebnf) holds two calls; at most one was asked for: the first."""
    body = {"messages": HI, "tools": TOOLS, "temperature": 0, "parallel_tool_calls": False, "stream": stream,
            "ebnf": "root ::= " + json.dumps(CALL_W + "\n" + CALL_T)}
    r = qwen.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [c for c in _sse(r.text) if c["choices"]]
        calls = [t for c in chunks for t in c["choices"][0]["delta"].get("tool_calls") or []]
        assert {t["index"] for t in calls} == {0}
        assert [t["function"]["name"] for t in calls if "id" in t] == ["get_weather"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    else:
        choice = r.json()["choices"][0]
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
        assert choice["finish_reason"] == "tool_calls"
    body["parallel_tool_calls"] = None  # the default: both
    body["stream"] = False
    calls = qwen.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]


# ---- strict tools under tool_choice auto


def test_strict_tools_under_auto_hold_the_calls_to_their_schemas(qwen):
    from core.server.openai.tools import _strict_auto

    r = type("R", (), {"tools": STRICT, "parallel_tool_calls": None})()
    kind, spec = _strict_auto(qwen.state, r)
    assert kind == "structural_tag"
    grammar = xgr.Grammar.from_structural_tag(spec)
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(["a"])).compile_grammar(grammar)

    def accepted(text: str) -> bool:
        return xgr.GrammarMatcher(compiled).accept_string(text)

    assert accepted("Sure, let me look that up. ")  # free text
    assert accepted("Sure. " + STRICT_CALL)  # a call that follows the schema
    assert not accepted("Sure. " + STRICT_CALL.replace("Paris", "Rome"))  # one that does not


def test_strict_tools_under_auto_are_constrained_through_the_api(qwen):
    from core.server.openai.chat import prepare_chat
    from core.server.openai.protocol import ChatCompletionRequest
    import msgspec

    r = msgspec.convert({"messages": HI, "tools": STRICT, "tool_choice": "auto"}, ChatCompletionRequest)
    assert json.loads(prepare_chat(qwen.state, r).reqs[0].params.structural_tag)["format"]["type"] == "triggered_tags"
    body = {"messages": HI, "tools": STRICT, "temperature": 0, "max_tokens": 8}
    assert qwen.post("/v1/chat/completions", json=body).status_code == 200
    # strict false, or no strict: nothing constrains the output
    loose = [{**STRICT[0], "function": {**STRICT[0]["function"], "strict": False}}]
    r = msgspec.convert({"messages": HI, "tools": loose, "tool_choice": "auto"}, ChatCompletionRequest)
    assert prepare_chat(qwen.state, r).reqs[0].params.structural_tag is None


def test_strict_tools_under_auto_without_a_call_format_go_unconstrained(tiny_llama):
    """As SGLang: no parser whose calls the grammar can hold (here none at all), so no constraint."""
    from core.server.openai.chat import prepare_chat
    from core.server.openai.protocol import ChatCompletionRequest
    import msgspec

    s = Served(tiny_llama()[0])  # no --tool-call-parser
    try:
        assert s.post("/v1/chat/completions", json={"messages": HI, "tools": STRICT, "max_tokens": 4}).status_code == 200
        r = msgspec.convert({"messages": HI, "tools": STRICT}, ChatCompletionRequest)
        assert prepare_chat(s.state, r).reqs[0].params.structural_tag is None
    finally:
        s.close()


def test_strict_tools_under_auto_leave_the_model_its_thinking(r1):
    """Their triggered tags hold only the calls: the reasoning parser stays as it is (the model thinks
    first) and a thinking budget still applies, unlike a constraint from the first token."""
    from core.server.openai.chat import prepare_chat
    from core.server.openai.protocol import ChatCompletionRequest
    import msgspec

    r = msgspec.convert({"messages": HI, "tools": STRICT, "thinking_token_budget": 4}, ChatCompletionRequest)
    job = prepare_chat(r1.state, r)
    assert job.plan.triggered and job.plan.reasoning_parser.force_reasoning is True
    assert job.reqs[0].params.thinking is not None and job.reqs[0].params.structural_tag is not None


# ---- unknown fields on /v1/responses and /v1/messages


@pytest.mark.parametrize("field,value", [("no_such_field", 1), ("n", 3), ("max_tool_calls", 1)])
def test_responses_refuses_unknown_fields(qwen, field, value):
    r = qwen.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_responses_takes_sglangs_penalties_and_stop(qwen):
    """SGLang's extras on /v1/responses are honoured: a stop string cuts the answer where the same
    request without it goes on."""
    base = {"input": "hi", "max_output_tokens": 12, "temperature": 0}
    full = qwen.post("/v1/responses", json=base).json()["output"][-1]["content"][0]["text"]
    assert len(full) > 3
    cut = qwen.post("/v1/responses", json={**base, "stop": [full[2:4]]}).json()["output"][-1]["content"][0]["text"]
    assert cut == full[:full.index(full[2:4])]
    for field in ("frequency_penalty", "presence_penalty"):
        assert qwen.post("/v1/responses", json={**base, field: 0.5}).status_code == 200
    ignored = qwen.post("/v1/responses", json={**base, "service_tier": "auto", "prompt_cache_key": "k"})
    assert ignored.status_code == 200


@pytest.mark.parametrize("field,value", [("no_such_field", 1), ("stop", ["a"]), ("n", 2), ("context_management", {})])
def test_messages_refuses_unknown_fields(qwen, field, value):
    r = qwen.post("/v1/messages", json={"messages": HI, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and field in r.json()["error"]["message"]
    r = qwen.post("/v1/messages/count_tokens", json={"messages": HI, field: value})
    assert r.status_code == 400, r.text


# ---- chat_template_kwargs keys the request's own fields set


def test_chat_template_kwargs_reserved_keys_are_honoured_or_refused(qwen):
    msgs = [*HI, {"role": "assistant", "content": "Hel"}]

    def usage(body: dict) -> Any:
        r = qwen.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1, **body})
        return r.json()["usage"]["prompt_tokens"] if r.status_code == 200 else (r.status_code, r.json()["error"]["param"])

    cont = usage({"continue_final_message": True})
    assert usage({"chat_template_kwargs": {"continue_final_message": True}}) == cont != usage({})
    assert usage({"chat_template_kwargs": {"add_generation_prompt": True}}) == usage({})
    assert usage({"chat_template_kwargs": {"add_generation_prompt": False}}) == \
        (400, "chat_template_kwargs.add_generation_prompt")
    for key in ("tools", "messages", "documents", "chat_template"):
        assert usage({"chat_template_kwargs": {key: []}}) == (400, f"chat_template_kwargs.{key}")


# ---- parsers whose markers are special tokens (gpt-oss)


def test_gpt_oss_parsers_keep_special_tokens_unless_the_request_sets_it(tiny_llama):
    from core.server.openai.chat import prepare_chat
    from core.server.openai.protocol import ChatCompletionRequest
    import msgspec

    for flags in (("--reasoning-parser", "gpt-oss"), ("--tool-call-parser", "gpt-oss"), ()):
        s = Served(tiny_llama()[0], *flags)
        try:
            def skip(**body: Any) -> bool:
                tools = {"tools": TOOLS} if "--tool-call-parser" in flags else {}
                r = msgspec.convert({"messages": HI, **tools, **body}, ChatCompletionRequest)
                return prepare_chat(s.state, r).reqs[0].params.skip_special_tokens
            assert skip() is (len(flags) == 0)  # harmony's channel markers reach the parser
            assert skip(skip_special_tokens=True) is True and skip(skip_special_tokens=False) is False
        finally:
            s.close()


# ---- logprob token text of a SentencePiece vocabulary


def test_sentencepiece_logprob_tokens_keep_their_word_spaces():
    """Llama-2 / Mistral's decoder strips the leading space of a decode (Strip(' ', 1, 0)); each
    logprob token was decoded alone, so '▁world' read 'world': joined tokens, bytes and
    completions' text_offset no longer matched the text (lm-eval finds continuations by them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from core.server.openai.logprobs import Offsets, Vocab

    words = ["Hello", "world", "how", "are", "you"]
    tk = Tokenizer(models.WordLevel({"<unk>": 0, **{"\u2581" + w: i + 1 for i, w in enumerate(words)},
                                     **{w: i + 10 for i, w in enumerate(words)}}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk)
    text = "Hello world how are you"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and tok.decode(ids[1:2]) == "world"  # alone, the space is gone
    vocab, offsets = Vocab(tok), Offsets()
    pieces = [vocab.get(t) for t in ids]
    assert [s for s, _ in pieces] == [" Hello", " world", " how", " are", " you"]
    assert b"".join(b for _, b in pieces).decode() == " " + text  # the first word's space, as the pieces hold it
    assert [offsets.add(b) for _, b in pieces] == [0, 6, 12, 16, 20]
    assert vocab.get(tok.convert_tokens_to_ids("world")) == ("world", b"world")  # no word start: no space


# ---- a thinking budget (vLLM's thinking_token_budget, Anthropic's thinking.budget_tokens)


def test_a_thinking_budget_closes_the_reasoning(r1):
    """The random tiny model never closes its think block: without a budget all 24 tokens are
    reasoning; with one, the reasoning parser's end tag is forced after that many tokens and the
    rest is the answer. Anthropic's budget_tokens was validated and then ignored."""
    tok = r1.engine.tokenizer
    body = {"messages": HI, "temperature": 0, "max_tokens": 24}
    choice = r1.post("/v1/chat/completions", json={**body, "logprobs": True}).json()["choices"][0]
    free, free_tokens = choice["message"], [t["token"] for t in choice["logprobs"]["content"]]
    assert free["content"] in (None, "") and free["reasoning_content"] == "".join(free_tokens)
    for budget in (0, 3):
        choice = r1.post("/v1/chat/completions", json={**body, "thinking_token_budget": budget, "logprobs": True}).json()[
            "choices"][0]
        msg, tokens = choice["message"], [t["token"] for t in choice["logprobs"]["content"]]
        assert (msg.get("reasoning_content") or "") == "".join(free_tokens[:budget]) == "".join(tokens[:budget])
        assert "".join(tokens[budget:budget + len(tok.encode("</think>", add_special_tokens=False))]) == "</think>"
        assert msg["content"], msg  # the answer after the forced end tag
    assert r1.post("/v1/chat/completions", json={**body, "thinking_token_budget": -2}).status_code == 400
    out = r1.post("/v1/messages", json={**body, "max_tokens": 24, "thinking": {"type": "enabled", "budget_tokens": 2}})
    blocks = out.json()["content"]
    assert [b["type"] for b in blocks][:1] == ["thinking"] and any(b["type"] == "text" for b in blocks)
    assert blocks[0]["thinking"] == "".join(free_tokens[:2])


def test_a_thinking_budget_needs_a_reasoning_parser(qwen):
    r = qwen.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 4, "thinking_token_budget": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget"
    # Anthropic's budget without a parser: nothing is read as reasoning, so it is ignored (logged)
    r = qwen.post("/v1/messages", json={"messages": HI, "max_tokens": 4,
                                        "thinking": {"type": "enabled", "budget_tokens": 2}})
    assert r.status_code == 200, r.text


def test_a_thinking_budget_leaves_an_answer_without_reasoning_alone():
    """A hybrid model's output is reasoning only if it opens <think>: nothing is forced otherwise
    (SamplingParams.thinking, which the server sets from the reasoning parser)."""
    from core.engine.sampling_params import ThinkingBudget

    forced = ThinkingBudget(2, (7, 8), start_ids=(5,))  # two tokens after <think> (5), as vLLM counts
    assert [forced.forced(out) for out in ([5, 1], [5, 1, 2], [5, 1, 2, 7], [5, 1, 2, 7, 8])] == [None, 7, 8, None]
    assert forced.forced([4, 1, 2]) is None  # no <think>: an answer
    assert forced.forced([5, 7, 8]) is None  # closed within the budget
    plain = ThinkingBudget(0, (9,))
    assert plain.forced([]) == 9 and plain.forced([9]) is None


# ---- the Messages API's usage, the Responses API's items


def test_messages_usage_counts_cache_reads_apart_streamed_or_not(qwen):
    """Anthropic's total input is input_tokens + cache_read + cache_creation; input_tokens counted
    the cached prompt tokens too, and a stream's usage never said what the cache held."""
    body = {"messages": [{"role": "user", "content": "hello hello"}], "max_tokens": 3, "temperature": 0}
    prompt = qwen.post("/v1/messages/count_tokens", json={"messages": body["messages"]}).json()["input_tokens"]
    qwen.post("/v1/messages", json=body)
    usage = qwen.post("/v1/messages", json=body).json()["usage"]  # the prompt is in the prefix cache now
    assert usage["cache_read_input_tokens"] > 0
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"] == prompt
    streamed = qwen.post("/v1/messages", json={**body, "stream": True}).text
    delta = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: ")
             and '"message_delta"' in line][0]["usage"]
    assert delta == usage


def test_responses_output_sent_back_as_input_is_one_assistant_turn():
    """A response's output splits one assistant turn into a message and function_call items; sent back
    as input (as clients do without previous_response_id) they became two assistant turns."""
    from core.server.openai.responses import input_items, item_messages

    items = input_items([
        {"role": "user", "content": "weather?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sure."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sun"},
    ])
    msgs = item_messages(items)
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool"]
    assert msgs[1]["content"] == "Sure." and [c["id"] for c in msgs[1]["tool_calls"]] == ["c1", "c2"]
    assert items[0]["content"] == [{"type": "input_text", "text": "weather?"}]  # listed as the API types it


def test_responses_input_items_list_content_as_parts(qwen):
    r = qwen.post("/v1/responses", json={"input": [{"role": "user", "content": "hi"}], "max_output_tokens": 2})
    listed = qwen.get(f"/v1/responses/{r.json()['id']}/input_items").json()["data"]
    assert listed[0]["content"] == [{"type": "input_text", "text": "hi"}]


def test_text_on_both_sides_of_calls_is_not_glued(qwen):
    """The chat view drops the whitespace touching a call; the text before and after calls was then
    glued into one word ("Sure.And also:"). A line apart now, streamed and not."""
    body = {"messages": HI, "tools": TOOLS, "temperature": 0,
            "ebnf": "root ::= " + json.dumps("Sure.\n" + CALL_W + "\nAnd also:\n" + CALL_T)}
    msg = qwen.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert msg["content"] == "Sure.\nAnd also:" and len(msg["tool_calls"]) == 2
    chunks = _sse(qwen.post("/v1/chat/completions", json={**body, "stream": True}).text)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == msg["content"]


def test_usage_counts_the_reasoning_tokens(r1, qwen):
    """SGLang's usage.reasoning_tokens and OpenAI's completion_tokens_details.reasoning_tokens: the
    tokens through the end tag (all of them while the reasoning is open); none without a parser."""
    from core.server.openai.job import reasoning_tokens

    end = tuple(r1.engine.tokenizer.encode("</think>", add_special_tokens=False))
    body = {"messages": HI, "temperature": 0, "max_tokens": 24}
    open_ = r1.post("/v1/chat/completions", json=body).json()["usage"]
    assert open_["reasoning_tokens"] == open_["completion_tokens"] == 24
    assert open_["completion_tokens_details"] == {"reasoning_tokens": 24}
    closed = r1.post("/v1/chat/completions", json={**body, "thinking_token_budget": 3}).json()["usage"]
    assert closed["reasoning_tokens"] == 3 + len(end) < closed["completion_tokens"]
    streamed = [c for c in _sse(r1.post("/v1/chat/completions", json={
        **body, "thinking_token_budget": 3, "stream": True, "stream_options": {"include_usage": True}}).text)
        if c.get("usage")]
    assert streamed[-1]["usage"]["reasoning_tokens"] == 3 + len(end)
    plain = qwen.post("/v1/chat/completions", json=body).json()["usage"]
    assert plain["reasoning_tokens"] == 0 and "completion_tokens_details" not in plain
    assert reasoning_tokens([7, 1, 2, 8, 9, 3], (8, 9), (7,)) == 5 and reasoning_tokens([4, 8, 9], (8, 9), (7,)) == 0


def test_a_responses_usage_counts_its_reasoning_tokens_as_chat_does(r1):
    """(The random model never closes its reasoning: all 16 tokens are reasoning, in tokens.)"""
    usage = r1.post("/v1/responses", json={"input": "hi", "temperature": 0, "max_output_tokens": 16}).json()["usage"]
    chat = r1.post("/v1/chat/completions", json={"messages": HI, "temperature": 0, "max_tokens": 16}).json()["usage"]
    assert usage["output_tokens_details"]["reasoning_tokens"] == chat["reasoning_tokens"] == 16
