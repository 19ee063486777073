"""The offline ``Engine`` as SGLang's: its positional order, lists aligned with a batch, the
context check, and unseeded samples that differ from one launch to the next (each test failed
before its fix)."""

from __future__ import annotations

import inspect

import pytest

import core
from core.errors import CoreError, InvalidRequest
from tests.conftest import build_tiny_llama, make_engine

SP = {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True}
GREEDY2 = {"max_new_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = tmp_path_factory.mktemp("tiny")
    build_tiny_llama(p, initializer_range=0.02)  # flat logits: samples vary
    return p


@pytest.fixture(scope="module")
def eng(path):
    e = make_engine(path, context_length=32)
    yield e
    e.shutdown()


def test_generate_takes_sglangs_first_four_parameters_in_its_order():
    """SGLang's fourth parameter is image_data; ours was return_logprob, so ``generate(p, sp, None,
    img)`` turned logprobs on and dropped the image. The rest are keyword-only now."""
    for fn in (core.Engine.generate, core.Engine.async_generate):
        params = list(inspect.signature(fn).parameters.values())[1:]
        assert [p.name for p in params[:4]] == ["prompt", "sampling_params", "input_ids", "image_data"]
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[4:])


def test_batch_lists_are_aligned_with_the_prompts(eng):
    out = eng.generate(["ab", "cd"], GREEDY2, rid=["x1", "x2"], return_logprob=[True, False],
                       top_logprobs_num=[2, 0], logprob_start_len=[0, None])
    assert [o["meta_info"]["id"] for o in out] == ["x1", "x2"]
    assert len(out[0]["meta_info"]["output_top_logprobs"][0]) == 2 and out[0]["meta_info"]["input_token_logprobs"]
    assert "output_token_logprobs" not in out[1]["meta_info"]
    assert [o["meta_info"]["id"] for o in eng.generate(["ab", "cd"], GREEDY2, rid="job")] == ["job_0", "job_1"]
    with pytest.raises(InvalidRequest, match="rid has 1 entries but there are 2 prompts"):
        eng.generate(["ab", "cd"], GREEDY2, rid=["only-one"])
    with pytest.raises(InvalidRequest, match="return_logprob has 3 entries"):
        eng.generate(["ab", "cd"], GREEDY2, return_logprob=[True, False, True])


def test_an_explicit_max_new_tokens_must_fit_the_context(eng):
    """SGLang's Engine raises where the total passes the context; it was cut to fit without a word.
    Exactly filling the context is allowed; an omitted max_new_tokens is still cut to what fits."""
    ids = list(range(10, 20))
    with pytest.raises(InvalidRequest, match="maximum context length of 32"):
        eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 23, "ignore_eos": True})
    full = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 22, "temperature": 0, "ignore_eos": True})
    assert len(full["output_ids"]) == 22
    cut = eng.generate(input_ids=ids * 2, sampling_params={"temperature": 0, "ignore_eos": True})  # default 128
    assert len(cut["output_ids"]) == 32 - 20


def test_unseeded_samples_differ_between_launches_unless_a_seed_is_given(path):
    """SGLang draws a random seed per launch when --random-seed is not given; ours was 0, so every
    restart repeated the same "random" samples."""
    def sample(seed):
        e = make_engine(path, random_seed=seed)
        try:
            return [e.generate("hello", SP)["output_ids"] for _ in range(2)], e.engine.random_seed
        finally:
            e.shutdown()

    (a, seed_a), (b, seed_b) = sample(None), sample(None)
    assert a != b and seed_a != seed_b
    assert sample(7) == sample(7)


def test_the_tokenizers_eos_token_stops_generation(tmp_path):
    """A chat fine-tune's tokenizer often names another EOS (<|im_end|>) than config.json's; SGLang
    and vLLM stop at it too, where generation ran on to max_new_tokens."""
    import json

    from transformers import AutoTokenizer

    build_tiny_llama(tmp_path)
    eng = make_engine(tmp_path)
    try:
        first = eng.generate("The quick brown fox", {"temperature": 0, "max_new_tokens": 8})["output_ids"][0]
    finally:
        eng.shutdown()
    cfg_file = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["eos_token"] = AutoTokenizer.from_pretrained(tmp_path).convert_ids_to_tokens(first)
    cfg_file.write_text(json.dumps(cfg))
    eng = make_engine(tmp_path)
    try:
        out = eng.generate("The quick brown fox", {"temperature": 0, "max_new_tokens": 8})
        assert first in eng.engine.model_config.eos_ids
    finally:
        eng.shutdown()
    assert out["output_ids"] == [first] and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}


def test_preferred_sampling_params_of_the_offline_engine(path):
    """SGLang's Engine takes ``preferred_sampling_params`` (its tokenizer manager merges them, so the
    offline engine honours them as /generate does): under each request's own keys."""
    with pytest.raises(CoreError, match="preferred_sampling_params: n cannot be a server default"):
        core.Engine(model_path=str(path), preferred_sampling_params={"n": 2})
    with pytest.raises(CoreError, match="preferred_sampling_params: .*temperature"):
        core.Engine(model_path=str(path), preferred_sampling_params={"temperature": -1})
    e = make_engine(path, context_length=32, preferred_sampling_params={"max_new_tokens": 3, "temperature": 0,
                                                                       "ignore_eos": True})
    try:
        plain = e.generate(input_ids=[5, 6, 7])
        assert len(plain["output_ids"]) == 3 and plain["meta_info"]["finish_reason"]["type"] == "length"
        again = [e.generate(input_ids=[5, 6, 7])["output_ids"] for _ in range(3)]
        assert again == [plain["output_ids"]] * 3  # greedy from the preferred temperature (flat logits: samples vary)
        own = e.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params=[{"max_new_tokens": 5}, None])
        assert [len(o["output_ids"]) for o in own] == [5, 3]
        assert own[0]["output_ids"][:3] == plain["output_ids"]  # still greedy: only max_new_tokens was the request's
        chunks = list(e.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2}, stream=True))
        assert chunks[-1]["output_ids"] == plain["output_ids"][:2]
    finally:
        e.shutdown()
