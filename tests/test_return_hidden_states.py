"""SGLang's ``return_hidden_states`` and ``--enable-return-hidden-states`` / ``--return-hidden-states-mode``
(core.engine.hidden_states): the last layer's hidden states after the final norm, compared with
transformers' own (``output_hidden_states=True``, the same fp32 weights) for the prompt and for the
generated tokens, through the offline Engine, /generate and the OpenAI endpoints, streaming and
not, in batches that mix requests with and without the field; under continuous decode steps and
overlap scheduling (with device-side tokens) too. SGLang 0.5.23's shape: ``True`` gives
``[prompt rows, one vector per generated token fed back]`` (n entries for n tokens), ``"last"`` the
newest vector; a server without the flag refuses the request."""

from __future__ import annotations

import json

import pytest
import torch

from core.errors import CoreError
from tests.conftest import assert_pool_free, greedy, make_engine
from tests.model_utils import prompt
from tests.server_utils import serve_in_process

ATOL = 1e-4
PROMPTS = [prompt(7, 1), prompt(11, 2), prompt(5, 3)]
N = 5


def fixed(n: int) -> dict:
    """Greedy, exactly ``n`` tokens, nothing read between two of them (``min_new_tokens`` would keep
    continuous decode steps to one)."""
    return {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}


def hf_rows(hf, ids: list[int]) -> torch.Tensor:
    """transformers' last hidden states (after the final norm) of every position of ``ids``."""
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[-1][0].float()


def check_full(hf, p: list[int], out: dict) -> None:
    """``meta_info["hidden_states"]`` of a ``True`` request: the prompt's rows, then one vector per
    generated token but the last, each equal to transformers' states at those positions."""
    ids, hs = out["output_ids"], out["meta_info"]["hidden_states"]
    ref = hf_rows(hf, p + ids[:-1])
    assert len(hs) == len(ids), (len(hs), len(ids))
    prompt_rows = torch.tensor(hs[0])
    assert prompt_rows.shape == (len(p), hf.config.hidden_size)
    torch.testing.assert_close(prompt_rows, ref[: len(p)], atol=ATOL, rtol=0)
    assert all(len(v) == hf.config.hidden_size and isinstance(v[0], float) for v in hs[1:])
    gen = torch.tensor(hs[1:]).reshape(len(ids) - 1, hf.config.hidden_size)
    torch.testing.assert_close(gen, ref[len(p):], atol=ATOL, rtol=0)
    # (after the final norm: the LM head over these rows gives the tokens that came next, EOS aside
    # where min_new_tokens blocked it)
    with torch.no_grad():
        logits = hf.lm_head(ref[len(p) - 1 :])
    assert all(row.argmax() in (t, hf.config.eos_token_id) for row, t in zip(logits, ids))


def check_last(hf, p: list[int], out: dict) -> None:
    ids, hs = out["output_ids"], out["meta_info"]["hidden_states"]
    ref = hf_rows(hf, p + ids[:-1])
    assert len(hs) == hf.config.hidden_size and isinstance(hs[0], float)
    torch.testing.assert_close(torch.tensor(hs), ref[-1], atol=ATOL, rtol=0)


def check_mixed_batch(eng, hf, sampling: dict | None = None) -> None:
    outs = eng.generate(input_ids=PROMPTS, sampling_params=sampling or greedy(N),
                        return_hidden_states=[True, False, "last"])
    check_full(hf, PROMPTS[0], outs[0])
    assert "hidden_states" not in outs[1]["meta_info"]
    check_last(hf, PROMPTS[2], outs[2])
    assert_pool_free(eng)


def test_offline_engine_returns_transformers_hidden_states(tiny_llama):
    """A batch mixing True, none and "last" (its decodes: the CPU's fused decode step), then streaming."""
    path, hf = tiny_llama()
    eng = make_engine(path, enable_return_hidden_states=True)
    try:
        check_mixed_batch(eng, hf)
        one = eng.generate(input_ids=PROMPTS[1], sampling_params=greedy(1), return_hidden_states=True)
        assert len(one["meta_info"]["hidden_states"]) == 1  # only the prompt's entry: a one-token output
        check_full(hf, PROMPTS[1], one)
        chunks = list(eng.generate(input_ids=PROMPTS[0], sampling_params=greedy(N), return_hidden_states=True,
                                   stream=True))
        for c in chunks:  # cumulative, as SGLang streams them: one entry per token so far
            assert len(c["meta_info"]["hidden_states"]) == len(c["output_ids"])
        check_full(hf, PROMPTS[0], chunks[-1])
        # a prefix cached by an earlier request still gets every prompt row
        again = eng.generate(input_ids=PROMPTS[0], sampling_params=greedy(2), return_hidden_states=True)
        check_full(hf, PROMPTS[0], again)
    finally:
        eng.shutdown()


def test_without_the_flag_requests_are_refused_as_sglang_does(tiny_llama):
    path, hf = tiny_llama()
    eng = make_engine(path)
    try:
        with pytest.raises(ValueError, match="not configured to return hidden states"):
            eng.generate(input_ids=PROMPTS[0], sampling_params=greedy(2), return_hidden_states=True)
        with pytest.raises(ValueError, match="not configured to return hidden states"):
            eng.generate(input_ids=PROMPTS[0], sampling_params=greedy(2), return_hidden_states="last")
        out = eng.generate(input_ids=PROMPTS[0], sampling_params=greedy(2), return_hidden_states=False)
        assert "hidden_states" not in out["meta_info"]
    finally:
        eng.shutdown()
    eng = make_engine(path, return_hidden_states_mode="last")
    try:
        with pytest.raises(ValueError, match="exceeds the server maximum `last`"):
            eng.generate(input_ids=PROMPTS[0], sampling_params=greedy(2), return_hidden_states=True)
        with pytest.raises(ValueError, match="boolean or the string literal 'last'"):
            eng.generate(input_ids=PROMPTS[0], sampling_params=greedy(2), return_hidden_states="all")
        check_last(hf, PROMPTS[0], eng.generate(input_ids=PROMPTS[0], sampling_params=greedy(3),
                                                return_hidden_states="last"))
    finally:
        eng.shutdown()
    with pytest.raises(CoreError, match="return-hidden-states-mode"):
        make_engine(path, return_hidden_states_mode="everything")


def test_continuous_decode_steps_give_every_step_its_state(tiny_llama):
    """--num-continuous-decode-steps 4: a batch holding a request that asked runs single steps (each
    step's state kept); one without such a request still runs its steps together."""
    path, hf = tiny_llama()
    eng = make_engine(path, enable_return_hidden_states=True, num_continuous_decode_steps=4)
    steps: list[int] = []
    eng.engine.step_listeners.append(lambda batch, _: steps.append(batch.steps_run))
    try:
        check_mixed_batch(eng, hf, fixed(9))
        assert set(steps) == {1}, steps  # (no request waits: only the hidden states keep them single)
        steps.clear()
        plain = eng.generate(input_ids=PROMPTS, sampling_params=fixed(9))
        assert all("hidden_states" not in o["meta_info"] for o in plain)
        assert max(steps) > 1, steps  # the fast path stays for batches that did not ask
    finally:
        eng.shutdown()


def test_overlap_scheduling_with_device_side_tokens(tiny_llama):
    path, hf = tiny_llama()
    eng = make_engine(path, enable_return_hidden_states=True, enable_overlap_schedule=True)
    eng.engine.runner.defer_results = True  # (as on a GPU: tests.conftest's overlap runs)
    try:
        assert eng.engine.overlap
        check_mixed_batch(eng, hf, greedy(8))
        check_mixed_batch(eng, hf, fixed(8))
    finally:
        eng.shutdown()


class AlwaysDrafter:
    """Drafts three copies of the last token, whatever the context."""

    def propose(self, state: dict, tokens, max_tokens: int) -> list[int]:
        return [tokens[-1]] * min(3, max_tokens)


def test_speculative_decoding_decodes_such_batches_plainly(tiny_llama):
    """A batch holding a request that asked verifies no drafts (every token one forward's); one
    without such a request still does."""
    path, hf = tiny_llama()
    eng = make_engine(path, enable_return_hidden_states=True, speculative_algorithm="NGRAM")
    eng.engine.scheduler.speculator.drafter = AlwaysDrafter()
    verifies: list[bool] = []
    eng.engine.step_listeners.append(lambda batch, _: verifies.append(batch.drafts is not None))
    try:
        check_mixed_batch(eng, hf, fixed(12))
        assert not any(verifies)
        eng.generate(input_ids=PROMPTS, sampling_params=fixed(12))
        assert any(verifies)
    finally:
        eng.shutdown()


# ----------------------------------------------------------------------------- HTTP
def _serve(path, calls, **engine_kwargs):
    """Run ``calls(client)`` against an in-process app over an engine with ``engine_kwargs``."""
    from core.server.args import ServerArgs

    chat = ServerArgs(chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    return serve_in_process({"model_path": str(path), "max_total_tokens": 1024, **engine_kwargs}, chat, calls)


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_generate_endpoint_batch_and_stream(tiny_llama):
    path, hf = tiny_llama()

    async def calls(c):
        batch = await c.post("/generate", json={"input_ids": PROMPTS, "sampling_params": greedy(N),
                                                "return_hidden_states": [True, False, "last"]})
        one = await c.post("/generate", json={"input_ids": PROMPTS[1], "sampling_params": greedy(N),
                                              "return_hidden_states": True})
        stream = await c.post("/generate", json={"input_ids": PROMPTS[2], "sampling_params": greedy(N),
                                                 "return_hidden_states": True, "stream": True})
        return batch, one, stream

    batch, one, stream = _serve(path, calls, enable_return_hidden_states=True)
    assert batch.status_code == 200, batch.text
    outs = batch.json()
    check_full(hf, PROMPTS[0], outs[0])
    assert "hidden_states" not in outs[1]["meta_info"]
    check_last(hf, PROMPTS[2], outs[2])
    assert one.status_code == 200, one.text
    check_full(hf, PROMPTS[1], one.json())
    events = _events(stream.text)
    assert events and all(len(e["meta_info"]["hidden_states"]) == len(e["output_ids"]) for e in events)
    check_full(hf, PROMPTS[2], events[-1])


def test_openai_endpoints_carry_the_last_tokens_state(tiny_llama):
    """SGLang's OpenAI extension: a choice's ``hidden_states`` is the last generated token's vector
    (true) or the newest one ("last"); streaming sends it in a chunk of its own after the content."""
    path, hf = tiny_llama()
    text = "hello"

    async def calls(c):
        body = {"model": "m", "prompt": text, "max_tokens": N, "temperature": 0, "ignore_eos": True}
        comp = await c.post("/v1/completions", json={**body, "return_hidden_states": True, "n": 2})
        comp_last = await c.post("/v1/completions", json={**body, "return_hidden_states": "last"})
        plain = await c.post("/v1/completions", json=body)
        comp_stream = await c.post("/v1/completions", json={**body, "return_hidden_states": True, "stream": True})
        chat_body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": N,
                     "temperature": 0, "ignore_eos": True, "return_hidden_states": True}
        chat = await c.post("/v1/chat/completions", json=chat_body)
        chat_stream = await c.post("/v1/chat/completions", json={**chat_body, "stream": True})
        tokens = await c.post("/generate", json={"text": text, "sampling_params": greedy(N)})
        return comp, comp_last, plain, comp_stream, chat, chat_stream, tokens

    comp, comp_last, plain, comp_stream, chat, chat_stream, tokens = _serve(path, calls, enable_return_hidden_states=True)
    from tests.conftest import char_tokenizer

    p = char_tokenizer().encode(text, add_special_tokens=True)
    out = tokens.json()["output_ids"]
    want = hf_rows(hf, p + out[:-1])[-1]
    for r in (comp, comp_last, plain, chat):
        assert r.status_code == 200, r.text
    for choice in comp.json()["choices"]:
        torch.testing.assert_close(torch.tensor(choice["hidden_states"]), want, atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.tensor(comp_last.json()["choices"][0]["hidden_states"]), want, atol=ATOL, rtol=0)
    assert "hidden_states" not in plain.json()["choices"][0]
    torch.testing.assert_close(torch.tensor(chat.json()["choices"][0]["hidden_states"]), want, atol=ATOL, rtol=0)
    events = _events(comp_stream.text)
    with_hs = [e for e in events if e["choices"] and "hidden_states" in e["choices"][0]]
    assert len(with_hs) == 1 and with_hs[0]["choices"][0]["text"] == "", events
    assert events.index(with_hs[0]) == len(events) - 1  # after the text and its finish_reason
    torch.testing.assert_close(torch.tensor(with_hs[0]["choices"][0]["hidden_states"]), want, atol=ATOL, rtol=0)
    events = _events(chat_stream.text)
    with_hs = [e for e in events if e["choices"] and "hidden_states" in e["choices"][0]["delta"]]
    assert len(with_hs) == 1 and events.index(with_hs[0]) == len(events) - 1, events
    torch.testing.assert_close(torch.tensor(with_hs[0]["choices"][0]["delta"]["hidden_states"]), want, atol=ATOL, rtol=0)


def test_http_requests_without_the_flag_are_a_400(tiny_llama):
    path, _ = tiny_llama()

    async def calls(c):
        gen = await c.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": greedy(2),
                                              "return_hidden_states": True})
        comp = await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2,
                                                     "return_hidden_states": True})
        chat = await c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 2, "return_hidden_states": "last"})
        ok = await c.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": greedy(2),
                                             "return_hidden_states": False})
        return gen, comp, chat, ok

    gen, comp, chat, ok = _serve(path, calls)
    for r in (gen, comp, chat):
        assert r.status_code == 400, r.text
        assert "not configured to return hidden states" in r.text
    assert ok.status_code == 200 and "hidden_states" not in ok.json()["meta_info"]
