"""The Llama plugin served by the engine vs transformers, on tiny random checkpoints.

Every variant (GQA, head_dim != hidden/heads, MQA, tied embeddings, llama3 and linear
rope scaling) must give transformers' prompt logprobs within fp32 tolerance and its
greedy tokens, alone, batched, and when requests arrive while others decode.
"""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
import torch

from tests.conftest import TINY_VARIANTS, assert_greedy_matches, assert_pool_free, finished_requests, greedy, hf_logprobs
from core.engine.sampling_params import SamplingParams

ATOL = 1e-4


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 256) for _ in range(length - 1)]


@pytest.fixture(scope="module", params=list(TINY_VARIANTS))
def variant(request, tiny_llama, engine_factory):
    path, hf = tiny_llama(request.param)
    eng = engine_factory(path, skip_tokenizer_init=True, max_total_tokens=512)
    return request.param, eng, hf


@pytest.fixture(scope="module")
def gqa(tiny_llama):
    return tiny_llama("gqa")


def check_logprobs(out: dict, prompt_ids: list[int], hf, top: int, atol: float = ATOL) -> None:
    """Prompt and output logprobs (and top-k) against transformers' log-softmax."""
    meta = out["meta_info"]
    ref = hf_logprobs(hf, prompt_ids + out["output_ids"])
    L = len(prompt_ids)
    inp = meta["input_token_logprobs"]
    assert [t for _, t, _ in inp] == prompt_ids
    assert inp[0][0] is None, "the first prompt token has no logprob"
    got = torch.tensor([lp for lp, _, _ in inp[1:]])
    want = ref[torch.arange(L - 1), torch.tensor(prompt_ids[1:], dtype=torch.long)] if L > 1 else torch.empty(0)
    torch.testing.assert_close(got, want, atol=atol, rtol=0)

    in_top = meta["input_top_logprobs"]
    assert len(in_top) == L and in_top[0] is None
    for i in range(1, L):
        check_top(in_top[i], ref[i - 1], top, atol)

    outs = meta["output_token_logprobs"]
    assert [t for _, t, _ in outs] == out["output_ids"]
    got = torch.tensor([lp for lp, _, _ in outs])
    want = ref[torch.arange(L - 1, L - 1 + len(outs)), torch.tensor(out["output_ids"], dtype=torch.long)]
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    out_top = meta["output_top_logprobs"]
    assert len(out_top) == len(outs)
    for k, entry in enumerate(out_top):
        check_top(entry, ref[L - 1 + k], top, atol)


def check_top(entry: list, ref_row: torch.Tensor, top: int, atol: float = ATOL) -> None:
    """Top-k (logprob, token id, text) entries: sorted, the right values, and each id's value is its
    own logprob (tie-proof)."""
    assert len(entry) == top
    ids = [t for _, t, _ in entry]
    vals = torch.tensor([v for v, _, _ in entry])
    assert len(set(ids)) == top
    torch.testing.assert_close(vals, ref_row.topk(top).values, atol=atol, rtol=0)
    torch.testing.assert_close(vals, ref_row[torch.tensor(ids)], atol=atol, rtol=0)


# --------------------------------------------------------------------------- per variant


def test_prefill_and_decode_logprobs_match_transformers(variant):
    name, eng, hf = variant
    prompts = [prompt(1, 1), prompt(6, 2), prompt(29, 3)]
    outs = eng.generate(input_ids=prompts, sampling_params=greedy(4), return_logprob=True, logprob_start_len=0,
                        top_logprobs_num=5)
    assert len(outs) == 3
    for p, out in zip(prompts, outs):
        assert out["meta_info"]["prompt_tokens"] == len(p) and out["meta_info"]["completion_tokens"] == 4
        check_logprobs(out, p, hf, 5)
    assert_pool_free(eng)


def test_batched_greedy_matches_transformers(variant):
    name, eng, hf = variant
    prompts = [prompt(2, 10), prompt(37, 11), prompt(11, 12), prompt(20, 13)]
    outs = eng.generate(input_ids=prompts, sampling_params=greedy(10))
    for p, out in zip(prompts, outs):
        assert_greedy_matches(hf, p, out["output_ids"], 10)
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    # the same prompt alone gives the same tokens as inside the batch
    alone = eng.generate(input_ids=prompts[1], sampling_params=greedy(10))
    assert alone["output_ids"] == outs[1]["output_ids"]
    assert_pool_free(eng)


# --------------------------------------------------------------------------- arrivals


def test_logprob_start_len_offsets_the_prompt_logprobs(gqa, engine_factory):
    path, hf = gqa
    eng = engine_factory(path, skip_tokenizer_init=True)
    p = prompt(12, 5)
    out = eng.generate(input_ids=p, sampling_params=greedy(1), return_logprob=True, logprob_start_len=4, top_logprobs_num=2)
    meta = out["meta_info"]
    ref = hf_logprobs(hf, p)
    assert [t for _, t, _ in meta["input_token_logprobs"]] == p[4:]
    got = torch.tensor([lp for lp, _, _ in meta["input_token_logprobs"]])
    torch.testing.assert_close(got, ref[torch.arange(3, 11), torch.tensor(p[4:])], atol=ATOL, rtol=0)
    assert len(meta["input_top_logprobs"]) == 8
    # without logprob_start_len only output logprobs come back (the input list empty, as SGLang's)
    out = eng.generate(input_ids=p, sampling_params=greedy(2), return_logprob=True)
    assert out["meta_info"]["input_token_logprobs"] == [] and len(out["meta_info"]["output_token_logprobs"]) == 2


@pytest.mark.parametrize("page_size", [1, 4])
def test_prefills_interleaved_with_decodes_match_transformers(gqa, engine_factory, page_size):
    """Later requests are submitted from inside the engine loop once the first has produced
    3 and 6 tokens, so their prefills deterministically land between its decode steps."""
    path, hf = gqa
    eng = engine_factory(path, skip_tokenizer_init=True, page_size=page_size, max_total_tokens=256)
    ae = eng.engine
    prompts = [prompt(9, 20), prompt(23, 21), prompt(4, 22)]
    lens = [16, 8, 6]

    async def scenario():
        groups = [ae.make_requests(p, SamplingParams(**greedy(n))) for p, n in zip(prompts, lens)]
        first = groups[0][0]
        pending = {3: groups[1], 6: groups[2]}
        steps = []

        def listener(batch, dt):
            steps.append((batch.is_prefill, [r.rid for r in batch.reqs]))
            k = len(first.output_ids)  # tokens before this step's result
            if k in pending:
                ae.submit(pending.pop(k))

        ae.step_listeners.append(listener)
        try:
            ae.submit(groups[0])

            async def drain(r):
                async for _ in ae.stream(r):
                    pass

            await asyncio.gather(*(drain(g[0]) for g in groups))
        finally:
            ae.step_listeners.remove(listener)
        return [g[0] for g in groups], steps

    reqs, steps = eng._call(scenario())
    rids = [r.rid for r in reqs]
    prefills = [ids for pre, ids in steps if pre]
    assert prefills == [[rids[0]], [rids[1]], [rids[2]]]
    # the later prefills ran while the first request was mid-decode, and all three then decoded together
    i1 = steps.index((True, [rids[1]]))
    assert any(not pre and rids[0] in ids for pre, ids in steps[:i1])
    assert any(not pre and set(ids) == set(rids) for pre, ids in steps)
    for p, n, r in zip(prompts, lens, reqs):
        assert_greedy_matches(hf, p, r.output_ids, n)
    assert_pool_free(eng)


def test_threads_arriving_at_different_times_match_transformers(gqa, engine_factory):
    path, hf = gqa
    eng = engine_factory(path, skip_tokenizer_init=True)
    prompts = [prompt(7, 30), prompt(31, 31), prompt(15, 32)]
    lens = [14, 9, 7]
    results: dict[int, dict] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            results[i] = eng.generate(input_ids=prompts[i], sampling_params=greedy(lens[i]))
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in (1, 2)]
    with finished_requests(eng) as done:
        # the main thread streams the first request and starts the others once it has produced 2 and 4 tokens
        for chunk in eng.generate(input_ids=prompts[0], sampling_params=greedy(lens[0]), stream=True, rid="first"):
            n = len(chunk["output_ids"])
            for t, at in zip(threads, (2, 4)):
                if n >= at and t.ident is None:
                    t.start()
        for t in threads:
            if t.ident is None:
                t.start()
            t.join(60)
    assert not errors, errors
    assert_greedy_matches(hf, prompts[0], done["first"].output_ids, lens[0])
    for i in (1, 2):
        assert_greedy_matches(hf, prompts[i], results[i]["output_ids"], lens[i])
    assert_pool_free(eng)


def test_async_tasks_arriving_at_different_times_match_transformers(gqa, engine_factory):
    path, hf = gqa
    eng = engine_factory(path, skip_tokenizer_init=True)
    prompts = [prompt(5, 40), prompt(18, 41), prompt(33, 42), prompt(2, 43)]
    lens = [12, 10, 8, 6]

    async def main():
        progressed = [asyncio.Event() for _ in prompts]

        async def one(i: int) -> None:
            if i:
                await progressed[i - 1].wait()
            agen = await eng.async_generate(input_ids=prompts[i], sampling_params=greedy(lens[i]), stream=True, rid=f"t{i}")
            async for chunk in agen:
                if len(chunk["output_ids"]) >= 2:
                    progressed[i].set()
            progressed[i].set()

        await asyncio.gather(*(one(i) for i in range(len(prompts))))

    with finished_requests(eng) as done:
        asyncio.run(main())
    for i, (p, n) in enumerate(zip(prompts, lens)):
        assert_greedy_matches(hf, p, done[f"t{i}"].output_ids, n)
    assert_pool_free(eng)


def test_small_paged_pool_queues_and_still_matches_transformers(gqa, engine_factory):
    """page_size=4 and a 64-token pool: the six requests need 31 pages, the pool has 16,
    so some wait for others' pages; results are unaffected and the pool ends empty."""
    path, hf = gqa
    eng = engine_factory(path, skip_tokenizer_init=True, page_size=4, max_total_tokens=64, max_running_requests=8)
    ae = eng.engine
    assert ae.allocator.capacity == 16 and ae.max_total_tokens == 64
    prompts = [prompt(5 + 3 * i, 50 + i) for i in range(6)]
    running_sizes = []
    listener = lambda batch, dt: running_sizes.append(len(ae.scheduler.running))  # noqa: E731
    ae.step_listeners.append(listener)
    try:
        outs = eng.generate(input_ids=prompts, sampling_params=greedy(8), return_logprob=True, logprob_start_len=0,
                            top_logprobs_num=2)
    finally:
        ae.step_listeners.remove(listener)
    assert max(running_sizes) < 6, "the pool was expected to force queueing"
    for p, out in zip(prompts, outs):
        assert_greedy_matches(hf, p, out["output_ids"], 8)
        check_logprobs(out, p, hf, 2)
    assert_pool_free(eng)


# --------------------------------------------------------------------------- dtype and checkpoints


def test_bfloat16_engine_stays_close_to_float32(gqa, engine_factory):
    path, hf = gqa
    # torch_native computes attention as transformers does in bf16 (the cpu backend accumulates in fp32:
    # as close to float32, other rounding; tests/test_cpu_attention.py checks that)
    eng = engine_factory(path, skip_tokenizer_init=True, dtype="bfloat16", attention_backend="torch_native")
    assert eng.engine.model_config.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in eng.engine.model.parameters())
    assert eng.engine.kv_cache.k[0].dtype == torch.bfloat16
    p = prompt(20, 60)
    out = eng.generate(input_ids=p, sampling_params=greedy(4), return_logprob=True, logprob_start_len=0)
    from transformers import LlamaForCausalLM

    # on the engine's device: bf16 rounding differs between CPU and GPU kernels
    hf_bf16 = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(eng.engine.device).eval()
    idx = (torch.arange(19), torch.tensor(p[1:]))
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]])
    # same numerics as transformers in bfloat16, and within bfloat16 error of float32
    # (a GPU's bf16 GEMMs pick shape-dependent algorithms: there the two differ by a few more ulps)
    near = 2e-2 if eng.engine.device.type == "cpu" else 8e-2
    torch.testing.assert_close(got, hf_logprobs(hf_bf16, p)[idx], atol=near, rtol=0)
    torch.testing.assert_close(got, hf_logprobs(hf, p)[idx], atol=0.5, rtol=0)
    assert len(out["output_ids"]) == 4
    assert_pool_free(eng)


def _edit_checkpoint(src, dst, edit) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    edit(state)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("drop", ["model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                                  "model.layers.1.mlp.up_proj.weight", "model.norm.weight", "lm_head.weight"])
def test_checkpoint_missing_a_tensor_is_a_load_error(gqa, tmp_path, drop):
    """A packed parameter counts as loaded only when every shard was in the checkpoint."""
    from core.errors import ModelLoadError
    from tests.conftest import make_engine

    src, _ = gqa
    _edit_checkpoint(src, tmp_path / "m", lambda st: st.pop(drop))
    with pytest.raises(ModelLoadError, match="missing 1 tensor") as e:
        make_engine(tmp_path / "m", skip_tokenizer_init=True)
    assert drop in str(e.value)


def test_tied_checkpoint_needs_no_lm_head(tiny_llama, engine_factory):
    path, hf = tiny_llama("tied")
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()
    eng = engine_factory(path, skip_tokenizer_init=True)
    assert not hasattr(eng.engine.model, "lm_head")


@pytest.mark.parametrize("case", ["unexpected", "shape"])
def test_bad_checkpoint_tensor_is_a_load_error_naming_it(gqa, tmp_path, case):
    from core.errors import ModelLoadError
    from tests.conftest import make_engine

    src, _ = gqa
    if case == "unexpected":
        name = "model.layers.0.mlp.extra.weight"
        _edit_checkpoint(src, tmp_path / "m", lambda st: st.__setitem__(name, torch.zeros(2, 2)))
    else:
        name = "model.layers.1.self_attn.v_proj.weight"
        _edit_checkpoint(src, tmp_path / "m", lambda st: st.__setitem__(name, st[name][:-1].clone()))
    with pytest.raises(ModelLoadError) as e:
        make_engine(tmp_path / "m", skip_tokenizer_init=True)
    assert name in str(e.value)


# --------------------------------------------------------------------------- SmolLM2 (the real default model)

SMOL_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village nestled between rolling hills and a quiet river, there lived",
    "def fibonacci(n):",
]


@pytest.mark.slow
def test_smollm2_chat_answer_contains_paris(smollm2):
    eng, _ = smollm2
    text = eng.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                             tokenize=False, add_generation_prompt=True)
    out = eng.generate(text, {"temperature": 0, "max_new_tokens": 24})
    assert "Paris" in out["text"]
    assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    assert_pool_free(eng)


@pytest.mark.slow
def test_smollm2_concurrent_greedy_and_logprobs_match_transformers(smollm2):
    eng, hf = smollm2
    ids = [eng.tokenizer.encode(p, add_special_tokens=True) for p in SMOL_PROMPTS]
    assert len({len(i) for i in ids}) == 3
    outs = eng.generate(SMOL_PROMPTS, greedy(16), return_logprob=True, logprob_start_len=0, top_logprobs_num=3)
    for p, out in zip(ids, outs):
        assert out["meta_info"]["prompt_tokens"] == len(p)
        assert_greedy_matches(hf, p, out["output_ids"], 16)
        check_logprobs(out, p, hf, 3, atol=2e-4)
    assert outs[0]["text"].lstrip().startswith("Paris")
    assert_pool_free(eng)


@pytest.mark.slow
def test_smollm2_stream_and_stop_string(smollm2):
    eng, _ = smollm2
    text = eng.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                             tokenize=False, add_generation_prompt=True)
    sp = {"temperature": 0, "max_new_tokens": 24}
    full = eng.generate(text, sp)
    chunks = list(eng.generate(text, sp, stream=True))
    assert chunks[-1]["text"] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]
    assert all(b["text"].startswith(a["text"]) for a, b in zip(chunks, chunks[1:]))
    assert "Paris" in full["text"] and " is" in full["text"]
    cut = eng.generate(text, {**sp, "stop": " is"})
    assert cut["text"] == full["text"][: full["text"].index(" is")]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": " is"}
    assert_pool_free(eng)
