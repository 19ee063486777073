"""``--num-continuous-decode-steps``: a decode batch of several steps gives the tokens, texts and
finish reasons of one step per batch, stops where single steps stop, and leaves the pool as they do,
both through the CPU decode stack's one call (greedy) and one forward a step (any other batch)."""

from __future__ import annotations

import pytest

from core.errors import CoreError
from core_kernels import cpu_decode, cpu_gemv
from tests.conftest import assert_pool_free, make_engine
from tests.server_utils import default_server, start_server  # noqa: F401 (default_server: a fixture)

PROMPTS = ["a", "hello world", "abc abc abc abc", "xy"]
STEPS = 4

# the stack runs whole decode steps where its GEMMs have kernels: float32 on AVX2, bf16 on AVX512-BF16
if cpu_decode.available() and cpu_gemv.available_f32():
    STACK = {"dtype": "float32", "torchao_config": "int8wo", "attention_backend": "cpu"}
elif cpu_decode.available() and cpu_gemv.available():
    STACK = {"dtype": "bfloat16", "torchao_config": "int8wo", "attention_backend": "cpu"}
else:
    STACK = None
ROUTES = [
    pytest.param(STACK, id="stack", marks=pytest.mark.skipif(STACK is None, reason="needs the C++ decode stack's gemv "
                                                                 "kernels (AVX2 + FMA, or AVX512-BF16)")),
    pytest.param({"attention_backend": "torch_native"}, id="forward_per_step"),
]


def run(path, steps: int, params: list[dict], monkeypatch, poison: bool = False, **opts) -> tuple[list[tuple], list[int], int]:
    """(output ids, text and finish reason of each prompt: all together, then the first two alone;
    the steps each decode batch ran; the calls of the stack's multi-step op). ``poison`` fills the
    KV pool's slots (all but the zeroed padding page) with NaN first, as fresh ``torch.empty``
    memory may hold."""
    fused = []
    real = cpu_decode.decode_steps
    monkeypatch.setattr(cpu_decode, "decode_steps", lambda *a: fused.append(1) or real(*a))
    eng = make_engine(path, num_continuous_decode_steps=steps, **opts)
    if poison:
        kv = eng.engine.kv_cache
        for t in kv.k + kv.v:
            t[kv.page_size :].fill_(float("nan"))
    ran: list[int] = []
    eng.engine.step_listeners.append(lambda batch, _: ran.append(batch.steps_run) if not batch.is_prefill else None)
    try:
        outs = eng.generate(PROMPTS[: len(params)], params)
        outs += [eng.generate(p, sp) for p, sp in zip(PROMPTS[:2], params[:2])]
        assert_pool_free(eng)
    finally:
        eng.shutdown()
    return [(o["output_ids"], o["text"], o["meta_info"]["finish_reason"]) for o in outs], ran, len(fused)


def lengths(*ns: int, **extra) -> list[dict]:
    return [{"temperature": 0.0, "max_new_tokens": n, **extra} for n in ns]


@pytest.mark.parametrize("route", ROUTES)
def test_several_steps_a_batch_give_the_tokens_of_one(tiny_llama, monkeypatch, route):
    path, _ = tiny_llama()
    params = lengths(5, 7, 9, 14, ignore_eos=True)
    want, ran_one, _ = run(path, 1, params, monkeypatch, **route)
    got, ran, fused = run(path, STEPS, params, monkeypatch, **route)
    assert got == want
    assert set(ran_one) == {1} and max(ran) == STEPS  # (fewer where a max_new_tokens came first)
    assert (fused > 0) == (route is STACK)


@pytest.mark.parametrize("route", ROUTES)
def test_stop_tokens_and_strings_inside_the_steps(tiny_llama, monkeypatch, route):
    """A stop token or stop string met in the middle of a batch's steps ends the request there:
    the tokens after it are dropped, as single steps never produce them."""
    path, _ = tiny_llama()
    free, _, _ = run(path, 1, lengths(12, 12, ignore_eos=True), monkeypatch, **route)
    tok = free[0][0][5]  # a token the first prompt produces sixth (it may produce it earlier too)
    text = free[1][1]
    stop = text[6:8] if text[6:8].strip() else text[3:8]  # a string the second prompt's text reaches mid-way
    params = [{"temperature": 0.0, "max_new_tokens": 12, "stop_token_ids": [tok]},
              {"temperature": 0.0, "max_new_tokens": 12, "stop": [stop]}]
    want, _, _ = run(path, 1, params, monkeypatch, **route)
    got, ran, _ = run(path, STEPS, params, monkeypatch, **route)
    assert got == want
    assert want[0][2] == {"type": "stop", "matched": tok} and want[1][2] == {"type": "stop", "matched": stop}
    assert len(want[0][0]) <= 6 and max(ran) > 1


@pytest.mark.parametrize("route", ROUTES)
def test_slots_not_yet_written_never_reach_a_result(tiny_llama, monkeypatch, route):
    """A multi-step batch takes every step's slots up front, and a stop leaves some never written;
    what such slots hold (here NaN) must not reach any step's attention, whose padded gathers
    (torch_native) read past each sequence's keys. Single steps over a clean pool give the answer."""
    path, _ = tiny_llama()
    params = lengths(5, 7, 9, 14, ignore_eos=True)
    want, _, _ = run(path, 1, params, monkeypatch, **route)
    for steps in (1, STEPS):
        got, _, _ = run(path, steps, params, monkeypatch, poison=True, **route)
        assert got == want, steps


def test_seeded_sampling_samples_the_same_tokens(tiny_llama, monkeypatch):
    """Sampled rows run one forward and one sampling a step: a seeded request's tokens are those
    of single steps."""
    path, _ = tiny_llama()
    params = [{"temperature": 0.9, "top_p": 0.9, "max_new_tokens": 10, "seed": 11, "ignore_eos": True},
              {"temperature": 1.0, "max_new_tokens": 9, "seed": 5, "ignore_eos": True}]
    want, _, _ = run(path, 1, params, monkeypatch)
    got, ran, fused = run(path, STEPS, params, monkeypatch)
    assert got == want and max(ran) == STEPS and fused == 0


def test_the_flag_must_be_positive(tiny_llama):
    path, _ = tiny_llama()
    with pytest.raises(CoreError, match="--num-continuous-decode-steps must be >= 1, got 0"):
        make_engine(path, num_continuous_decode_steps=0)


@pytest.mark.slow
def test_a_server_streams_the_bursts_as_the_tokens_of_single_steps(default_server):
    """``core serve --num-continuous-decode-steps 8`` on the default model, through the OpenAI client:
    a streamed greedy answer (several tokens a chunk) and a stop string met inside a burst give the
    text, finish reason and token count of the default server's single steps."""
    import openai

    messages = [{"role": "user", "content": "List the planets of the solar system, one per line."}]

    def ask(url: str, **extra) -> tuple[str, str, int, int]:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        chunks = list(client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=48, stream=True,
                                                     stream_options={"include_usage": True}, **extra))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][0]
        return text, finish, chunks[-1].usage.completion_tokens, sum(1 for c in chunks if c.choices and c.choices[0].delta.content)

    want = ask(default_server)
    stop = want[0][len(want[0]) // 2 :][:4]  # four characters from the middle of the answer
    want_stop = ask(default_server, stop=[stop])
    with start_server("--num-continuous-decode-steps", "8") as url:
        got, got_stop = ask(url), ask(url, stop=[stop])
    assert got[:3] == want[:3] and got_stop[:3] == want_stop[:3]
    assert want_stop[1] == "stop" and len(want_stop[0]) < len(want[0])
    assert got[3] < want[3]  # fewer chunks: tokens arrive several at a time


def test_the_first_token_streams_before_the_first_burst(tiny_llama):
    """A prefill's token reaches its stream before the next decode batch (which runs on the event
    loop's thread at small batch sizes) holds the loop for its steps: the steps do not add to the TTFT."""
    import asyncio

    path, _ = tiny_llama()
    eng = make_engine(path, num_continuous_decode_steps=16)
    decoded: list[int] = []  # the decode steps run so far
    eng.engine.step_listeners.append(lambda batch, _: decoded.append(batch.steps_run) if not batch.is_prefill else None)

    async def first_chunk() -> tuple[int, int]:
        """(decode steps run when the first token arrived, tokens in all)."""
        seen, n = None, 0
        params = {"temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True}
        async for chunk in await eng.engine.generate("hello", params, stream=True):
            if seen is None and chunk["output_ids"]:
                seen = sum(decoded)
            n = len(chunk["output_ids"])
        return seen, n

    try:
        seen, n = asyncio.run_coroutine_threadsafe(first_chunk(), eng._loop).result()
    finally:
        eng.shutdown()
    assert n == 40 and max(decoded) == 16 and seen == 0, (seen, decoded)
